"""The EAGLE-3 drafter on a tiny random Qwen3 target: TTT equals its unrolled definition, no step sees
what it must not, the export round-trips bit for bit and refuses what the engines would misread,
chain drafting is lossless, and the loss matches a hand computation."""

import json
import math

import pytest
import torch

from dflash_prep.errors import ConfigError, FingerprintMismatch, FormatError
from dflash_prep.train.objectives.eagle3.decode import Eagle3Proposer
from dflash_prep.train.objectives.eagle3.export import load_export, write_export
from dflash_prep.train.objectives.eagle3.model import (PAD_ID, Eagle3Config, Eagle3Drafter, dense_attention,
                                                       eagle3_loss, ttt_valid)
from dflash_prep.train.speculate import Target, greedy_generate, speculative_generate

TAPS = (1, 2, 4)  # outputs of layers 1, 2, 4 of a 6-layer target
VD = 120  # draft vocabulary
LENS = (7, 5, 9)  # packed documents
NAMES = {"embed_tokens.weight", "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
         "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
         "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
         "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
         "norm.weight", "lm_head.weight", "d2t", "t2d"}


@pytest.fixture(scope="module")
def target():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=300, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, intermediate_size=96, max_position_embeddings=256, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # a sharper random target: logits far from ties
        model.lm_head.weight.mul_(30.0)
    return model


def _d2t(seed=0):
    ids = torch.randperm(300, generator=torch.Generator().manual_seed(seed))[:VD].sort().values
    return ids - torch.arange(VD)


def _drafter(target, seed=0):
    """A drafter whose every float parameter (norm gains too) is random, so a dropped tensor shows."""
    cfg = Eagle3Config.from_target_config(target.config, VD, TAPS)
    d = Eagle3Drafter.from_target(cfg, target, _d2t(seed))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return d


def _packed(seed=1, distinct=False):
    g = torch.Generator().manual_seed(seed)
    T = sum(LENS)
    x = torch.randperm(299, generator=g)[:T] + 1 if distinct else torch.randint(1, 300, (T,), generator=g)
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in LENS])
    return torch.randn(T, 3 * 64, generator=g), x, pos, cu


def unrolled_reference(drafter, taps, input_ids, positions, cu_seqlens, steps):
    """TTT the slow way: every step builds each row's key set by hand (its document's step-0 keys
    start..t, then its own keys of steps 1..i) and its token with a Python loop; ``[S, T, H]``."""
    m = drafter.midlayer
    cu = [int(c) for c in cu_seqlens]
    T = input_ids.shape[0]
    start = [a for a, b in zip(cu[:-1], cu[1:]) for _ in range(a, b)]
    end = [b for a, b in zip(cu[:-1], cu[1:]) for _ in range(a, b)]
    h, K, V, outs = drafter.fc(taps), [], [], []
    for i in range(steps):
        ids = torch.tensor([int(input_ids[t + 1 + i]) if t + 1 + i < end[t] else PAD_ID for t in range(T)])
        q, k, v = m.qkv(drafter.embed_tokens(ids), h, *drafter.rope(positions + i, h.dtype))
        K.append(k)
        V.append(v)
        rows = []
        for t in range(T):
            keys = torch.cat([K[0][start[t]:t + 1]] + [K[j][t:t + 1] for j in range(1, i + 1)])
            vals = torch.cat([V[0][start[t]:t + 1]] + [V[j][t:t + 1] for j in range(1, i + 1)])
            rows.append(dense_attention(q[t:t + 1], keys, vals, 1.0 / math.sqrt(drafter.config.head_dim))[0])
        h = m.finish(h, torch.stack(rows))
        outs.append(h)
    return torch.stack(outs)


def _close(a, b, atol=1e-5, rtol=1e-5):
    diff = (a - b).abs()
    assert torch.allclose(a, b, atol=atol, rtol=rtol), f"max diff {diff.max():.3g}, mean {diff.mean():.3g}"


