"""bucketing.py: the padded bucketed shuffle, the varlen first-fit; batch_stats.py: the fused per-batch stats."""

import numpy as np
import pytest

from dflash_prep.errors import ConfigError
from dflash_prep.formats.plan import Budget
from dflash_prep.pack import batch_stats, bucketing, keyed, metrics
from dflash_prep.synth import profiles

K6 = [832, 1248, 1760, 2464, 3760]
T = 65536
TB = Budget(value=T)


@pytest.fixture(scope="module")
def seedlike():
    return profiles.make_lengths("seedlike", n=100_000)


def _covered_once(order, n):
    return np.array_equal(np.sort(order), np.arange(n))


def test_varlen_covers_every_sample_once_under_budget(seedlike):
    order, offsets = bucketing.pack_varlen_epoch(seedlike, seed=3, epoch=0, budget=TB)
    assert _covered_once(order, len(seedlike))
    real = np.add.reduceat(seedlike[order].astype(np.int64), offsets[:-1])
    assert real.max() <= T and offsets[0] == 0 and offsets[-1] == len(seedlike)
    fill = metrics.fill(seedlike, order, offsets, T, varlen=True)
    assert fill >= 0.995, fill        # 0.9975 at full seedlike size (bench/pack_speed.py)


def test_varlen_more_open_bins_fill_better(seedlike):
    fills = [metrics.fill(seedlike, *bucketing.pack_varlen_epoch(seedlike, seed=0, epoch=0, budget=TB, open_bins=k), T,
                          varlen=True) for k in (1, 4)]
    assert fills[1] > fills[0] + 0.005, fills


def test_varlen_is_keyed_by_seed_and_epoch(seedlike):
    a = bucketing.pack_varlen_epoch(seedlike, seed=1, epoch=2, budget=TB)
    b = bucketing.pack_varlen_epoch(seedlike, seed=1, epoch=2, budget=TB)
    c = bucketing.pack_varlen_epoch(seedlike, seed=1, epoch=3, budget=TB)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], c[0])
    assert metrics.repeat_pair_rate(a[0], a[1], c[0], c[1], len(seedlike)) < 0.01


def test_varlen_cost_budget_and_max_batch_size():
    lens = profiles.make_lengths("bimodal", n=5000)
    alpha = metrics.alpha_for(768)
    order, offsets = bucketing.pack_varlen_epoch(lens, seed=0, epoch=0, budget=Budget(unit="cost", value=30000, model_dim=768,
                                                                               max_batch_size=7))
    cost = metrics.batch_cost(lens, order, offsets, alpha, varlen=True)
    assert cost.max() <= 30000 and np.diff(offsets).max() <= 7
    assert _covered_once(order, len(lens))


def test_varlen_rejects_bad_options():
    with pytest.raises(ConfigError, match="open-bins"):
        bucketing.pack_varlen_epoch(np.array([5, 6], np.int32), seed=0, epoch=0, budget=Budget(value=100), open_bins=0)
    with pytest.raises(ConfigError, match="longest sample"):
        bucketing.pack_varlen_epoch(np.array([5, 600], np.int32), seed=0, epoch=0, budget=Budget(value=100))


def test_padded_epoch_budget_buckets_and_determinism(seedlike):
    order, offsets, bucket = bucketing.pack_padded_epoch(seedlike, K6, seed=0, epoch=1, budget=TB, window=256)
    again = bucketing.pack_padded_epoch(seedlike, K6, seed=0, epoch=1, budget=TB, window=256)
    assert all(np.array_equal(x, y) for x, y in zip((order, offsets, bucket), again))
    assert _covered_once(order, len(seedlike))
    counts, real, mx = metrics.batch_stats(seedlike, order, offsets)
    assert (counts * mx).max() <= T
    bk = bucketing.bucket_index(seedlike[order], K6)
    assert np.array_equal(bk, np.repeat(bucket, counts))       # a micro-batch never spans buckets


def test_microbatch_stats_match_metrics(seedlike):
    order, offsets, _ = bucketing.pack_padded_epoch(seedlike, K6, seed=0, epoch=0, budget=TB, window=256)
    edges = metrics.class_edges(seedlike)
    real, mx, sq, class_tok = batch_stats.microbatch_stats(seedlike[order], offsets, edges)
    counts, real_ref, mx_ref = metrics.batch_stats(seedlike, order, offsets)
    lens = seedlike[order].astype(np.int64)
    assert np.array_equal(real, real_ref) and np.array_equal(mx, mx_ref)
    assert np.array_equal(sq, np.add.reduceat(lens * lens, offsets[:-1]))
    assert np.array_equal(class_tok.sum(1), real)
    cls = np.searchsorted(edges, lens, side="right")
    b = np.repeat(np.arange(len(counts)), counts)
    ref = np.zeros_like(class_tok)
    np.add.at(ref, (b, cls), lens)
    assert np.array_equal(class_tok, ref)


@pytest.mark.slow
def test_full_seedlike_varlen_fill_target():
    lens = profiles.make_lengths("seedlike")
    order, offsets = bucketing.pack_varlen_epoch(lens, seed=0, epoch=0, budget=TB)
    assert metrics.fill(lens, order, offsets, T, varlen=True) >= 0.997


@pytest.mark.parametrize("window,alpha,mbs", [(0, 0.0, None), (64, 0.0, 9), (1000, metrics.alpha_for(768), None)])
def test_padded_epoch_matches_plain_reference(window, alpha, mbs):
    """The numba core equals the definition: keyed shuffle, stable longest-first windows, greedy."""
    lens = profiles.make_lengths("bimodal", n=6000, seed=4)
    budget = 20000.0 if alpha else 16384
    b = Budget(unit="cost" if alpha else "tokens", value=budget, model_dim=768 if alpha else None, max_batch_size=mbs)
    order, offsets, bucket = bucketing.pack_padded_epoch(lens, (300, 450, 2500), seed=5, epoch=7, budget=b,
                                                       window=window)
    bk = bucketing.bucket_index(lens, (300, 450, 2500))
    ref_order, ref_off, ref_bucket = [], [0], []
    for k in range(4):
        ids = keyed.shuffle_keyed(np.flatnonzero(bk == k), 5, 7, k)
        if window > 1:
            ids = np.concatenate([c[np.argsort(-lens[c], kind="stable")] for c in np.array_split(ids, range(window, len(ids), window))])
        off = bucketing.greedy_offsets(ids, lens, b)
        ref_off += list(off[1:] + sum(len(o) for o in ref_order))
        ref_order.append(ids)
        ref_bucket += [k] * (len(off) - 1)
    assert np.array_equal(order, np.concatenate(ref_order))
    assert np.array_equal(offsets, np.asarray(ref_off)) and np.array_equal(bucket, ref_bucket)


@pytest.mark.parametrize("profile", ["seedlike", "bimodal", "heavytail", "uniform"])
def test_class_edges_histogram_equals_metrics(profile):
    lens = profiles.make_lengths(profile, n=20_000, seed=2)
    assert np.array_equal(batch_stats.class_edges(lens), metrics.class_edges(lens))
    assert np.array_equal(batch_stats.class_edges(lens[:7]), metrics.class_edges(lens[:7]))
