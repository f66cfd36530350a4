"""DFlash2 export and decode: the public serving folder, strict reload, and the selector's proposals
(lossless through the speculative loop) on a tiny real Qwen3 target."""

import dataclasses
import inspect
import json

import pytest
import torch

from dflash_prep.errors import ConfigError, FingerprintMismatch, FormatError
from dflash_prep.train import checkpoint as ckpt
from dflash_prep.train.objectives.dflash import export as v1_export
from dflash_prep.train.objectives.dflash.decode import DFlashProposer
from dflash_prep.train.objectives.dflash.drafter import Drafter, DrafterConfig, build_target_layer_ids
from dflash_prep.train.objectives.dflash2 import decode
from dflash_prep.train.objectives.dflash2.drafter import DFlash2Config, DFlash2Drafter
from dflash_prep.train.objectives.dflash2.export import (
    DFLASH_CONFIG_FIELDS, export_checkpoint, load_export, public_config, write_export)
from dflash_prep.train.objectives.dflash2.selector import brute_force_walk, greedy_walk
from dflash_prep.train.speculate import Target, greedy_generate, speculative_generate

from dflash_prep.tests.train.dflash_fixtures import MASK_ID, tiny_target

B = 4


def _cfg(**kw):
    base = dict(hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=48, num_layers=2, rms_norm_eps=1e-6,
                rope_theta=10000.0, max_position=256, block_size=B, num_target_layers=6,
                target_layer_ids=build_target_layer_ids(6, 2), mask_token_id=3, vocab_size=40,
                conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=3, selector_init="normal")
    base.update(kw)
    return DFlash2Config(**base)


def _trained_like(cfg, seed=0, codebook_std=1.0):
    """Every parameter random (norm gains, conv base kernels and projections, both codebooks), so
    a dropped, renamed or transposed tensor shows and the selector's edge terms matter."""
    torch.manual_seed(seed)
    d = DFlash2Drafter(cfg)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if "codebook" in name:
                if not (cfg.selector_init == "zero" and "successor" in name):
                    p.normal_(0.0, codebook_std)
            elif "kernel_projection" in name:
                p.normal_(0.0, 0.05)
            else:
                p.add_(torch.randn_like(p) * 0.2)
    return d.eval()


def _contract_shapes(cfg):
    """The checkpoint's tensors as the public contract lists them (Z-hdr / vLLM qwen3_dflash2)."""
    H, D, T, R, V = cfg.hidden, cfg.head_dim, cfg.conv_kernel_size, cfg.selector_rank, cfg.vocab_size
    G = H // cfg.conv_group_size
    want = {"fc.weight": (H, cfg.num_taps * H), "hidden_norm.weight": (H,), "norm.weight": (H,),
            "candidate_selector.hidden_projection.weight": (R, H),
            "candidate_selector.predecessor_codebook": (V, R), "candidate_selector.successor_codebook": (V, R)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        want |= {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                 p + "self_attn.q_proj.weight": (cfg.heads * D, H), p + "self_attn.k_proj.weight": (cfg.kv_heads * D, H),
                 p + "self_attn.v_proj.weight": (cfg.kv_heads * D, H), p + "self_attn.o_proj.weight": (H, cfg.heads * D),
                 p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,),
                 p + "mlp.gate_proj.weight": (cfg.intermediate, H), p + "mlp.up_proj.weight": (cfg.intermediate, H),
                 p + "mlp.down_proj.weight": (H, cfg.intermediate)}
        for conv in ("attention_conv", "mlp_conv"):
            want |= {p + f"{conv}.base_kernel": (2, T, H), p + f"{conv}.kernel_projection.weight": (2 * T * G, H)}
    return want


def _rewrite_weights(folder, edit):
    """Drop the sidecar and rewrite model.safetensors with ``edit(state) -> state`` (a hand-made folder)."""
    from safetensors.torch import load, save

    (folder / "export.json").unlink(missing_ok=True)
    state = load((folder / "model.safetensors").read_bytes())
    (folder / "model.safetensors").write_bytes(save(edit(dict(state))))


