"""Two gloo processes: loss normalisation over the whole step, and a smoke training run."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash_prep.train.distributed import Dist
from dflash_prep.train.loop import train_step
from dflash_prep.train.objectives.lm.model import token_loss_sum

from dflash_prep.tests.train.train_fakes import gloo_worker, grads_setup

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory):
    """One 2-process gloo job that does both the gradient step and the smoke run."""
    out = tmp_path_factory.mktemp("gloo")
    mp.spawn(gloo_worker, args=(2, str(out / "init"), str(out), "both"), nprocs=2, join=True)
    return out


def test_two_ranks_accum_1_equal_one_rank_accum_2(gloo_run):
    """Same global step (2 micro-batches): W=2,A=1 over gloo == W=1,A=2, within fp32 tolerance."""
    got = torch.load(gloo_run / "grads.pt", weights_only=True)
    model, opt, sb = grads_setup(1, 2, 0)
    assert len(sb.micro) == 2
    counts = [b.n_targets for b in sb.micro]
    assert counts[0] != counts[1], "the test needs micro-batches with different target counts"
    one = Dist(0, 1, 0, torch.device("cpu"))
    train_step(model, opt, sb, lr=1e-3, grad_clip=0.0, d=one, autocast=contextlib.nullcontext)
    want = {n: p.grad for n, p in model.named_parameters()}
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")

    # sensitivity: a mean of per-micro-batch means would give a visibly different gradient
    model2, _, _ = grads_setup(1, 2, 0)
    for b in sb.micro:
        (token_loss_sum(model2(b.input_ids, **b.model_inputs()), b.labels) / b.n_targets / 2).backward()
    wrong = dict(model2.named_parameters())["embed.weight"].grad
    assert not torch.allclose(wrong, want["embed.weight"], rtol=1e-3, atol=1e-6)


def test_two_process_gloo_smoke_run(gloo_run):
    tmp_path = gloo_run
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=False)
    for r in (r0, r1):
        assert r["summary"]["global_step"] == 4 and r["summary"]["world_size"] == 2
    # both ranks saw the whole step's tokens (all-reduced), so their totals agree
    assert r0["summary"]["real_tokens"] == r1["summary"]["real_tokens"] > 0
    assert r0["summary"]["loss_first"] == pytest.approx(r1["summary"]["loss_first"])
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert len(state["rng"]) == 2 and state["run_key"]["world_size"] == 2
    assert torch.isfinite(torch.tensor(r0["model_sum"]))
