"""Subsampled simulation (analyze's rows): rescaled figures against full pack runs."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_prep.analyze.optimize import histogram
from dflash_prep.analyze.simulate import (Subsample, rescale_repeat, same_window_probability, simulate, sorted_static,
                                          subsample_counts)
from dflash_prep.analyze.tradeoff import window_grid
from dflash_prep.formats.plan import Budget
from dflash_prep.pack import metrics
from dflash_prep.pack.bucketing import greedy_offsets, pack_padded_epoch
from dflash_prep.synth.profiles import make_lengths

T = 65536
BOUNDS = (900, 1400, 2200)


@pytest.fixture(scope="module")
def lengths():
    return make_lengths("seedlike", 400_000, 3)


def test_subsample_is_systematic_and_deterministic(lengths):
    h = histogram(lengths)
    c = subsample_counts(h, 50_000)
    assert c.sum() == 50_000 and np.all(c >= 0)
    assert np.all(np.abs(np.cumsum(c) - np.cumsum(h.counts) * 50_000 / h.num_samples) < 1)  # within one sample
    assert np.array_equal(Subsample.of(h, 50_000).lengths, Subsample.of(h, 50_000).lengths)
    assert Subsample.of(h, 10**7).exact and len(Subsample.of(h, 10**7).lengths) == len(lengths)


def test_exact_when_the_subsample_is_everything(lengths):
    sub = Subsample.of(histogram(lengths), 10**7)
    sim = simulate(sub, BOUNDS, budget=Budget(value=T), window=1024, seed=4)
    effs, prev, rps = [], None, []
    for e in range(2):
        order, offsets, _ = pack_padded_epoch(sub.lengths, BOUNDS, seed=4, epoch=e, budget=Budget(value=T), window=1024)
        effs.append(metrics.efficiency(sub.lengths, order, offsets))
        if prev is not None:
            rps.append(metrics.repeat_pair_rate(*prev, order, offsets, len(sub.lengths)))
        prev = (order, offsets)
    assert sim.efficiency == pytest.approx(np.mean(effs), abs=1e-12)
    assert sim.repeat_pair == pytest.approx(rps[0], abs=1e-12)
    assert rescale_repeat(0.3, 1024, 500, 500) == 0.3


@pytest.mark.parametrize("window", [0, 1024, 16384, 131072])
def test_subsample_predicts_full_pack(lengths, window):
    """A 2^15 subsample (8% of the data) against packing all 400K samples: efficiency within
    0.5 pp and repeat-pair within 0.005, including windows larger than the subsample's buckets."""
    h = histogram(lengths)
    small = simulate(Subsample.of(h, 1 << 15), BOUNDS, budget=Budget(value=T), window=window)
    full = simulate(Subsample.of(h, 10**7), BOUNDS, budget=Budget(value=T), window=window)
    assert abs(small.efficiency - full.efficiency) < 0.005, (window, small, full)
    assert abs(small.repeat_pair - full.repeat_pair) < 0.005, (window, small.repeat_pair, full.repeat_pair)
    assert small.microbatches == pytest.approx(full.microbatches, rel=0.01)


def test_same_window_probability():
    assert same_window_probability(4, 8) == pytest.approx(2 * 4 * 3 / (8 * 7))
    assert same_window_probability(100, 8) == 1.0
    assert same_window_probability(3, 7) == pytest.approx((2 * 3 * 2 + 1 * 0) / (7 * 6))


@pytest.mark.parametrize("cap", [None, 7])
def test_sorted_static_from_histogram_matches_greedy(lengths, cap):
    h = histogram(lengths[:50_000])
    lens = lengths[:50_000]
    ids = np.argsort(lens, kind="stable")
    off = greedy_offsets(ids, lens, Budget(value=T, max_batch_size=cap))
    got = sorted_static(h, budget=Budget(value=T, max_batch_size=cap))
    assert got["microbatches"] == len(off) - 1
    assert got["efficiency"] == pytest.approx(metrics.efficiency(lens, ids, off), abs=1e-12)
    assert got["fill"] == pytest.approx(metrics.fill(lens, ids, off, T), abs=1e-12)
    assert got["spread"] == pytest.approx(metrics.within_batch_spread(lens, ids, off), abs=1e-12)


def test_window_grid_grows_with_the_largest_bucket():
    assert window_grid(50) == [0, 64]
    assert window_grid(1000) == [0, 64, 128, 256, 512, 1024]
    assert window_grid(10**8)[-1] == 1 << 27
