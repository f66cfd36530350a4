"""The analyze stage end to end: plan.json, report, PNG, CLI, determinism, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from dflash_prep import metrics
from dflash_prep import plan as plan_mod
from dflash_prep.analyze import AnalyzeConfig, equal_count_boundaries, equal_mass_boundaries, run
from dflash_prep.cli import app
from dflash_prep.errors import ConfigError, InputError
from dflash_prep.fileio import atomic_save_npy, atomic_write_json, fingerprint_array, read_json
from dflash_prep.lengths import DATASET_FORMAT
from dflash_prep.optimize import histogram
from dflash_prep.bucketing import pack_padded_epoch
from dflash_prep.profiles import make_lengths

N = 20_000
T = 65536


@pytest.fixture(scope="module")
def lengths_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("lens") / "bimodal.npy"
    np.save(path, make_lengths("bimodal", N, 5))
    return path


def cfg(path, out, **kw) -> AnalyzeConfig:
    kw.setdefault("budget", T)
    kw.setdefault("plot", False)
    return AnalyzeConfig(lengths_file=path, out=out, **kw)


def test_auto_window_is_largest_within_repeat_slack(lengths_file, tmp_path):
    rep = run(cfg(lengths_file, tmp_path))
    rows = {r["window"]: r for r in rep["pareto_window"]}
    limit = rows[0]["repeat_pair"] + 0.01
    chosen = rep["window"]
    assert rep["window_how"] == "auto" and plan_mod.load(tmp_path / "plan.json").window == chosen
    assert rows[chosen]["repeat_pair"] <= limit
    assert all(r["repeat_pair"] > limit for w, r in rows.items() if w > chosen)
    assert 0 < chosen < 2048  # 20k samples: a 2048 window would cover much of a bucket
    assert rep["predicted"]["window"] == chosen


def test_plan_report_and_png(lengths_file, tmp_path):
    rep = run(cfg(lengths_file, tmp_path, plot=True, buckets=5, window=2048))
    plan = plan_mod.load(tmp_path / "plan.json")
    assert list(plan.boundaries) == rep["boundaries"] and len(plan.boundaries) == 4
    assert plan.window == 2048 and plan.budget.value == T and plan.fingerprint == rep["fingerprint"]
    assert plan.data["fingerprint"] == fingerprint_array(np.load(lengths_file).astype(np.int32))
    assert [b["count"] for b in plan.buckets] == list(np.bincount(np.searchsorted(plan.boundaries,
                                                                                    np.load(lengths_file), "right")))
    assert sum(b["tokens"] for b in plan.buckets) == int(np.load(lengths_file).sum(dtype=np.int64))
    assert plan.buckets[0]["lo"] == 0 and plan.buckets[-1]["hi"] == int(np.load(lengths_file).max()) + 1
    p = plan.predicted
    assert p["window"] == 2048 and "simulated" in p["how"] and p["window0"]["how"] == "model"
    assert p["window0"]["efficiency"] < p["efficiency"] <= 1.0
    assert read_json(tmp_path / "analyze-report.json", format="dflash-prep/analyze-report")["k"] == 5
    assert Path(rep["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    names = [s["name"] for s in rep["strategies"]]
    assert names == ["sorted-static", "full random", "equal-count K=5", "equal-mass K=5", "optimal K=5",
                     "optimal K=5 + window 2048"]
    eff = {s["name"]: s["efficiency_sim"] for s in rep["strategies"]}
    assert eff["full random"] < eff["equal-mass K=5"] < eff["optimal K=5"] < eff["optimal K=5 + window 2048"]
    assert [r["k"] for r in rep["pareto_k"]] == list(range(1, 33))
    assert [r["window"] for r in rep["pareto_window"]] == [0, 64, 128, 256, 512, 1024, 2048, 4096]  # small data: +64..512
    # 20k samples in 5 buckets: a 2048 window sorts most of a bucket, so batches barely change
    rp = {r["window"]: r["repeat_pair"] for r in rep["pareto_window"]}
    assert rp[2048] > 0.05 and len(rep["warnings"]) == 1
    assert f"--window {max(w for w in rp if w and rp[w] <= 0.05)}" in rep["warnings"][0]


def test_deterministic_plan(lengths_file, tmp_path):
    run(cfg(lengths_file, tmp_path / "a", window=0))
    run(cfg(lengths_file, tmp_path / "b", window=0))
    assert (tmp_path / "a" / "plan.json").read_bytes() == (tmp_path / "b" / "plan.json").read_bytes()


def test_window0_prediction_matches_pack(lengths_file, tmp_path):
    run(cfg(lengths_file, tmp_path, window=0, buckets=4))
    plan = plan_mod.load(tmp_path)
    lens = np.load(lengths_file)
    assert plan.predicted["how"] == "model" and plan.window == 0
    for epoch in (0, 5):
        order, offsets, _ = pack_padded_epoch(lens, plan.boundaries, seed=plan.seed, epoch=epoch, budget=plan_mod.Budget(value=T))
        assert abs(metrics.efficiency(lens, order, offsets) - plan.predicted["efficiency"]) < 0.005


def test_target_efficiency_picks_smallest_k(lengths_file, tmp_path):
    rep = run(cfg(lengths_file, tmp_path, target_efficiency=0.9, window=0))
    k = rep["k"]
    effs = {r["k"]: r["efficiency"] for r in rep["pareto_k"]}
    assert effs[k] >= 0.9 and (k == 1 or effs[k - 1] < 0.9)
    with pytest.raises(ConfigError, match="reaches"):
        run(cfg(lengths_file, tmp_path, target_efficiency=1.0, window=0))


def test_cost_budget(lengths_file, tmp_path):
    with pytest.raises(ConfigError, match="model-dim"):
        cfg(lengths_file, tmp_path, budget_unit="cost")
    run(cfg(lengths_file, tmp_path, budget_unit="cost", budget=1.3 * T, model_dim=768, window=0))
    plan = plan_mod.load(tmp_path)
    assert plan.budget.unit == "cost" and plan.budget.packing_alpha == pytest.approx(1 / (12 * 768))
    lens = np.load(lengths_file)
    order, offsets, _ = pack_padded_epoch(lens, plan.boundaries, seed=0, epoch=1, budget=plan.budget)
    assert abs(metrics.efficiency(lens, order, offsets) - plan.predicted["efficiency"]) < 0.005


def test_dataset_folder_input_writes_beside_it(tmp_path):
    folder = tmp_path / "ds"
    lens = make_lengths("heavytail", 3000, 1)
    atomic_save_npy(folder / "lengths.npy", lens)
    atomic_write_json(folder / "meta.json", {"fingerprint": "f" * 32, "counts": {"samples": len(lens)}},
                      format=DATASET_FORMAT, version=1)
    rep = run(AnalyzeConfig(data=folder, budget=T, plot=False, window=0))
    assert Path(rep["plan"]) == folder / "plan.json"
    assert plan_mod.load(folder).data["fingerprint"] == "f" * 32


def test_boundary_baselines():
    h = histogram(make_lengths("seedlike", 50_000, 0))
    ec = equal_count_boundaries(h, 4)
    counts = np.diff(np.searchsorted(np.repeat(h.values, h.counts), [0, *ec, h.max_len + 1]))
    assert len(ec) == 3 and np.all(np.abs(counts - 12_500) < 200)
    em = equal_mass_boundaries(h, 4)
    lens = np.repeat(h.values, h.counts)
    mass = [lens[(lens >= a) & (lens < b)].sum() for a, b in zip([0, *em], [*em, h.max_len + 1])]
    assert len(em) == 3 and max(mass) / min(mass) < 1.05


def test_bad_input(tmp_path, lengths_file):
    empty = tmp_path / "empty.npy"
    np.save(empty, np.array([], np.int32))
    with pytest.raises(InputError, match="no samples"):
        run(cfg(empty, tmp_path))
    with pytest.raises(InputError, match="not found"):
        run(cfg(tmp_path / "missing.npy", tmp_path))
    with pytest.raises(ConfigError, match="raise --budget"):
        run(cfg(lengths_file, tmp_path, budget=1000))
    with pytest.raises(ConfigError, match="at least 1"):
        cfg(lengths_file, tmp_path, buckets=0)
    with pytest.raises(ConfigError, match="exactly one"):
        AnalyzeConfig()
    assert not (tmp_path / "plan.json").exists()


def test_cli(lengths_file, tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["analyze", "--lengths", str(lengths_file), "--out", str(tmp_path), "--budget", str(T),
                              "--buckets", "3", "--window", "0", "--json", "--no-plot"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    assert rep["format"] == "dflash-prep/analyze-report" and rep["k"] == 3
    assert plan_mod.load(tmp_path).boundaries == tuple(rep["boundaries"])
    res = runner.invoke(app, ["analyze", "--lengths", str(tmp_path / "nope.txt"), "--out", str(tmp_path)])
    assert res.exit_code == 1 and "lengths file not found" in res.output and "Traceback" not in res.output
    res = runner.invoke(app, ["analyze", "--lengths", str(lengths_file), "--buckets", "0"])
    assert res.exit_code == 1 and "--buckets must be at least 1" in res.output
