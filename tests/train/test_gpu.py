"""The CUDA path (bf16 autocast, Triton attention, pinned batches); skipped without a GPU."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_prep.train.config import build as build_config
from dflash_prep.train.loop import train

from dflash_prep.tests.train.train_fakes import FakeSource

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("layout", ["padded", "varlen"])
def test_cuda_training_runs(tmp_path, layout):
    cfg = build_config(out=str(tmp_path), model="tiny", device="cuda", progress=False, epochs=3, lr=3e-3,
                      warmup_steps=2)
    s = train(cfg, source=FakeSource(n=96, layout=layout, budget=128))
    assert s["device"].startswith("cuda") and s["steps"] > 10
    assert math.isfinite(s["loss_first"]) and math.isfinite(s["loss_last"]), s
    assert s["real_tokens"] > 0 and 0 < s["efficiency"] <= 1


def test_bench_gpu_runs_two_strategies(tmp_path):
    from dflash_prep.train import bench

    assert bench.main(["--gpu", "--n", "600", "--strategies", "bucketed-k6-window,varlen",
                       "--out", str(tmp_path / "b.json")]) == 0
