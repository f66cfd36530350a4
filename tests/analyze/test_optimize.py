"""The boundary search (dflash_prep.analyze.optimize): exactness, prediction accuracy, int64, edges, errors."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dflash_prep.analyze.analyze import equal_mass_boundaries
from dflash_prep.analyze.optimize import Histogram, Model, PackModel, histogram
from dflash_prep.errors import ConfigError, InputError
from dflash_prep.formats.plan import Budget
from dflash_prep.pack import metrics
from dflash_prep.pack.bucketing import pack_padded_epoch
from dflash_prep.synth.profiles import make_lengths

T = 65536


def brute_force(model: Model, k: int) -> float:
    """Least total dp_cost over every way to cut the distinct lengths into k buckets."""
    d = len(model.hist.values)
    best = np.inf
    for cuts in itertools.combinations(range(1, d), k - 1):
        edges = (0, *cuts, d)
        best = min(best, sum(model.dp_cost(a, b - 1) for a, b in zip(edges[:-1], edges[1:])))
    return best


def objective(model: Model, boundaries) -> float:
    return sum(model.dp_cost(i, j) for i, j in model.index_ranges(boundaries))


@pytest.mark.parametrize("seed", range(6))
def test_search_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    d = int(rng.integers(6, 11))
    values = np.sort(rng.choice(np.arange(20, 2000), size=d, replace=False)).astype(np.int64)
    counts = rng.integers(1, 400, size=d).astype(np.int64)
    budget = float(rng.choice([2048, 4096, 16384]))
    model = Model(Histogram(values, counts), PackModel(budget, max_batch_size=[None, 8][seed % 2]))
    fast, full = model.search(5), model.search(5, exhaustive=True)
    for k in range(1, 6):
        want = brute_force(model, k)
        for res in (fast, full):
            got = objective(model, res.boundaries[k - 1])
            assert len(res.boundaries[k - 1]) == k - 1
            assert got == pytest.approx(want, rel=1e-12), (seed, k, res.boundaries[k - 1], got, want)
            assert res.padded[k - 1] == pytest.approx(want, rel=1e-12)


def test_divide_and_conquer_matches_exhaustive_on_a_profile():
    # D&C assumes a monotone argmin; where near-ties break it, it may land a few tokens
    # off the exhaustive optimum (measured: <= 2e-7 of padded tokens, 1e-5 pp efficiency)
    h = histogram(make_lengths("heavytail", 50_000, 3))
    model = Model(h, PackModel(16384.0))
    fast, full = model.search(12), model.search(12, exhaustive=True)
    for k in range(1, 13):
        assert full.padded[k - 1] <= fast.padded[k - 1] * (1 + 1e-12), k
        assert fast.padded[k - 1] == pytest.approx(full.padded[k - 1], rel=1e-6), k


def simulate(lengths, boundaries, budget, epochs=3) -> float:
    return float(np.mean([metrics.efficiency(lengths, *pack_padded_epoch(
        lengths, boundaries, seed=7, epoch=e, budget=Budget(value=budget))[:2]) for e in range(epochs)]))


@pytest.mark.parametrize("profile,budget", [("seedlike", T), ("bimodal", T), ("heavytail", T),
                                            ("seedlike", 8192), ("heavytail", 16384)])
def test_predicted_efficiency_matches_simulation(profile, budget):
    lengths = make_lengths(profile, 200_000, 1)
    model = Model(histogram(lengths), PackModel(float(budget)))
    res = model.search(8)
    for k in (1, 3, 6, 8):
        b = res.boundaries[k - 1]
        pred, sim = model.predict(b)["efficiency"], simulate(lengths, b, budget)
        assert abs(pred - sim) < 0.005, f"{profile} T={budget} K={k}: predicted {pred:.4f}, simulated {sim:.4f}"


def test_refine_only_moves_when_the_models_disagree():
    lengths = make_lengths("seedlike", 100_000, 4)
    model = Model(histogram(lengths), PackModel(8192.0))  # few samples per micro-batch: the O(1) model is off
    b = model.search(4).boundaries[3]
    r = model.refine(b)
    assert model.predict(r)["padded_tokens"] <= model.predict(b)["padded_tokens"]
    assert model.refine(r) == r
    narrow = Model(histogram(lengths), PackModel(float(T)))
    b = narrow.search(24).boundaries[23]
    assert narrow.refine(b) == b  # the models agree within 0.1 pp: nothing to polish


@pytest.mark.parametrize("budget,alpha,cap", [(T, 0.0, 16), (1.3 * T, 1 / (12 * 768), None),
                                              (1.3 * T, 1 / (12 * 768), 8)])
def test_prediction_under_caps_and_cost_budgets(budget, alpha, cap):
    lengths = make_lengths("seedlike", 100_000, 3)
    model = Model(histogram(lengths), PackModel(budget, alpha, cap))
    b = model.refine(model.search(6).boundaries[5])
    pred = model.predict(b)
    spec = Budget(unit="cost" if alpha else "tokens", value=budget, model_dim=768 if alpha else None, max_batch_size=cap)
    runs = [pack_padded_epoch(lengths, b, seed=0, epoch=e, budget=spec) for e in range(3)]
    eff = np.mean([metrics.efficiency(lengths, o, off) for o, off, _ in runs])
    mbs = np.mean([len(off) - 1 for _, off, _ in runs])
    fill = np.mean([metrics.batch_cost(lengths, o, off, alpha).sum() / ((len(off) - 1) * budget) for o, off, _ in runs])
    assert abs(pred["efficiency"] - eff) < 0.005, (pred["efficiency"], eff)
    assert abs(pred["microbatches"] - mbs) / mbs < 0.005, (pred["microbatches"], mbs)
    assert abs(pred["fill"] - fill) < 0.005, (pred["fill"], fill)


def test_optimal_beats_equal_mass_at_every_k():
    lengths = make_lengths("seedlike", 200_000, 2)
    h = histogram(lengths)
    model = Model(h, PackModel(float(T)))
    res = model.search(32)
    for k in range(2, 33):
        opt = model.predict(model.refine(res.boundaries[k - 1]))["efficiency"]
        em = model.predict(equal_mass_boundaries(h, k))["efficiency"]
        assert opt > em, f"K={k}: optimal {opt:.4f} <= equal-mass {em:.4f}"


@pytest.mark.slow
def test_design_reference_figures_on_seedlike():
    lengths = make_lengths("seedlike")
    h = histogram(lengths)
    model = Model(h, PackModel(float(T)))
    res = model.search(32)
    for k, floor in ((6, 0.8065), (8, 0.849), (16, 0.9205), (32, 0.9585)):  # definitions.md floors: .807/.849/.921/.959
        sim = simulate(lengths, model.refine(res.boundaries[k - 1]), T)
        assert sim >= floor, f"K={k}: simulated {sim:.4f} below definitions.md's {floor}"
        em = simulate(lengths, equal_mass_boundaries(h, k), T)
        assert sim > em, f"K={k}: optimal {sim:.4f} <= equal-mass {em:.4f}"


def test_int64_at_a_billion_tokens():
    n = 130_000  # 130k x 8191 = 1.06e9 tokens; 2**31 is 2.1e9, so sums past it must stay exact
    lengths = np.full(n, 8191, np.int32)
    lengths[: n // 2] = 8000
    h = histogram(lengths)
    assert h.counts.dtype == np.int64 and h.total_tokens == (n // 2) * 8000 + (n - n // 2) * 8191
    big = Histogram(np.array([1000, 8191], np.int64), np.array([2_000_000, 300_000], np.int64))
    assert big.total_tokens == 2_000_000_000 + 300_000 * 8191  # 4.46e9 > 2**32
    model = Model(big, PackModel(float(T)))
    res = model.search(2)
    assert res.boundaries[1] == (8191,)
    pred = model.predict(res.boundaries[1])
    assert pred["efficiency"] == pytest.approx(1.0) and pred["padded_tokens"] == pytest.approx(big.total_tokens)
    assert model.predict(())["efficiency"] < 0.5


def test_every_sample_the_same_length():
    model = Model(histogram(np.full(1000, 512, np.int32)), PackModel(float(T)))
    res = model.search(6)
    assert res.boundaries == ((),) and res.requested == 6
    assert model.predict(())["efficiency"] == pytest.approx(1.0)
    assert model.predict(())["microbatches"] == pytest.approx(1000 / 128 + 0.5)


def test_k_larger_than_distinct_lengths():
    lengths = np.repeat(np.array([100, 300, 900], np.int32), [50, 40, 30])
    model = Model(histogram(lengths), PackModel(4096.0))
    res = model.search(10)
    assert len(res.boundaries) == 3 and res.boundaries[2] == (300, 900)
    assert res.efficiency(3) == pytest.approx(1.0)


def test_a_single_sample():
    model = Model(histogram(np.array([77], np.int32)), PackModel(1024.0))
    res = model.search(4)
    assert res.boundaries == ((),)
    pred = model.predict(())
    assert pred["efficiency"] == 1.0 and pred["microbatches"] == 1.0


def test_bad_input_errors():
    with pytest.raises(InputError, match="no samples"):
        histogram(np.array([], np.int32))
    with pytest.raises(ConfigError, match="raise --budget"):
        Model(histogram(np.array([100, 5000], np.int32)), PackModel(4096.0))
    with pytest.raises(ConfigError, match="at least 1"):
        Model(histogram(np.array([100, 500], np.int32)), PackModel(4096.0)).search(0)
    with pytest.raises(ConfigError, match="positive"):
        PackModel(0.0)