# ----------------------------------------------------------------------------- export / load
@pytest.mark.parametrize("window", [0, 4])
def test_round_trip_is_bit_for_bit(tmp_path, window):
    cfg = _cfg(sliding_window=window)
    d = _trained_like(cfg)
    side = write_export(d, tmp_path / "x", source={"test": True})
    back, meta = load_export(tmp_path / "x")
    assert isinstance(back, DFlash2Drafter) and back.config == cfg  # selector_init from the sidecar
    want, got = d.state_dict(), back.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert meta["export"]["kind"] == "dflash2" and meta["export"]["weights_fingerprint"] == side["weights_fingerprint"]
    assert {k: meta[k] for k in ("block_size", "mask_token_id", "target_layer_ids", "hidden_size", "vocab_size")} == \
        {"block_size": B, "mask_token_id": 3, "target_layer_ids": [1, 3], "hidden_size": 32, "vocab_size": 40}
    assert (meta["output_multiplier"], meta["final_logit_softcapping"], meta["input_embedding_scale"]) == (1.0, None, 1.0)
    write_export(back, tmp_path / "again", source={"test": True})  # the reloaded drafter writes the same files
    for f in ("config.json", "model.safetensors"):
        assert (tmp_path / "x" / f).read_bytes() == (tmp_path / "again" / f).read_bytes(), f


def test_config_json_has_exactly_the_contract_fields(tmp_path):
    from transformers import Qwen3Config

    cfg = _cfg(sliding_window=6, num_layers=3, target_layer_ids=(1, 2, 3), num_target_layers=8)
    write_export(_trained_like(cfg), tmp_path / "x", source={})
    c = json.loads((tmp_path / "x" / "config.json").read_text())
    assert c["architectures"] == ["DFlash2DraftModel"] and c["model_type"] == "qwen3"
    assert c["is_causal"] is False and "auto_map" not in c
    assert c["dflash_config"] == {"block_size": 4, "mask_token_id": 3, "target_layer_ids": [1, 2, 3],
                                  "conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8,
                                  "selector_top_k": 3, "output_multiplier": 1.0}
    assert tuple(c["dflash_config"]) == DFLASH_CONFIG_FIELDS
    assert not any("softcap" in k for k in c) and not any("softcap" in k for k in c["dflash_config"])
    # the rest is DFlash's public config field for field (its top-level block_size included)
    v1 = v1_export.public_config(DrafterConfig(**{k: v for k, v in cfg.to_dict().items()
                                                  if k in DrafterConfig.__dataclass_fields__}))
    assert v1["is_causal"] is False      # DFlash's export says it too: the public model reads it the same way
    assert {k: v for k, v in c.items() if k not in ("architectures", "dflash_config", "is_causal")} == \
        {k: v for k, v in v1.items() if k not in ("architectures", "dflash_config", "auto_map", "is_causal")}
    assert c["block_size"] == c["dflash_config"]["block_size"] and c["num_target_layers"] == 8
    assert c["layer_types"] == ["sliding_attention"] * 3 and c["use_sliding_window"] is True and c["sliding_window"] == 6
    hc = Qwen3Config(**{k: v for k, v in c.items() if k not in ("architectures", "model_type")})
    assert hc.is_causal is False and hc.sliding_window == 6 and hc.dflash_config["selector_top_k"] == 3
    assert public_config(cfg, dtype="bfloat16")["dtype"] == "bfloat16"


