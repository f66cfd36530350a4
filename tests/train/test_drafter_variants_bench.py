"""bench.drafter_variants_gpu --smoke: the three drafters train on the same micro-batches with the
trainer's code, and the report holds their step times and the ratios to DFlash."""

from __future__ import annotations

import json


def test_smoke_run_reports_three_drafters_and_their_ratios(tmp_path):
    from dflash_prep.bench.drafter_variants_gpu import main

    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    rep = json.loads((tmp_path / "drafter_variants_gpu.json").read_text())
    assert [r["drafter"] for r in rep["rows"]] == ["dflash", "dflash2", "eagle3"]
    assert rep["smoke"] is True and set(rep["step_time_ratio"]) == {"dflash2", "eagle3"}
    for r in rep["rows"]:
        assert r["timed_steps"] == 1 and r["s_per_step"] > 0 and r["tokens_per_s"] > 0 and r["parameters"] > 0
    dflash, dflash2 = rep["rows"][0]["parameters"], rep["rows"][1]["parameters"]
    assert dflash2 > dflash                      # the convolutions and the selector's codebooks
    assert "dflash2 / dflash" in (tmp_path / "drafter_variants_gpu.md").read_text()
