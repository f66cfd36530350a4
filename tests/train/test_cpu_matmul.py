"""A CPU run's measured matmul rate and the bf16 head (train/matmul_peak.py, chunked_ce.head_dtype):
the rate is measured cheaply on the head's shape, every step logs its FLOP/s and share of it, and
the bf16 head's loss and gradient stay within the bound bf16's rounding allows."""

from __future__ import annotations

import json
import time

import pytest
import torch

from dflash_prep.train import distributed, matmul_peak
from dflash_prep.train.chunked_ce import _compute_dtype, head_dtype, weighted_ce
from dflash_prep.train.chunked_kl import row_losses
from dflash_prep.train.loop import train

from dflash_prep.tests.train.dflash_fixtures import dflash_cfg, tiny_target
from dflash_prep.tests.train.train_fakes import FakeSource

# bf16 keeps 8 significant bits: each input of a logit z = h . w is rounded by at most 2^-9
# relative, and z itself by 2^-9 more when the matmul writes bf16. With |z| of a few units the
# logits move by ~1e-2 at worst, so a CE (1-Lipschitz in each logit's max-norm, twice) of ~ln V
# moves by <~2e-2 absolute, ~3e-3 relative at V = 4096; seen: 2.6e-5 (CE), 1.7e-5 (KL). The bound:
REL_LOSS = 3e-3
# the input gradient (softmax - onehot) @ W in bf16: each entry ~2^-8 relative, summed over V rows
# with random signs; its norm moves by ~2^-8; seen: 2.8e-3 (CE), 3.5e-3 (KL).
REL_GRAD = 2e-2


def test_measure_is_cheap_and_positive():
    t0 = time.perf_counter()
    r = matmul_peak.measure(2048, 576, 49152, torch.float32, seconds=0.5)
    took = time.perf_counter() - t0
    assert r.flops_per_s > 0 and matmul_peak.MIN_ROWS <= r.rows <= 2048 and (r.hidden, r.vocab) == (576, 49152)
    assert r.threads == torch.get_num_threads() and r.dtype == "float32"
    # the budget, or one MIN_ROWS run past it on a slow machine (its time is what the rate says), + allocation
    one = matmul_peak.MIN_ROWS * 2 * 576 * 49152 / r.flops_per_s
    assert took < 0.5 + 2 * one + 1.0, f"the measurement took {took:.2f} s (budget 0.5 s, one run {one:.2f} s)"
    small = matmul_peak.measure(16, 64, 300, torch.bfloat16)
    assert small.rows == 16 and small.dtype == "bfloat16"                  # never more rows than the chunk
    with pytest.raises(ValueError, match="rows, hidden, vocab >= 1"):
        matmul_peak.measure(0, 576, 49152)
    assert matmul_peak.step_rates(2e9, 2.0, 2, r)["cpu_matmul_share"] == pytest.approx(0.5e9 / r.flops_per_s)
    assert matmul_peak.step_rates(2e9, 2.0, 1, None) == {"flops_per_s": 1e9, "cpu_matmul_share": None}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("kl", [False, True], ids=["weighted_ce", "row_losses_kl"])
def test_bf16_head_matches_fp32_within_bound(kl):
    g = torch.Generator().manual_seed(0)
    N, H, V = 300, 576, 4096
    W = torch.randn(V, H, generator=g) * H ** -0.5                    # (V, H) logits of unit scale
    h = torch.randn(N, H, generator=g)
    tg = torch.randint(0, V, (N,), generator=g)
    w = torch.rand(N, generator=g)
    teacher = torch.randn(N, H, generator=g) if kl else None
    got = {}
    for dt in (None, torch.bfloat16):
        x = h.clone().requires_grad_(True)
        with head_dtype(dt):
            if kl:
                loss = (w * row_losses(x, W, tg, teacher=teacher, chunk=128)[0]).sum()
            else:
                loss = weighted_ce(x, W, tg, w, chunk=128)[0]
        loss.backward()
        assert loss.dtype == torch.float32 and x.grad.dtype == torch.float32
        got[dt] = (loss.detach(), x.grad)
    (l32, g32), (l16, g16) = got[None], got[torch.bfloat16]
    d_loss, d_grad = abs(float(l16 - l32)) / abs(float(l32)), _rel(g16, g32)
    assert 0 < d_loss < REL_LOSS, f"loss {float(l16)} vs fp32 {float(l32)}: rel diff {d_loss:.2e} (bound {REL_LOSS})"
    assert 0 < d_grad < REL_GRAD, f"input gradient: rel diff {d_grad:.2e} (bound {REL_GRAD})"


def test_cpu_head_dtype_follows_bf16_flag_and_the_cpu():
    native = distributed.bf16_native()
    assert distributed.cpu_head_dtype(False) == torch.float32
    assert distributed.cpu_head_dtype(True) == (torch.bfloat16 if native else torch.float32)
    h, W = torch.zeros(2, 8), torch.zeros(5, 8)
    for bf16, want in ((False, torch.float32), (True, torch.bfloat16 if native else torch.float32)):
        with distributed.autocast_for(torch.device("cpu"), bf16)():
            assert _compute_dtype(h, W) == want                  # the head's matmul dtype
            assert not torch.is_autocast_enabled("cpu")          # the rest of the model is untouched
    assert _compute_dtype(h, W) == torch.float32                 # and only inside the context


def _run(out, bf16: bool):
    train(dflash_cfg(out, tiny_target(), max_steps=3, bf16=bf16), source=FakeSource(n=48, layout="varlen"))
    lines = (out / "log.jsonl").read_text().splitlines()
    return json.loads(lines[0]), [json.loads(x) for x in lines[1:]]


def test_trainer_logs_flops_and_matmul_share_and_bf16_head_loss(tmp_path):
    """Every CPU step logs flops_per_s and cpu_matmul_share (> 0); the header says what was
    measured; the bf16 head (where native) trains to the same losses within the bound."""
    runs = {bf16: _run(tmp_path / str(bf16), bf16) for bf16 in (False, True)}
    for bf16, (head, recs) in runs.items():
        m = head["cpu_matmul"]
        want = "bfloat16" if bf16 and distributed.bf16_native() else "float32"
        assert m["dtype"] == want and m["flops_per_s"] > 0 and (m["vocab"], m["hidden"]) == (300, 64)
        assert m["threads"] == torch.get_num_threads() and m["rows"] <= 16        # --ce-chunk 16
        for r in recs:
            assert r["flops_per_s"] > 0 and r["cpu_matmul_share"] > 0 and r["mfu"] is None
            assert r["flops_per_s"] == pytest.approx(r["cpu_matmul_share"] * m["flops_per_s"])
    fp32, bf16 = ([r["loss"] for r in runs[k][1]] for k in (False, True))
    for s, (a, b) in enumerate(zip(bf16, fp32)):
        assert abs(a - b) / abs(b) < REL_LOSS, f"step {s}: loss {a} with the bf16 head vs {b} in fp32"
