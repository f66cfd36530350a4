"""The kernel benchmark: its smoke mode runs end to end on CPU and writes versioned results."""

from __future__ import annotations

import pytest

from dflash_prep.errors import ConfigError
from dflash_prep.formats.fileio import read_json

from dflash_prep.bench import attention as bench


def test_flops_follow_design():
    # forward 4 * H * sum(L^2) * D * 0.5, exact integers (no float rounding at 16k)
    assert bench.causal_flops([1024] * 16, 32, 64) == 4 * 32 * 16 * 1024**2 * 64 // 2
    assert bench.causal_flops([3, 5], 2, 32) == 2 * 2 * 32 * (9 + 25)


def test_varlen_documents_fill_the_batch_deterministically():
    cfg = bench.BenchConfig()
    docs = bench.varlen_doc_lens(cfg)
    assert sum(docs) == cfg.tokens and min(docs) >= 1 and len(docs) > 1
    assert docs == bench.varlen_doc_lens(cfg)
    assert docs != bench.varlen_doc_lens(bench.BenchConfig(seed=1))


@pytest.mark.parametrize("kwargs,match", [
    (dict(hidden=100), "multiple of head dim"),
    (dict(seqlens=(3000,)), "must divide tokens"),
    (dict(budget_s=0), "budget_s"),
])
def test_bad_config(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        bench.BenchConfig(**kwargs)


def test_smoke_runs_and_writes_versioned_results(tmp_path):
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    report = read_json(tmp_path / "kernels-bench-smoke.json", format=bench.FORMAT, versions=(bench.VERSION,))
    assert report["smoke"] is True
    ours = [r for r in report["rows"] if r["provider"] == "ours"]
    # every dense length, the varlen batch and its equal-FLOPs dense twin ran our kernel
    assert {(r["case"], r["seqlen"]) for r in ours if r["case"] == "dense"} == {("dense", 32), ("dense", 64)}
    assert {r["case"] for r in ours} == {"dense", "varlen", "dense-equal-flops"}
    for r in ours:
        assert r["error"] is None and r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and r["fwd_tflops"] > 0
    for r in report["rows"]:  # our output agrees with the baselines that produced one (bf16)
        if r["max_abs_diff"] is not None:
            assert r["max_abs_diff"] < 0.05, r
    assert report["targets"] and all(t["passed"] is None for t in report["targets"])  # smoke claims nothing
    table = (tmp_path / "kernels-bench-smoke.md").read_text()
    assert "not performance figures" in table and "| varlen |" in table