def test_tensor_names_and_shapes_are_the_contracts(tmp_path):
    from safetensors import safe_open

    cfg = _cfg(num_layers=3, target_layer_ids=(1, 2, 3), num_target_layers=8, conv_kernel_size=3)
    write_export(_trained_like(cfg), tmp_path / "x", source={}, dtype="bfloat16")
    with safe_open(tmp_path / "x" / "model.safetensors", "pt") as f:
        got = {k: tuple(f.get_tensor(k).shape) for k in f.keys()}
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}
    assert got == _contract_shapes(cfg)
    assert got["layers.0.attention_conv.kernel_projection.weight"] == (2 * 3 * 4, 32)  # 2 sides x T x G
    assert not any(k.endswith("codebook.weight") or "embed_tokens" in k or "lm_head" in k for k in got)
    assert dtypes == {torch.bfloat16}
    side = json.loads((tmp_path / "x" / "export.json").read_text())
    assert side["format"] == "dflash-prep/drafter-export" and side["version"] == 1 and side["kind"] == "dflash2"
    assert side["drafter_config"]["selector_rank"] == 8 and "selector R = 8 K = 3" in side["summary"]
    half, _ = load_export(tmp_path / "x")
    assert half.config == cfg


def test_strict_refusals(tmp_path):
    cfg = _cfg()
    write_export(_trained_like(cfg), tmp_path / "x", source={})
    good = {f: (tmp_path / "x" / f).read_bytes() for f in ("config.json", "model.safetensors", "export.json")}

    def fresh():
        for f, b in good.items():
            (tmp_path / "x" / f).write_bytes(b)
        return tmp_path / "x"

    cfile = fresh() / "config.json"
    cfile.write_text(good["config.json"].decode().replace('"selector_top_k": 3', '"selector_top_k": 2'))
    with pytest.raises(FingerprintMismatch, match="changed"):
        load_export(tmp_path / "x")
    w = fresh() / "model.safetensors"
    w.write_bytes(good["model.safetensors"][:-4] + b"\0\0\0\0")
    with pytest.raises(FingerprintMismatch, match="changed"):
        load_export(tmp_path / "x")

    cases = {
        "missing": lambda s: {k: v for k, v in s.items() if k != "layers.1.mlp_conv.base_kernel"},
        "unexpected": lambda s: {**s, "layers.0.mlp_conv.bias": torch.zeros(32)},
        "shape mismatches": lambda s: {**s, "candidate_selector.successor_codebook": torch.zeros(40, 4)},
    }
    for reason, edit in cases.items():
        _rewrite_weights(fresh(), edit)
        with pytest.raises(FormatError, match=reason):
            load_export(tmp_path / "x")
    # z-lab's in-memory names (codebooks as Embedding .weight) are not the checkpoint's
    _rewrite_weights(fresh(), lambda s: {(k + ".weight" if k.endswith("codebook") else k): v for k, v in s.items()})
    with pytest.raises(FormatError, match="missing.*successor_codebook'.*unexpected"):
        load_export(tmp_path / "x")

    c = json.loads(good["config.json"])
    for edit, reason in ((lambda c: c["dflash_config"].pop("conv_group_size"), "lacks \\['conv_group_size'\\]"),
                         (lambda c: c.update(is_causal=True), "causally"),
                         (lambda c: (c.pop("is_causal"), c.update(layer_types=["sliding_attention"] * 2,
                                                                  use_sliding_window=True, sliding_window=8)),
                          "causally"),
                         (lambda c: (c.pop("is_causal"), c.pop("layer_types"), c.update(
                             use_sliding_window=True, sliding_window=8, max_window_layers=0)), "causally"),
                         (lambda c: c.update(architectures=["DFlashDraftModel"]), "lacks 'DFlash2DraftModel'")):
        cc = json.loads(json.dumps(c))
        edit(cc)
        fresh()
        (tmp_path / "x" / "export.json").unlink()
        (tmp_path / "x" / "config.json").write_text(json.dumps(cc))
        with pytest.raises(FormatError, match=reason):
            load_export(tmp_path / "x")

    # a DFlash2 folder is not a DFlash one, and back
    fresh()
    with pytest.raises(FormatError, match="lacks 'DFlashDraftModel'"):
        v1_export.load_export(tmp_path / "x")
    v1 = Drafter(DrafterConfig(**{k: v for k, v in cfg.to_dict().items() if k in DrafterConfig.__dataclass_fields__}))
    v1_export.write_export(v1, tmp_path / "v1", source={})
    with pytest.raises(FormatError, match="kind None"):
        load_export(tmp_path / "v1")
    (tmp_path / "v1" / "export.json").unlink()
    with pytest.raises(FormatError, match="lacks 'DFlash2DraftModel'"):
        load_export(tmp_path / "v1")
    with pytest.raises(FormatError, match="takes a DFlash2Drafter"):
        write_export(v1, tmp_path / "bad", source={})
    with pytest.raises(FormatError, match="exists"):
        write_export(_trained_like(cfg), fresh(), source={})  # no silent overwrite
    write_export(_trained_like(cfg), tmp_path / "x", source={}, overwrite=True)


