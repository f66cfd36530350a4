"""The analyze stage end to end: plan.json, report, PNG, CLI, determinism, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from dflash_prep.analyze.analyze import AnalyzeConfig, equal_count_boundaries, equal_mass_boundaries, run
from dflash_prep.analyze.optimize import histogram
from dflash_prep.cli import app
from dflash_prep.errors import ConfigError, InputError
from dflash_prep.formats import plan as plan_mod
from dflash_prep.formats.fileio import atomic_save_npy, atomic_write_json, fingerprint_array, read_json
from dflash_prep.formats.lengths import DATASET_FORMAT
from dflash_prep.pack import metrics
from dflash_prep.pack.bucketing import pack_padded_epoch
from dflash_prep.synth.profiles import make_lengths

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


def test_default_plan_chooses_k_and_window_jointly(lengths_file, tmp_path):
    from dflash_prep.analyze.tradeoff import TIE

    rep = run(cfg(lengths_file, tmp_path))
    plan = plan_mod.load(tmp_path / "plan.json")
    assert rep["window_how"] == "joint" and rep["k_how"] == "joint"
    assert (plan.window, len(plan.boundaries) + 1) == (rep["window"], rep["k"])
    p = rep["predicted"]
    assert p["repeat_pair"] <= 0.05 and p["max_repeat_pair"] == 0.05 and rep["warnings"] == []
    assert 0 <= p["step_mix"]["step_mix"] < 0.5 and p["step_mix"]["world_size"] == 8
    # the rule over the per-K picks: within the limit, within TIE of the best, least repeat-pair
    ok = [r for r in rep["joint"] if r["repeat_pair"] <= 0.05]
    top = max(r["efficiency"] for r in ok)
    assert p["efficiency"] >= top - TIE
    assert all(r["repeat_pair"] >= p["repeat_pair"] for r in ok if r["efficiency"] >= top - TIE)
    assert [r["k"] for r in rep["joint"]] == [1, 2, 4, 6, 8, 16]
    # the window table runs up to the first window past the limit
    rows = rep["pareto_window"]
    assert rows[0]["window"] == 0 and rows[-1]["repeat_pair"] > 0.05
    assert all(r["repeat_pair"] <= 0.05 for r in rows[:-1])
    # a tighter limit gives a plan with fewer repeated pairs
    strict = run(cfg(lengths_file, tmp_path / "strict", max_repeat_pair=0.02))
    assert strict["predicted"]["repeat_pair"] <= 0.02 < p["repeat_pair"]


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
    windows = [r["window"] for r in rep["pareto_window"]]
    assert windows[:3] == [0, 64, 128] and 2048 in windows and windows == sorted(windows)
    # 20k samples in 5 buckets: a 2048 window sorts most of a bucket, so pairs meet again
    rp = {r["window"]: r["repeat_pair"] for r in rep["pareto_window"]}
    assert rp[2048] > 0.05 and len(rep["warnings"]) == 1 and "95%" in rep["warnings"][0]
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
    rep = json.loads(res.stdout)
    assert rep["format"] == "dflash-prep/analyze-report" and rep["k"] == 3
    assert plan_mod.load(tmp_path).boundaries == tuple(rep["boundaries"])
    res = runner.invoke(app, ["analyze", "--lengths", str(tmp_path / "nope.txt"), "--out", str(tmp_path)])
    assert res.exit_code == 1 and "lengths file not found" in res.output and "Traceback" not in res.output
    res = runner.invoke(app, ["analyze", "--lengths", str(lengths_file), "--buckets", "0"])
    assert res.exit_code == 1 and "--buckets must be at least 1" in res.output
    res = runner.invoke(app, ["analyze", "--lengths", str(lengths_file), "--sim-epochs", "1"])
    assert res.exit_code == 1 and "--sim-epochs must be at least 2" in res.output
    res = runner.invoke(app, ["analyze", "--lengths", str(lengths_file), "--epochs", "3"])
    assert res.exit_code != 0  # the simulated-epoch count is --sim-epochs; --epochs belongs to pack


def test_tables_fit_80_columns(lengths_file, tmp_path):
    from rich.console import Console

    from dflash_prep.analyze.report import render

    rep = run(cfg(lengths_file, tmp_path, buckets=6))
    con = Console(width=80, record=True, color_system=None)
    render(rep, con)
    text = con.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "\u2026" not in text and "..." not in text  # folded, never cut
    # every boundary of the widest K row is printed in full (folded over lines)
    flat = "".join(text.split())
    assert all(str(b) in flat for b in rep["pareto_k"][-1]["boundaries"])
