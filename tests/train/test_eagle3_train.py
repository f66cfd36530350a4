"""The EAGLE-3 trainer on the fakes and a tiny real target: the step normaliser over ranks and
accumulation (its weights come out of the forward), bitwise resume, per-pass metrics, the run
contract, and the refusals (a manifest without a map, a contradicting flag, colliding taps)."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash_prep.errors import ConfigError
from dflash_prep.train import checkpoint as ckpt
from dflash_prep.train.distributed import Dist
from dflash_prep.train.loop import train, train_step
from dflash_prep.train.objectives import build_objective

from dflash_prep.tests.train.eagle3_fixtures import EAGLE3, eagle3_cfg, eagle3_grads_setup, eagle3_source, gloo_eagle3_worker
from dflash_prep.tests.train.eagle3_fixtures import tiny_target
from dflash_prep.tests.train.train_fakes import FakeSource


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_two_ranks_equal_one_rank_two_accum(tmp_path):
    """2 gloo ranks x A=1 == 1 rank x A=2 over the same micro-batches: the step's sum w is
    all-reduced after the forward and divides the summed gradient."""
    target = str(tiny_target())
    mp.spawn(gloo_eagle3_worker, args=(2, str(tmp_path / "init"), str(tmp_path), target, {}), nprocs=2, join=True)
    got = torch.load(tmp_path / "eagle3_grads.pt", weights_only=False)
    obj, opt, sb = eagle3_grads_setup(target, 1, 2, 0)
    assert obj.deferred_denominator and len(sb.micro) == 2
    assert sb.micro[0].real_tokens != sb.micro[1].real_tokens, "the test needs uneven micro-batches"
    st = train_step(obj.model, opt, sb, lr=1e-3, grad_clip=0.0, d=Dist(0, 1, 0, torch.device("cpu")),
                    autocast=contextlib.nullcontext, objective=obj)
    assert obj.model.embed_tokens.weight.grad is None          # the target's embedding stays frozen
    for n, p in obj.model.named_parameters():
        if p.grad is not None:
            assert p.grad.abs().sum() > 0, n
            torch.testing.assert_close(got["grads"][n], p.grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{n}: {m}")
            torch.testing.assert_close(got["params"][n], p.detach(), rtol=1e-5, atol=1e-4, msg=lambda m: f"{n}: {m}")
    assert got["step"]["loss"] == pytest.approx(st["loss"], rel=1e-6)
    assert got["step"]["targets"] == pytest.approx(st["targets"], rel=1e-9)


def test_resume_is_bitwise_and_per_pass_metrics_are_logged(tmp_path, capsys):
    target = tiny_target()
    n, k = 4, 2
    a = train(eagle3_cfg(tmp_path / "a", target, max_steps=n), source=eagle3_source(grad_accum=2))
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("eagle3 recipe:"))
    assert "3 TTT steps, decay 0.8, draft vocabulary 48 of 300" in line and "taps [0, 1, 2]" in line, line
    train(eagle3_cfg(tmp_path / "b", target, max_steps=k), source=eagle3_source(grad_accum=2))
    b = train(eagle3_cfg(tmp_path / "b", target, max_steps=n), source=eagle3_source(grad_accum=2))
    assert a["global_step"] == b["global_step"] == n
    pa, pb = (ckpt.load(tmp_path / x / ckpt.CKPT_FILE)["model"] for x in "ab")
    assert {"d2t", "t2d", "fc.weight", "midlayer.self_attn.q_proj.weight", "lm_head.weight"} <= set(pa)
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
    recs = [json.loads(x) for x in (tmp_path / "a" / "log.jsonl").read_text().splitlines()[1:]]
    assert len(recs) == n
    for r in recs:
        assert len(r["step_acc"]) == EAGLE3[1] and 1.0 <= r["tau"] <= 1 + EAGLE3[1] and r["loss"] > 0
    contract = ckpt.load(tmp_path / "a" / ckpt.CKPT_FILE)["run_key"]["contract"]
    assert (contract["objective"], contract["ttt_steps"], contract["draft_vocab_size"]) == ("eagle3", 3, 48)
    assert contract["target_layer_ids"] == [0, 1, 2] and contract["map_fingerprint"]


def test_the_drafter_starts_from_the_targets_embedding_and_head_rows():
    target = tiny_target()
    src = eagle3_source()
    obj = build_objective(eagle3_cfg("unused", target), src.dataset, torch.device("cpu"), manifest=src.manifest(0))
    d = obj.model
    ids = d.draft_target_ids()
    assert torch.equal(ids, torch.from_numpy(src.manifest(0).arrays["d2t"]) + torch.arange(EAGLE3[0]))
    assert torch.equal(d.lm_head.weight, obj.target.lm_head.weight.detach().float()[ids])
    assert torch.equal(d.embed_tokens.weight, obj.target.embed_tokens.weight.detach().float())


@pytest.mark.parametrize("kw,match", [
    (dict(ttt_steps=5), "--ttt-steps 5 contradicts the manifest"),
    (dict(draft_vocab_size=32), "--draft-vocab-size 32 contradicts"),
    (dict(target_layer_ids=(1, 1, 2)), "two taps coincide"),
    (dict(target_layer_ids=()), "three distinct layers"),          # a 4-layer target's default taps coincide
    (dict(ttt_decay=0.0), "--ttt-decay"),
    (dict(block_size=8), "--block-size is an option of --objective dflash, dflash2"),
])
def test_bad_eagle3_runs_are_refused(kw, match):
    src = eagle3_source()
    with pytest.raises(ConfigError, match=match):
        build_objective(eagle3_cfg("unused", tiny_target(), **kw), src.dataset, torch.device("cpu"),
                        manifest=src.manifest(0))


def test_a_manifest_without_a_vocabulary_map_is_refused():
    src = FakeSource(n=48, layout="varlen")
    with pytest.raises(ConfigError, match="not packed with --objective eagle3"):
        build_objective(eagle3_cfg("unused", tiny_target()), src.dataset, torch.device("cpu"),
                        manifest=src.manifest(0))
