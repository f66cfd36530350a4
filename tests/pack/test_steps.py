"""steps.py: interleaving, completing steps, rank assignment."""

import itertools

import numpy as np
import pytest

from dflash_prep.errors import ConfigError
from dflash_prep.pack import steps


def test_interleave_gives_every_window_its_share():
    rng = np.random.default_rng(0)
    group = rng.integers(0, 8, 4000)
    perm = steps.interleave(group, 8, seed=1, epoch=0)
    assert np.array_equal(np.sort(perm), np.arange(4000))
    share = np.bincount(group, minlength=8) / 4000
    for s in range(0, 4000 - 8, 8):
        got = np.bincount(group[perm[s:s + 8]], minlength=8)
        assert np.all(np.abs(got - 8 * share) <= 2.0), (s, got, 8 * share)


def test_interleave_is_keyed():
    group = np.repeat(np.arange(4), 50)
    a = steps.interleave(group, 4, seed=1, epoch=0)
    assert np.array_equal(a, steps.interleave(group, 4, seed=1, epoch=0))
    assert not np.array_equal(a, steps.interleave(group, 4, seed=1, epoch=1))
    assert not np.array_equal(a, steps.interleave(group, 4, seed=2, epoch=0))


def test_order_microbatches_unknown_schedule():
    with pytest.raises(ConfigError, match="schedule"):
        steps.order_microbatches("sorted", classes=np.zeros(3, np.int64), buckets=np.zeros(3, np.int64),
                                    n_buckets=1, n_classes=8, seed=0, epoch=0)


def test_complete_steps_splits_largest_and_keeps_samples():
    offsets = np.array([0, 10, 13, 14, 30, 31], np.int64)           # 5 micro-batches
    out = steps.complete_steps(offsets, 4, drop_last=False)
    assert (len(out) - 1) % 4 == 0 and out[0] == 0 and out[-1] == 31
    assert set(offsets) <= set(out) and np.all(np.diff(out) >= 1)
    assert 22 in out and 5 in out                                    # the 16- and 10-sample batches split
    assert np.array_equal(steps.complete_steps(offsets, 4, drop_last=True), offsets)


def test_complete_steps_errors():
    with pytest.raises(ConfigError, match="fewer than one step"):
        steps.complete_steps(np.array([0, 3, 6]), 8, drop_last=False)
    with pytest.raises(ConfigError, match="drop-last"):
        steps.complete_steps(np.arange(6), 4, drop_last=False)   # 5 batches of one sample each


@pytest.mark.parametrize("w,a", [(4, 1), (3, 2), (2, 3)])
def test_assign_ranks_layout_and_lpt(w, a):
    rng = np.random.default_rng(w * 10 + a)
    cost = rng.random(w * a * 5) * 100
    perm, step, rank, accum = steps.assign_ranks(cost, w, a)
    assert np.array_equal(np.sort(perm), np.arange(len(cost)))
    s = w * a
    assert np.array_equal(perm // s, np.arange(len(cost)) // s)     # micro-batches stay in their step
    assert np.all(np.bincount(step * w + rank) == a)                 # equal counts per rank per step
    for t in range(5):
        c = cost[perm[t * s:(t + 1) * s]].reshape(w, a).sum(1)
        best = min(max(sum(cost[t * s + i] for i in grp) for grp in parts)
                   for parts in _partitions(list(range(s)), w, a))
        assert c.max() <= best * 4 / 3 + 1e-9                         # Graham's LPT bound


def _partitions(items, w, a):
    if w == 1:
        yield [items]
        return
    first, rest = items[0], items[1:]
    for comb in itertools.combinations(rest, a - 1):
        left = [x for x in rest if x not in comb]
        for p in _partitions(left, w - 1, a):
            yield [[first, *comb], *p]
