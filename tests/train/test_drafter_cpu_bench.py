"""bench.drafter_cpu: the --smoke run (tiny target) writes every variant with its rates and loss check."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_prep.formats.fileio import check_header
from dflash_prep.train.distributed import bf16_native

from dflash_prep.bench import drafter_cpu as b


@pytest.fixture
def keep_determinism():
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


def test_smoke_run_reports_rates_head_split_and_loss_diffs(tmp_path, keep_determinism):
    assert b.main(["--smoke", "--out", str(tmp_path)]) == 0
    path = tmp_path / "drafter_cpu.json"
    rep = check_header(json.loads(path.read_text()), path=path, format=b.FORMAT, versions=(1,))
    names = [r["variant"] for r in rep["rows"]]
    want = [f"dflash chunk {c}" for c in b.SMOKE["chunks"]] + (["dflash chunk 64 bf16 head"] if bf16_native() else [])
    assert names == want + ["eagle3 draft vocab 512", "eagle3 draft vocab 256"]
    assert set(rep["matmul_flops_per_s"]) == ({"float32", "bfloat16"} if bf16_native() else {"float32"})
    for r in rep["rows"]:
        assert r["s_per_step"] > 0 and r["flops_per_s"] > 0 and r["matmul_flops_per_s"] > 0 and r["matmul_share"] > 0
        assert len(r["losses"]) == b.SMOKE["steps"] + b.SMOKE["warmup"]
        if r["variant"].startswith("dflash"):
            assert 0 < r["head_s"] < r["s_per_step"] and r["head_rows"] > 0
            assert r["head_s"] + r["rest_s"] == pytest.approx(r["s_per_step"])
    chunked = [r for r in rep["rows"] if r["variant"].startswith("dflash chunk") and "bf16" not in r["variant"]]
    assert all(r["max_rel_loss_diff_vs_default"] < 1e-5 for r in chunked)  # chunking is exact up to summation order
    assert "same-run matmul GFLOP/s" in (tmp_path / "drafter_cpu.md").read_text()