def test_ttt_with_7_steps_equals_7_unrolled_forwards(target):
    """In float64, so a mask or position slip is not hidden by rounding (fp32 agrees to ~1e-6 relative)."""
    d = _drafter(target).double()
    taps, x, pos, cu = _packed()
    taps = taps.double()
    with torch.no_grad():
        fast = d.ttt_hidden(taps, x, pos, cu, max(LENS), 7)
        _close(fast, unrolled_reference(d, taps, x, pos, cu, 7), atol=1e-10, rtol=1e-10)
        logits = d(taps, x, pos, cu, max(LENS), 7)
    assert logits.shape == (7, sum(LENS), VD) and torch.equal(logits, d.lm_head(d.norm(fast)))
    valid = ttt_valid(cu, sum(LENS), 7)
    assert valid[0, :7].tolist() == [True] * 6 + [False] and valid[5, :7].tolist() == [True, False] + [False] * 5


def test_a_step_has_no_gradient_from_what_it_must_not_see(target):
    """Step i at a valid row t (t+1+i inside its document) reads the taps of rows start..t and the
    tokens x[start+1 .. t+1+i] of its own document: exactly those get a gradient, nothing else (not
    x[start], not the token it predicts, no other document, not the pad row)."""
    d = _drafter(target)
    taps, x, pos, cu = _packed(distinct=True)
    d.embed_tokens.weight.requires_grad_(True)
    starts = [0, 0, 7, 12, 12]
    try:
        for (i, t), s in zip([(0, 3), (5, 0), (2, 8), (0, 12), (4, 15)], starts):
            taps_ = taps.clone().requires_grad_(True)
            d.embed_tokens.weight.grad = None
            d.ttt_hidden(taps_, x, pos, cu, max(LENS), i + 1)[i, t].square().sum().backward()
            tap_rows = set(taps_.grad.abs().sum(-1).nonzero().flatten().tolist())
            assert tap_rows == set(range(s, t + 1)), (i, t, sorted(tap_rows))
            seen = {int(x[r]) for r in range(s + 1, t + 2 + i)}
            got = set(d.embed_tokens.weight.grad.abs().sum(-1).nonzero().flatten().tolist())
            assert got == seen, (i, t, sorted(got ^ seen))
    finally:
        d.embed_tokens.weight.requires_grad_(False)


def test_from_target_copies_the_embedding_and_the_head_rows(target):
    cfg = Eagle3Config.from_target_config(target.config, VD, TAPS)
    d = Eagle3Drafter.from_target(cfg, target, _d2t())
    ids = torch.arange(VD) + _d2t()
    assert torch.equal(d.embed_tokens.weight, target.model.embed_tokens.weight)
    assert torch.equal(d.lm_head.weight, target.lm_head.weight[ids])
    assert d.t2d.nonzero().flatten().tolist() == ids.tolist()
    assert not d.embed_tokens.weight.requires_grad and cfg.num_target_layers == 6


@pytest.mark.parametrize("kind", ["linear", "llama3"])
def test_rope_scaling_matches_transformers(kind):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    scaling = {"rope_type": kind, "factor": 4.0}
    if kind == "llama3":
        scaling.update(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=8, intermediate_size=96, vocab_size=50,
                     max_position_embeddings=512, rope_theta=5e5, rope_scaling=scaling)
    d = Eagle3Drafter(Eagle3Config.from_target_config(hf, 20))
    pos = torch.arange(0, 500, 7)
    cos, sin = LlamaRotaryEmbedding(hf)(torch.zeros(1), pos[None])
    mine = d.rope(pos, torch.float32)
    _close(mine[0], cos[0, :, :8], atol=1e-5)
    _close(mine[1], sin[0, :, :8], atol=1e-5)


