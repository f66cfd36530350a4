"""The DFlash attention GPU check: its smoke mode runs end to end on CPU and writes a versioned report."""

from __future__ import annotations

import json

import pytest

from dflash_prep.bench import attention_dflash as bench
from dflash_prep.errors import ConfigError, InputError


def test_flops_follow_the_issue():
    # forward 4 * Hq * D * sum_j B * (a_j + B)
    assert bench.dflash_flops([0, 10], 32, 128, 16) == 4 * 32 * 128 * (16 * 16 + 16 * 26)


def test_dense_layout_matches_the_mask_definition():
    import torch

    leaves, meta = bench.make_case(bench.smoke_config("x"), 40, 5, torch.device("cpu"))
    cu_ctx, cu_blk, anchors = meta
    assert cu_blk.tolist() == [0, 20, 24, 24] and cu_ctx.tolist() == [0, 40, 50, 55]  # docs (40,5) (10,1) (5,0)
    assert anchors[:5].tolist() == sorted(set(anchors[:5].tolist())) and int(anchors[:5].max()) < 40
    lo, hi, blocks = bench.dense_layout(meta, 24, 55, 4)
    assert lo[:20].tolist() == [0] * 20 and lo[20:].tolist() == [40] * 4  # doc 1's context starts at row 40
    assert hi[21].item() == 40 + int(anchors[5]) and blocks[21].item() == 5


@pytest.mark.parametrize("kwargs,match", [(dict(cases=((8, 9),)), "0 < N <= S"),
                                          (dict(heads_q=6, heads_kv=4), "multiple"),
                                          (dict(budget_s=0), "budget_s"),
                                          (dict(window_cases=((64, 4, 8),)), "W >= B")])
def test_bad_config(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        bench.DFlashBenchConfig(**kwargs)


def test_smoke_runs_and_writes_a_versioned_report(tmp_path):
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    report = bench.read_report(tmp_path / "attention-dflash-smoke.json")
    assert report["smoke"] is True and [c["passed"] for c in report["checks"]] == [True, True]
    assert [c["window"] for c in report["checks"]] == [0, 8]  # full, then the sliding-window check
    assert [(r["provider"], r["W"]) for r in report["window_rows"]] == [("ours", 0), ("ours window 8", 8)]
    assert all(r["fwd_ms"] > 0 and r["bwd_ms"] > 0 for r in report["window_rows"])
    [up] = report["window_speedups"]
    assert up["W"] == 8 and up["flops_ratio"] > 1 and up["fwd_speedup"] > 0
    assert set(report["checks"][0]["grads"]) == set(bench.NAMES)
    providers = {r["provider"]: r for r in report["rows"]}
    assert set(providers) == {"ours", "flex-blockmask", "sdpa-dense-mask"}
    assert providers["ours"]["fwd_ms"] > 0 and providers["ours"]["bwd_ms"] > 0
    for name in ("flex-blockmask", "sdpa-dense-mask"):  # both baselines agree with our output (bf16)
        assert providers[name]["error"] is None and providers[name]["max_abs_diff"] < 0.05
    assert all(t["passed"] is None for t in report["targets"])  # smoke claims nothing
    assert "not performance figures" in (tmp_path / "attention-dflash-smoke.md").read_text()
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps(dict(report, version=99)))
    with pytest.raises(InputError, match="not a dflash-attention-dflash-bench v1 file"):
        bench.read_report(bad)