def test_a_published_folder_without_a_sidecar_loads_with_its_unary_transform(tmp_path):
    """The released config's shape: block_size only in dflash_config, a multiplier and a softcap."""
    cfg = _cfg(sliding_window=4)
    d = _trained_like(cfg, seed=4)
    write_export(d, tmp_path / "x", source={})
    (tmp_path / "x" / "export.json").unlink()
    c = json.loads((tmp_path / "x" / "config.json").read_text())
    c.pop("block_size")
    c.pop("rope_theta")
    c["dflash_config"].update(output_multiplier=0.25, final_logit_softcapping=20.0)
    (tmp_path / "x" / "config.json").write_text(json.dumps(c))
    back, meta = load_export(tmp_path / "x")
    assert back.config == dataclasses.replace(cfg, selector_init="zero")  # the default: not a public field
    assert all(torch.equal(back.state_dict()[k], v) for k, v in d.state_dict().items())
    assert meta["export"] is None and meta["block_size"] == B
    assert (meta["output_multiplier"], meta["final_logit_softcapping"]) == (0.25, 20.0)


def test_export_checkpoint_has_dflashs_signature_and_reads_a_run(tmp_path):
    assert inspect.signature(export_checkpoint) == inspect.signature(v1_export.export_checkpoint)
    cfg = _cfg()
    d = _trained_like(cfg, seed=3)
    run = tmp_path / "run"
    run.mkdir()
    ckpt.save(run / ckpt.CKPT_FILE, model=d, optimizer=torch.optim.AdamW(d.parameters()), schedule={},
              rng=[ckpt.rng_state()], cursor={"epoch": 0, "step": 5, "global_step": 5}, run_key={"target": "abc"},
              model_config=cfg.to_dict())
    path = ckpt.path_of(run)
    side = export_checkpoint(ckpt.load(path), path, tmp_path / "x", dtype="float32", overwrite=False)
    assert side["source"]["global_step"] == 5 and side["source"]["run_key"] == {"target": "abc"}
    assert side["kind"] == "dflash2"
    back, _ = load_export(tmp_path / "x")
    assert back.config == cfg and all(torch.equal(back.state_dict()[k], v) for k, v in d.state_dict().items())


# ----------------------------------------------------------------------------- decode
@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_target()), dtype=torch.float32)
    with torch.no_grad():  # a sharper random target: logits far from ties, outputs not all one token
        model.lm_head.weight.mul_(30.0)
    return model


def _target_drafter(model, seed=0, **kw):
    base = DFlash2Config.from_target_config(model.config, num_layers=2, block_size=B, mask_token_id=MASK_ID)
    cfg = dataclasses.replace(base, **{"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8,
                                       "selector_top_k": 3, "selector_init": "normal", **kw})
    return _trained_like(cfg, seed=seed, codebook_std=2.0)


def _loaded(model, tmp_path, drafter, name="d", **load_kw):
    write_export(drafter, tmp_path / name, source={})
    target = Target(model, drafter.target_layer_ids)
    proposers, meta = decode.load(tmp_path / name, target, **load_kw)
    return target, dict(proposers), meta