def test_export_round_trip_bit_for_bit(target, tmp_path):
    from safetensors import safe_open

    d = _drafter(target)
    side = write_export(d, tmp_path / "x", source={"target_fingerprint": "abc"})
    c = json.loads((tmp_path / "x" / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["model_type"] == "llama"
    assert c["num_hidden_layers"] == 1 and c["vocab_size"] == 300 and c["draft_vocab_size"] == VD
    assert c["eagle_aux_hidden_state_layer_ids"] == [2, 3, 5]  # vLLM: the input of layer j
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]  # SGLang: the output of layer j
    with safe_open(str(tmp_path / "x" / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == NAMES
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
    back, meta = load_export(tmp_path / "x")
    assert back.config == d.config and meta["vllm_layer_ids"] == [2, 3, 5] and meta["export"] == {
        "format": "dflash-prep/eagle3-export", "version": 1, **side}
    want, got = d.state_dict(), back.state_dict()
    assert set(got) == NAMES and all(torch.equal(want[k], got[k]) and want[k].dtype == got[k].dtype for k in NAMES)
    assert not back.embed_tokens.weight.requires_grad
    write_export(d, tmp_path / "b", source={}, dtype="bfloat16")
    back16, _ = load_export(tmp_path / "b", dtype=torch.bfloat16)
    want16 = d.to(torch.bfloat16).state_dict()
    assert all(torch.equal(want16[k], v) for k, v in back16.state_dict().items())


def _rewrite(folder, config=None, state=None):
    """Edit an export as another tool would (its sidecar removed, so the fingerprints do not stop it)."""
    from safetensors.torch import load_file, save_file

    (folder / "export.json").unlink(missing_ok=True)
    if config is not None:
        c = json.loads((folder / "config.json").read_text())
        config(c)
        (folder / "config.json").write_text(json.dumps(c))
    if state is not None:
        s = load_file(str(folder / "model.safetensors"))
        state(s)
        save_file(s, str(folder / "model.safetensors"))


def test_tapped_ids_that_collide_are_refused(target, tmp_path):
    cfg = Eagle3Config.from_target_config(target.config, VD, TAPS).to_dict()
    with pytest.raises(ConfigError, match="distinct"):
        Eagle3Config(**{**cfg, "target_layer_ids": (2, 2, 4)})
    with pytest.raises(ConfigError, match="up to 4"):  # the last layer's output is no engine tap
        Eagle3Config(**{**cfg, "target_layer_ids": (1, 2, 5)})
    with pytest.raises(ConfigError, match="pass"):  # the default taps of a 6-layer target collide
        Eagle3Config.from_target_config(target.config, VD)
    write_export(_drafter(target), tmp_path / "x", source={})

    def collide(c):
        c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 1, 4]
        c["eagle_aux_hidden_state_layer_ids"] = [2, 2, 5]
    _rewrite(tmp_path / "x", config=collide)
    with pytest.raises(FormatError, match="distinct"):
        load_export(tmp_path / "x")


def test_load_export_refuses_what_the_engines_would_misread(target, tmp_path):
    d = _drafter(target)
    cases = {
        "disagree": dict(config=lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 4])),
        "missing \\['norm.weight'\\]": dict(state=lambda s: s.pop("norm.weight")),
        "unexpected \\['extra'\\]": dict(state=lambda s: s.update(extra=torch.zeros(2))),
        "fc.weight: \\[192, 64\\] vs \\[64, 192\\]": dict(state=lambda s: s.update({"fc.weight": torch.zeros(192, 64)})),
        "d2t: torch.int32": dict(state=lambda s: s.update(d2t=s["d2t"].to(torch.int32))),
        "d2t/t2d disagree": dict(state=lambda s: s.update(d2t=s["d2t"].flip(0))),
        "architectures": dict(config=lambda c: c.update(architectures=["LlamaForCausalLM"])),
    }
    for i, (msg, edit) in enumerate(cases.items()):
        write_export(d, tmp_path / str(i), source={})
        _rewrite(tmp_path / str(i), **edit)
        with pytest.raises(FormatError, match=msg):
            load_export(tmp_path / str(i))
    write_export(d, tmp_path / "fp", source={})
    (tmp_path / "fp" / "config.json").write_text((tmp_path / "fp" / "config.json").read_text().replace("64", "65", 1))
    with pytest.raises(FingerprintMismatch):
        load_export(tmp_path / "fp")


