"""The EAGLE-3 TTT attention GPU check: its smoke mode runs end to end on CPU and writes a versioned report."""

from __future__ import annotations

import json

import pytest

from dflash_prep.bench import attention_ttt as bench
from dflash_prep.errors import ConfigError, InputError


def test_flops_count_the_causal_part_and_the_diagonal_keys():
    # per step: 2 * Hq * D * sum n^2 (causal, as bench.attention counts it) + 4 * Hq * D * T * i (i diagonal keys)
    assert bench.ttt_flops([3, 1], 2, 4, 8) == 2 * (2 * 4 * 8 * (9 + 1)) + 4 * 4 * 8 * 4 * 1
    assert bench.ttt_flops([5], 1, 2, 16) == 2 * 2 * 16 * 25  # one step: the causal attention's count


def test_documents_fill_the_case():
    assert bench.documents(8192, 2048) == [2048, 1024, 512, 512] * 2
    assert sum(bench.documents(16384, 2048)) == 16384


@pytest.mark.parametrize("kwargs,match", [(dict(tokens=(2048,)), "multiple of 2 \\* doc_len"),
                                          (dict(doc_len=6), "multiple of 4"),
                                          (dict(steps=0), "steps"),
                                          (dict(heads_q=6, heads_kv=4), "multiple"),
                                          (dict(budget_s=0), "budget_s")])
def test_bad_config(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        bench.TTTBenchConfig(**kwargs)


def test_smoke_runs_and_writes_a_versioned_report(tmp_path):
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    report = bench.read_report(tmp_path / "attention-ttt-smoke.json")
    assert report["smoke"] is True and [c["passed"] for c in report["checks"]] == [True]
    assert report["checks"][0]["deterministic"] and set(report["checks"][0]["grads"]) == set(bench.NAMES)
    providers = {r["provider"]: r for r in report["rows"]}
    assert set(providers) == set(bench.PROVIDERS)
    for name, row in providers.items():  # every provider ran both ways on the smoke shapes
        assert row["error"] is None and row["fwd_ms"] > 0 and row["bwd_ms"] > 0, name
    assert providers["ours-per-step"]["max_abs_diff"] == 0.0  # the same programs, one step at a time
    for name in ("sdpa-mask", "reference"):  # the baselines agree with our output (bf16)
        assert providers[name]["max_abs_diff"] < 0.05, name
    assert {(s["baseline"], s["fwd"] is not None) for s in report["speedups"]} == {
        (p, True) for p in bench.PROVIDERS[1:]}
    assert "not performance figures" in (tmp_path / "attention-ttt-smoke.md").read_text()
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps(dict(report, version=99)))
    with pytest.raises(InputError, match="not a dflash-attention-ttt-bench v1 file"):
        bench.read_report(bad)