def _walk_oracle(h, head_weight, anchor, sel, k, m=1.0, cap=None):
    """Plain loops: slot r's top k of the (transformed) head logits, value desc then id asc; from
    the anchor, each slot takes the candidate with the highest U + <A[prev] * P h_r, B[c]>,
    the first (lowest index) on ties."""
    A, Bc, P = sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight
    prev, out = int(anchor), []
    for r in range(h.shape[0]):
        logits = (head_weight @ h[r]) * m
        if cap:
            logits = torch.tanh(logits / cap) * cap
        order = sorted(range(logits.numel()), key=lambda t: (-float(logits[t]), t))[:k]
        q = P @ h[r]
        scores = [float(logits[c]) + float((A[prev] * q * Bc[c]).sum()) for c in order]
        best = max(range(k), key=lambda i: (scores[i], -i))
        prev = order[best]
        out.append(prev)
    return out


def test_decode_load_returns_both_proposers_and_dflashs_meta(tiny, tmp_path):
    d = _target_drafter(tiny)
    _, props, meta = _loaded(tiny, tmp_path, d)
    assert list(props) == ["selector", "no_selector"]
    assert isinstance(props["selector"], decode.SelectorProposer) and type(props["no_selector"]) is DFlashProposer
    assert set(meta) == {"block_size", "mask_token_id", "target_layer_ids", "hidden_size", "vocab_size", "export"}
    assert meta["block_size"] == B and meta["mask_token_id"] == MASK_ID and meta["vocab_size"] == 300
    _, props3, meta3 = _loaded(tiny, tmp_path, d, name="d3", block_size=3)
    assert meta3["block_size"] == 3 and props3["selector"].block_size == 3
    with pytest.raises(ConfigError, match="conv_kernel_size"):
        _loaded(tiny, tmp_path, _target_drafter(tiny, conv_kernel_size=3), name="d4", block_size=2)


def test_selector_proposer_is_the_greedy_walk_and_the_brute_force_optimum(tiny, tmp_path):
    d = _target_drafter(tiny, seed=1)
    target, props, _ = _loaded(tiny, tmp_path, d)
    sel, plain = props["selector"], props["no_selector"]
    target.reset()
    _, feats = target.forward(torch.tensor([1, 100, 7, 250, 33, 90, 91, 2, 1, 5, 6, 7]), 0)
    differs = 0
    for start in (1, 3, 6, 9, 12):
        block = torch.tensor([40 + start] + [MASK_ID] * (B - 1))
        got = sel.propose(block, feats[:start], start)
        lat, unary = sel.lattice(block, feats[:start], start)
        assert lat.shape == (1, B - 1, 3, 3)
        assert torch.equal(got, greedy_walk(lat, unary.ids)[0][0])
        assert torch.equal(got, brute_force_walk(lat, unary.ids)[0][0])  # 3^3 paths
        h = sel.hidden(block, feats[:start], start)
        with torch.no_grad():  # the hidden states are the plain proposer's: its argmax is theirs
            assert torch.equal(plain.propose(block, feats[:start], start), target.lm_head(h[1:]).argmax(-1))
            want = _walk_oracle(h[1:], tiny.lm_head.weight, block[0], d.candidate_selector, 3)
        assert got.tolist() == want, start
        differs += int(not torch.equal(got, plain.propose(block, feats[:start], start)))
    assert differs > 0  # the codebooks move the path somewhere


def test_zero_init_selector_proposes_the_no_selector_argmax(tiny, tmp_path):
    d = _target_drafter(tiny, seed=2, selector_init="zero")
    assert torch.count_nonzero(d.candidate_selector.successor_codebook) == 0
    target, props, _ = _loaded(tiny, tmp_path, d)
    target.reset()
    _, feats = target.forward(torch.tensor(list(range(10, 40))), 0)
    for start in range(1, 30, 2):
        block = torch.tensor([start * 7 % 300] + [MASK_ID] * (B - 1))
        assert torch.equal(props["selector"].propose(block, feats[:start], start),
                           props["no_selector"].propose(block, feats[:start], start)), start


