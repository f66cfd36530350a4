"""Export in the public DFlash format and load back: same logits, public names and config, checks."""

import json

import pytest
import torch

from dflash_prep.errors import FingerprintMismatch, FormatError
from dflash_prep.train import checkpoint as ckpt
from dflash_prep.train.objectives.dflash.drafter import Drafter, DrafterConfig, build_target_layer_ids
from dflash_prep.train.objectives.dflash.export import export, load_export, public_config, write_export


def _cfg(**kw):
    base = dict(hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=48, num_layers=2, rms_norm_eps=1e-6,
                rope_theta=10000.0, max_position=256, block_size=4, num_target_layers=6,
                target_layer_ids=build_target_layer_ids(6, 2), mask_token_id=3, vocab_size=40)
    base.update(kw)
    return DrafterConfig(**base)


def _trained_like(cfg, seed=0):
    """A drafter whose every parameter (norm gains too) is random, so a dropped tensor shows."""
    torch.manual_seed(seed)
    d = Drafter(cfg)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return d


def _inputs(cfg, seed=1):
    """Two documents (context 7 and 5 rows), anchors 2, 5 | 0, 3."""
    g = torch.Generator().manual_seed(seed)
    B, S = cfg.block_size, [7, 5]
    anchors = torch.tensor([2, 5, 0, 3], dtype=torch.int32)
    feats = torch.randn(sum(S), cfg.num_taps * cfg.hidden, generator=g)
    noise = torch.randn(len(anchors) * B, cfg.hidden, generator=g)
    ctx_pos = torch.cat([torch.arange(s) for s in S])
    blk_pos = torch.cat([torch.arange(int(a), int(a) + B) for a in anchors])
    cu_ctx = torch.tensor([0, 7, 12], dtype=torch.int32)
    cu_blk = torch.tensor([0, 2 * B, 4 * B], dtype=torch.int32)
    return noise, feats, ctx_pos, blk_pos, cu_ctx, cu_blk, anchors, B


def test_export_then_load_gives_the_same_logits(tmp_path):
    cfg = _cfg()
    d = _trained_like(cfg)
    head = torch.nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)  # stands for the target's lm_head
    side = write_export(d, tmp_path / "x", source={"test": True})
    back, meta = load_export(tmp_path / "x")
    x = _inputs(cfg)
    with torch.no_grad():
        want, got = head(d(*x)), head(back(*x))
    assert torch.equal(want, got), (want - got).abs().max()
    assert meta["block_size"] == 4 and meta["mask_token_id"] == 3 and meta["target_layer_ids"] == [1, 3]
    assert back.config == cfg and meta["export"]["weights_fingerprint"] == side["weights_fingerprint"]


def test_windowed_export_loads_with_the_public_window_and_matches_the_public_forward(tmp_path):
    """A drafter trained with a sliding window W = 4 < context (B = 4): config.json says so in the
    public fields, Qwen3Config (what DFlashDraftModel's config_class reads) gives every layer
    that window by the public layer's own rule, load_export restores it, and each block's hidden
    states equal the public algorithm's (transformers' flash window) run from the exported weights."""
    from transformers import Qwen3Config

    from dflash_prep.tests.train.dflash_oracle import public_block_forward

    cfg = _cfg(sliding_window=4)
    d = _trained_like(cfg, seed=5)
    write_export(d, tmp_path / "x", source={})
    c = json.loads((tmp_path / "x" / "config.json").read_text())
    assert c["layer_types"] == ["sliding_attention"] * 2 and c["use_sliding_window"] is True
    assert c["sliding_window"] == 4 and c["max_window_layers"] == 0
    hc = Qwen3Config(**{k: v for k, v in c.items() if k not in ("architectures", "auto_map", "model_type")})
    layer_windows = [hc.sliding_window if hc.layer_types[i] == "sliding_attention" else None for i in range(2)]
    assert layer_windows == [4, 4]  # the line DFlashDraftModel's attention layer runs
    back, _ = load_export(tmp_path / "x")
    assert back.config.sliding_window == 4 and back.config == cfg
    noise, feats, ctx_pos, blk_pos, cu_ctx, cu_blk, anchors, B = _inputs(cfg)
    with torch.no_grad():
        got = back(noise, feats, ctx_pos, blk_pos, cu_ctx, cu_blk, anchors, B)
        full = Drafter(_cfg())
        full.load_state_dict(back.state_dict())
        unwindowed = full(noise, feats, ctx_pos, blk_pos, cu_ctx, cu_blk, anchors, B)
        starts = [0, 0, 7, 7]
        worst = 0.0
        for j, a in enumerate(anchors.tolist()):
            want = public_block_forward(back, noise[j * B:(j + 1) * B], feats[starts[j]:starts[j] + a], a,
                                        window=layer_windows[0])
            worst = max(worst, (got[j * B:(j + 1) * B] - want).abs().max().item())
    assert worst < 1e-5, worst
    assert (got - unwindowed).abs().max() > 1e-3  # the window cut something (anchor 5: 9 keys > W)