class Oracle:
    """Proposes the target's own greedy continuation: every draft is accepted."""

    def __init__(self, model, k):
        self.model, self.draft_tokens, self.block_size = model, k, k + 1

    @torch.no_grad()
    def propose(self, block, ctx_feats, start, tokens=None):
        ids = tokens.tolist() + [int(block[0])]
        for _ in range(self.draft_tokens):
            ids.append(int(self.model(torch.tensor([ids])).logits[0, -1].argmax()))
        return torch.tensor(ids[start + 1:])


def eagle3_generate(target, proposer, prompt, **kw):
    """Speculate's loop with a drafter that has no mask token."""
    return speculative_generate(target, proposer, prompt, mask_token_id=0, **kw)


PROMPTS = [[5, 17, 240], [9, 100, 7, 250, 33, 90, 91, 2, 8], [44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56]]


def test_chain_drafting_is_lossless_and_counts_acceptance(target):
    tgt = Target(target, TAPS)
    for proposer, k in ((Eagle3Proposer(_drafter(target), draft_tokens=4), 4), (Oracle(target, 3), 3)):
        for p in PROMPTS:
            g = greedy_generate(tgt, p, max_new_tokens=20, stop_ids=set())
            s = eagle3_generate(tgt, proposer, p, max_new_tokens=20, stop_ids=set())
            assert s.tokens == g.tokens, (type(proposer).__name__, p)
            assert all(1 <= a <= k + 1 for a in s.acceptance_lengths)
            if isinstance(proposer, Oracle):
                assert s.acceptance_lengths == [k + 1] * len(s.acceptance_lengths)
    stop = {g.tokens[5]}  # a stop token the target produces: cut after its first occurrence
    s = eagle3_generate(tgt, Oracle(target, 3), PROMPTS[2], max_new_tokens=20, stop_ids=stop)
    assert s.tokens == greedy_generate(tgt, PROMPTS[2], max_new_tokens=20, stop_ids=stop).tokens


def test_chain_drafting_is_the_ttt_forward_fed_its_own_drafts(target):
    d, K = _drafter(target, seed=3), 5
    tgt = Target(target, TAPS)
    tgt.reset()
    prompt = PROMPTS[1]
    logits, feats = tgt.forward(torch.tensor(prompt), 0)
    bonus, m = int(logits[-1].argmax()), len(prompt)
    drafts = Eagle3Proposer(d, draft_tokens=K).chain(torch.tensor(prompt + [bonus]), feats)
    x = torch.tensor(prompt + [bonus] + drafts[:-1].tolist())  # row m-1 reads x[m + i] at step i
    taps = torch.cat([feats, torch.randn(K, feats.shape[1])])  # rows >= m are after row m-1: unseen
    with torch.no_grad():
        steps = d(taps, x, torch.arange(m + K), torch.tensor([0, m + K], dtype=torch.int32), m + K, K)
    assert d.to_target_ids(steps[:, m - 1].argmax(-1)).tolist() == drafts.tolist()


