"""The DFlash speculative-decoding loop on a tiny real Qwen3 target: lossless, acceptance counted right."""

import json

import pytest
import torch

from dflash_prep.train.objectives.dflash.drafter import Drafter, DrafterConfig
from dflash_prep.train.objectives.dflash.export import write_export
from dflash_prep.train.objectives.dflash.decode import DFlashProposer
from dflash_prep.train.speculate import Target, greedy_generate, main, speculative_generate, summarize
from dflash_prep.train.target_init import TargetSpec, build_target, default_texts

B = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_target(tmp_path_factory.mktemp("t") / "target",
                        TargetSpec(vocab_size=300, hidden=64, layers=4, heads=2, kv_heads=1, head_dim=32,
                                   intermediate=96), texts=default_texts(20_000))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():  # a sharper random target: logits far from ties, outputs not all one token
        model.lm_head.weight.mul_(30.0)
    return path, model, AutoTokenizer.from_pretrained(str(path))


def _drafter(model, seed=0):
    torch.manual_seed(seed)
    cfg = DrafterConfig.from_target_config(model.config, num_layers=2, block_size=B, mask_token_id=3)
    return Drafter(cfg)


PROMPTS = [[1, 40, 41, 42, 2, 1], [1, 100, 7, 250, 33, 90, 91, 2, 1], [17]]


class Oracle:
    """Proposes the target's own greedy continuation (every draft accepted)."""

    def __init__(self, greedy, n_prompt, wrong=False, vocab=300):
        self.block_size, self.g, self.n, self.wrong, self.vocab = B, greedy, n_prompt, wrong, vocab

    def propose(self, block, ctx, start, tokens=None):
        i = start - self.n  # block[0] is greedy[i]
        t = torch.tensor(self.g[i + 1:i + B])
        return (t + 1) % self.vocab if self.wrong else t


def test_oracle_and_wrong_proposers_count_acceptance_exactly(tiny):
    _, model, _ = tiny
    target = Target(model, [1, 2])
    for p in PROMPTS:
        g40 = greedy_generate(target, p, max_new_tokens=40, stop_ids=set()).tokens
        ok = speculative_generate(target, Oracle(g40, len(p)), p, max_new_tokens=30, stop_ids=set(), mask_token_id=3)
        g = g40[:30]
        assert ok.tokens == g
        assert ok.acceptance_lengths == [B] * 8  # 8 blocks commit 32 >= 30 tokens
        bad = speculative_generate(target, Oracle(g40, len(p), wrong=True), p, max_new_tokens=30, stop_ids=set(),
                                   mask_token_id=3)
        assert bad.tokens == g and bad.acceptance_lengths == [1] * 30


def test_greedy_reference_is_transformers_generate(tiny):
    _, model, _ = tiny
    target = Target(model, [])
    for p in PROMPTS[:2]:
        g = greedy_generate(target, p, max_new_tokens=20, stop_ids=set()).tokens
        hf = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            max_new_tokens=20, min_new_tokens=20, do_sample=False, eos_token_id=None)
        assert hf[0, len(p):].tolist() == g


def test_dflash_drafter_loop_is_lossless_and_stops_like_greedy(tiny):
    _, model, _ = tiny
    drafter = _drafter(model)
    target = Target(model, drafter.target_layer_ids)
    prop = DFlashProposer(drafter, target, block_size=B, mask_token_id=3)
    for p in PROMPTS:
        g = greedy_generate(target, p, max_new_tokens=25, stop_ids=set()).tokens
        d = speculative_generate(target, prop, p, max_new_tokens=25, stop_ids=set(), mask_token_id=3)
        assert d.tokens == g, (d.tokens, g)
        assert all(1 <= a <= B for a in d.acceptance_lengths) and sum(d.acceptance_lengths) >= 24
        stop = {g[6]}  # a token the greedy output holds: both paths cut after its first occurrence
        gs = greedy_generate(target, p, max_new_tokens=25, stop_ids=stop).tokens
        ds = speculative_generate(target, prop, p, max_new_tokens=25, stop_ids=stop, mask_token_id=3).tokens
        assert ds == gs == g[:g.index(g[6]) + 1]
        for n in (1, 5):
            assert speculative_generate(target, prop, p, max_new_tokens=n, stop_ids=set(),
                                        mask_token_id=3).tokens == g[:n]


def test_summary_is_the_reference_mean_of_means():
    s = summarize([{"acceptance_lengths": [4, 2], "tau": 3.0}, {"acceptance_lengths": [1, 1, 1, 1], "tau": 1.0}], 4)
    assert s["tau"] == 2.0 and s["tau_pooled"] == 10 / 6 and s["histogram"] == [4, 1, 0, 1] and s["blocks"] == 6