def test_a_published_unary_transform_is_applied_in_the_z_lab_order(tiny, tmp_path):
    d = _target_drafter(tiny, seed=5)
    write_export(d, tmp_path / "p", source={})
    (tmp_path / "p" / "export.json").unlink()
    c = json.loads((tmp_path / "p" / "config.json").read_text())
    c["dflash_config"].update(output_multiplier=0.3, final_logit_softcapping=4.0)
    (tmp_path / "p" / "config.json").write_text(json.dumps(c))
    target = Target(tiny, d.target_layer_ids)
    props = dict(decode.load(tmp_path / "p", target)[0])
    sel = props["selector"]
    assert (sel.output_multiplier, sel.softcap) == (0.3, 4.0)
    target.reset()
    _, feats = target.forward(torch.tensor(list(range(50, 70))), 0)
    for start in (2, 7, 15):
        block = torch.tensor([start] + [MASK_ID] * (B - 1))
        h = sel.hidden(block, feats[:start], start)
        with torch.no_grad():
            raw = target.lm_head(h[1:])
            _, unary = sel.lattice(block, feats[:start], start)
            torch.testing.assert_close(unary.values[0], (torch.tanh(raw * 0.3 / 4.0) * 4.0).gather(-1, unary.ids[0]))
            want = _walk_oracle(h[1:], tiny.lm_head.weight, block[0], d.candidate_selector, 3, m=0.3, cap=4.0)
        assert sel.propose(block, feats[:start], start).tolist() == want


PROMPTS = [[1, 40, 41, 42, 2, 1], [1, 100, 7, 250, 33, 90, 91, 2, 1], [17]]


@pytest.mark.parametrize("window", [0, B])
def test_speculative_decoding_with_both_proposers_is_lossless(tiny, tmp_path, window):
    d = _target_drafter(tiny, seed=6, sliding_window=window)
    target, props, meta = _loaded(tiny, tmp_path, d)
    for p in PROMPTS:
        g = greedy_generate(target, p, max_new_tokens=25, stop_ids=set()).tokens
        for name, prop in props.items():
            out = speculative_generate(target, prop, p, max_new_tokens=25, stop_ids=set(),
                                       mask_token_id=meta["mask_token_id"])
            assert out.tokens == g, (name, out.tokens, g)
            assert all(1 <= a <= B for a in out.acceptance_lengths) and sum(out.acceptance_lengths) >= 24
        stop = {g[6]}
        gs = greedy_generate(target, p, max_new_tokens=25, stop_ids=stop).tokens
        assert speculative_generate(target, props["selector"], p, max_new_tokens=25, stop_ids=stop,
                                    mask_token_id=MASK_ID).tokens == gs == g[:g.index(g[6]) + 1]


def test_speculate_entry_point_runs_a_dflash2_export_with_both_proposers(tiny, tmp_path, monkeypatch):
    """train.speculate dispatches on config.json's architectures; with the dflash2 spec naming
    DFlash2DraftModel and this decode (patched in here if the registry does not yet), the report's
    result is the selector's and ``variants`` holds ``no_selector``, both lossless."""
    from dflash_prep.train.objectives import registry
    from dflash_prep.train.objectives.dflash2.export import ARCHITECTURE
    from dflash_prep.train.speculate import main

    spec = registry.get("dflash2")
    if ARCHITECTURE not in spec.architectures or spec.decode is None:
        monkeypatch.setitem(registry._SPECS, "dflash2",
                            dataclasses.replace(spec, architectures=(ARCHITECTURE,), decode=decode.load))
    write_export(_target_drafter(tiny, seed=7), tmp_path / "drafter", source={})
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):"}) + "\n" + json.dumps({"prompt": "the model and"}) + "\n")
    res = main(["--target", str(tiny_target()), "--drafter", str(tmp_path / "drafter"), "--prompts", str(prompts),
                "--out", str(tmp_path / "eval.json"), "--max-new-tokens", "12"])
    assert res["drafter"]["architecture"] == ARCHITECTURE and res["drafter"]["proposer"] == "selector"
    assert res["lossless"] is True and set(res["variants"]) == {"no_selector"}
    assert res["variants"]["no_selector"]["lossless"] is True and res["block_size"] == B