def test_loss_by_hand():
    """Target vocab 4, draft vocab {1, 3}; documents of 4 and 2 rows; 2 steps. Step i, row t: teacher
    row t+1+i, weight 0.8**i * loss_mask[t+2+i] * [target argmax in {1, 3}]."""
    d2t, t2d = torch.tensor([1, 2]), torch.tensor([False, True, False, True])
    cu = torch.tensor([0, 4, 6], dtype=torch.int32)
    target = torch.tensor([[0., 0, 0, 0], [4, 2, 0, 1], [0, 1, 0, 3], [9, 9, 9, 9], [0, 0, 0, 9], [0, 9, 0, 0]])
    lm = torch.tensor([1, 1, 0, 1, 1, 1])
    draft = torch.zeros(2, 6, 2)
    draft[0, 1] = torch.tensor([0.0, math.log(3)])  # q = (1/4, 3/4)
    draft[1, 0] = torch.tensor([math.log(2), 0.0])  # q = (2/3, 1/3)
    out = eagle3_loss(draft, target, lm, cu, d2t, t2d, decay=0.8)
    p0 = 1 / (1 + math.e ** 2)  # softmax of target row 2 over ids (1, 3): logits (1, 3)
    ce_a = -(p0 * math.log(1 / 4) + (1 - p0) * math.log(3 / 4))  # step 0, row 1 (row 0: loss_mask[2] = 0)
    ce_b = -(p0 * math.log(2 / 3) + (1 - p0) * math.log(1 / 3))  # step 1, row 0
    assert out.loss_sum.item() == pytest.approx(ce_a + 0.8 * ce_b, rel=1e-6)
    assert out.weight_sum.item() == pytest.approx(1.8)
    assert out.correct.tolist() == [1, 0] and out.counted.tolist() == [1, 1]
    lm_all = torch.ones(6)  # now step 0 row 0 counts: its target argmax 0 is outside the draft vocab
    out = eagle3_loss(draft, target, lm_all, cu, d2t, t2d, decay=0.8)
    assert out.weight_sum.item() == pytest.approx(1.8) and out.counted.tolist() == [2, 1]
    assert out.correct.tolist() == [1, 0]


def test_evaluate_an_exported_drafter_on_a_prompts_file(tmp_path):
    """What train/speculate.py's command would run for EAGLE-3: a real target folder (tokenizer and
    all), an export, a prompts file; the result has speculate's layout and is lossless."""
    from transformers import AutoModelForCausalLM

    from dflash_prep.train.objectives.eagle3.decode import load
    from dflash_prep.train.speculate import EvalConfig, evaluate
    from dflash_prep.formats.target import target_identity

    from dflash_prep.tests.train.dflash_fixtures import tiny_target

    path = tiny_target()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    cfg = Eagle3Config.from_target_config(model.config, 64, (0, 1, 2))
    trained_on = {"run_key": {"contract": {"target_fingerprint": target_identity(path)["target_fingerprint"]}}}
    write_export(Eagle3Drafter.from_target(cfg, model, torch.zeros(64, dtype=torch.long)), tmp_path / "d",
                 source=trained_on)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello there"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    res = evaluate(path, tmp_path / "d", prompts, EvalConfig(max_new_tokens=6, block_size=4))
    assert res["drafter"]["architecture"] == "LlamaForCausalLMEagle3" and res["drafter"]["proposer"] == "eagle3"
    assert res["format"] == "dflash-prep/speculate-eval" and res["lossless"] is True
    assert res["prompts"]["n"] == 2 and res["block_size"] == 4 and len(res["histogram"]) == 4
    write_export(Eagle3Drafter.from_target(cfg, model, torch.zeros(64, dtype=torch.long)), tmp_path / "e",
                 source={"run_key": {"contract": {"target_fingerprint": "another"}}})
    with pytest.raises(ConfigError, match="trained on target"):
        evaluate(path, tmp_path / "e", prompts)
    tgt = Target(model)
    [(name, proposer)], meta = load(tmp_path / "d", tgt, block_size=4)  # the objective's decode hook
    assert name == "eagle3" and proposer.draft_tokens == 3 and meta["block_size"] == 4 and tgt.layer_ids == [0, 1, 2]
    p = [5, 6, 7]
    assert eagle3_generate(tgt, proposer, p, max_new_tokens=5, stop_ids=set()).tokens == greedy_generate(
        tgt, p, max_new_tokens=5, stop_ids=set()).tokens