def test_files_are_the_public_format(tmp_path):
    from safetensors import safe_open

    cfg = _cfg(num_layers=3, target_layer_ids=(1, 2, 3), num_target_layers=8)
    write_export(_trained_like(cfg), tmp_path / "x", source={})
    c = json.loads((tmp_path / "x" / "config.json").read_text())
    assert c["architectures"] == ["DFlashDraftModel"] and c["model_type"] == "qwen3"
    assert c["block_size"] == 4 and c["num_target_layers"] == 8 and c["num_hidden_layers"] == 3
    assert c["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [1, 2, 3]}
    assert c["layer_types"] == ["full_attention"] * 3 and c["use_sliding_window"] is False
    assert c["rope_theta"] == c["rope_parameters"]["rope_theta"] == 10000.0
    with safe_open(tmp_path / "x" / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert tuple(f.get_tensor("fc.weight").shape) == (32, 3 * 32)
    want = {"norm.weight", "fc.weight", "hidden_norm.weight"}
    for i in range(3):
        want |= {f"layers.{i}.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm",
                                                               "k_norm")}
        want |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        want |= {f"layers.{i}.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm")}
    assert keys == want
    assert json.loads((tmp_path / "x" / "export.json").read_text())["format"] == "dflash-prep/drafter-export"


def test_export_from_a_run_checkpoint_and_bf16(tmp_path):
    cfg = _cfg()
    d = _trained_like(cfg, seed=3)
    opt = torch.optim.AdamW(d.parameters())
    run = tmp_path / "run"
    run.mkdir()
    ckpt.save(run / ckpt.CKPT_FILE, model=d, optimizer=opt, schedule={}, rng=[ckpt.rng_state()],
              cursor={"epoch": 0, "step": 5, "global_step": 5}, run_key={"target": "abc"}, model_config=cfg.to_dict())
    side = export(run, tmp_path / "x")
    assert side["source"]["global_step"] == 5 and side["source"]["run_key"] == {"target": "abc"}
    back, _ = load_export(tmp_path / "x")
    for k, v in d.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    export(run, tmp_path / "b", dtype="bfloat16")
    assert json.loads((tmp_path / "b" / "config.json").read_text())["dtype"] == "bfloat16"
    half, _ = load_export(tmp_path / "b")
    x = _inputs(cfg)
    with torch.no_grad():
        torch.testing.assert_close(half(*x), d(*x), atol=0.1, rtol=0.05)
    with pytest.raises(FormatError, match="exists"):
        export(run, tmp_path / "x")  # no silent overwrite
    export(run, tmp_path / "x", overwrite=True)


def test_bad_inputs_are_refused(tmp_path):
    cfg = _cfg()
    write_export(_trained_like(cfg), tmp_path / "x", source={})
    cfile = tmp_path / "x" / "config.json"
    good = cfile.read_text()
    cfile.write_text(good.replace('"block_size": 4', '"block_size": 5'))
    with pytest.raises(FingerprintMismatch, match="changed"):
        load_export(tmp_path / "x")
    (tmp_path / "x" / "export.json").unlink()  # a public folder without our sidecar still loads
    cfile.write_text(good)
    load_export(tmp_path / "x")
    c = json.loads(good)
    cfile.write_text(json.dumps({**c, "num_hidden_layers": 3, "layer_types": ["full_attention"] * 3}))
    with pytest.raises(FormatError, match="missing"):
        load_export(tmp_path / "x")  # strict keys: layer 2 has no weights
    cfile.write_text(json.dumps({**c, "layer_types": ["sliding_attention", "full_attention"],
                                 "use_sliding_window": True, "sliding_window": 8}))
    with pytest.raises(FormatError, match="mix full and sliding"):
        load_export(tmp_path / "x")
    # sliding layer types without use_sliding_window: Qwen3Config drops the window, the public
    # layers attend in full, and so does the loaded drafter
    cfile.write_text(json.dumps({**c, "layer_types": ["sliding_attention"] * 2, "sliding_window": 8}))
    assert load_export(tmp_path / "x")[0].config.sliding_window == 0
    run = tmp_path / "lm"
    run.mkdir()
    m = torch.nn.Linear(2, 2)
    ckpt.save(run / ckpt.CKPT_FILE, model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), schedule={},
              rng=[], cursor={"global_step": 0}, run_key={}, model_config={"n_layers": 2, "d_model": 128})
    with pytest.raises(FormatError, match="not a drafter"):
        export(run, tmp_path / "y")
    assert public_config(cfg)["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