def test_eval_entry_point_writes_a_versioned_report(tiny, tmp_path):
    path, model, tok = tiny
    write_export(_drafter(model, seed=1), tmp_path / "drafter", source={})
    prompts = tmp_path / "prompts.jsonl"
    with open(prompts, "w") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "the model and the data"},
                                         {"role": "assistant", "content": "ignored"}]}) + "\n")
        f.write(json.dumps({"prompt": "def f(x):"}) + "\n")
    res = main(["--target", str(path), "--drafter", str(tmp_path / "drafter"), "--prompts", str(prompts),
                "--out", str(tmp_path / "eval.json"), "--max-new-tokens", "12"])
    assert torch.is_grad_enabled(), "main() left grad mode off for the rest of the process"
    on_disk = json.loads((tmp_path / "eval.json").read_text())
    assert on_disk["format"] == "dflash-prep/speculate-eval" and on_disk["version"] == 1
    assert on_disk["lossless"] is True and on_disk["prompts"]["n"] == 2 and on_disk["block_size"] == B
    assert 1.0 <= on_disk["tau"] <= B and on_disk["tau"] == res["tau"]
    first = tok.apply_chat_template([{"role": "user", "content": "the model and the data"}], tokenize=False,
                                    add_generation_prompt=True)
    assert on_disk["per_prompt"][0]["prompt_tokens"] == len(tok(first, add_special_tokens=False)["input_ids"])
    with pytest.raises(SystemExit, match="hidden"):
        other = _drafter(model)
        cfg = DrafterConfig(**{**other.config.to_dict(), "hidden": 32, "heads": 1, "kv_heads": 1})
        write_export(Drafter(cfg), tmp_path / "wrong", source={})
        main(["--target", str(path), "--drafter", str(tmp_path / "wrong"), "--prompts", str(prompts),
              "--out", str(tmp_path / "e2.json")])


def test_proposer_drafts_what_the_public_algorithm_drafts(tiny):
    """One DFlashProposer block == the public per-block computation after a prefill of ``start``."""
    from dflash_prep.tests.train.dflash_oracle import public_block_forward

    _, model, _ = tiny
    drafter = _drafter(model, seed=2)
    target = Target(model, drafter.target_layer_ids)
    prop = DFlashProposer(drafter, target, block_size=B, mask_token_id=3)
    target.reset()
    _, feats = target.forward(torch.tensor(PROMPTS[1] + [5, 6, 7]), 0)
    for start in (1, 4, 12):
        block = torch.tensor([PROMPTS[1][0] if start < len(PROMPTS[1]) else 9] + [3] * (B - 1))
        with torch.no_grad():
            h = public_block_forward(drafter, target.embed(block), feats[:start], start)
            want = target.lm_head(h[1:]).argmax(-1)
        assert torch.equal(prop.propose(block, feats[:start], start), want), start


def test_windowed_proposer_drafts_what_the_public_windowed_algorithm_drafts(tiny):
    """A drafter with sliding window W = B: the proposer cuts the context to the window and still
    equals the public per-block computation (all features, transformers' flash window) for
    blocks before and past the window; the window changes the hidden states."""
    from dflash_prep.tests.train.dflash_oracle import public_block_forward

    from dflash_prep.train.objectives.dflash.drafter import Drafter, DrafterConfig

    _, model, _ = tiny
    full = _drafter(model, seed=2)
    drafter = Drafter(DrafterConfig(**{**full.config.to_dict(), "sliding_window": B})).eval()
    drafter.load_state_dict(full.state_dict())
    target = Target(model, drafter.target_layer_ids)
    prop = DFlashProposer(drafter, target, block_size=B, mask_token_id=3)
    target.reset()
    _, feats = target.forward(torch.tensor(PROMPTS[1] + [5, 6, 7]), 0)
    seen = []
    drafter.register_forward_hook(lambda mod, args, out: seen.append(out))
    moved = 0.0
    for start in (1, B - 1, 12):
        block = torch.tensor([9] + [3] * (B - 1))
        with torch.no_grad():
            h = public_block_forward(drafter, target.embed(block), feats[:start], start, window=B)
            moved = max(moved, (h - public_block_forward(full, target.embed(block), feats[:start], start)).abs().max())
            want = target.lm_head(h[1:]).argmax(-1)
        assert torch.equal(prop.propose(block, feats[:start], start), want), start
        torch.testing.assert_close(seen[-1], h, rtol=1e-5, atol=1e-5)  # the drafter's own hidden states
    assert moved > 1e-4


def test_eval_refuses_a_drafter_trained_on_another_target(tiny, tmp_path):
    path, model, _ = tiny
    write_export(_drafter(model), tmp_path / "d", source={"run_key": {"contract": {"target_fingerprint": "0" * 64}}})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "the model"}) + "\n")
    with pytest.raises(SystemExit, match="trained on target"):
        main(["--target", str(path), "--drafter", str(tmp_path / "d"), "--prompts", str(prompts),
              "--out", str(tmp_path / "e.json")])
