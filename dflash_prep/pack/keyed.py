"""The keyed RNG behind every shuffle of pack: a pure function of its keys, never global state.

:func:`mix_key` folds integers (seed, epoch, a purpose tag, a bucket or sample id) into one
64-bit key with SplitMix64; the generator is SplitMix64 over a counter started at that key
(:func:`_splitmix`, numba), and a shuffle is Fisher-Yates on it (:func:`_shuffle_inplace`).
It is ours, so a manifest is byte-identical on any machine and any NumPy version. Each
consumer keys its own stream with a purpose tag (buckets, varlen order, schedules, anchors).
"""

from __future__ import annotations

import numba as nb
import numpy as np

_MASK64 = (1 << 64) - 1


def mix_key(*parts: int) -> int:
    """Fold integers into one 64-bit key with SplitMix64 (pure Python, for keys only)."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (int(p) & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        z = h
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        h = z ^ (z >> 31)
    return h


@nb.njit(cache=True, inline="always")
def _splitmix(state: np.uint64):
    state = state + np.uint64(0x9E3779B97F4A7C15)
    z = state
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return state, z ^ (z >> np.uint64(31))


@nb.njit(cache=True)
def _shuffle_inplace(a, key):
    # Fisher-Yates. r % (i + 1) has a bias below n / 2**64 (< 1e-10 at n = 1e9): negligible.
    state = np.uint64(key)
    for i in range(a.shape[0] - 1, 0, -1):
        state, r = _splitmix(state)
        j = np.int64(r % np.uint64(i + 1))
        t = a[i]
        a[i] = a[j]
        a[j] = t


def keyed_permutation(n: int, seed: int, epoch: int, bucket: int) -> np.ndarray:
    """A permutation of ``range(n)`` that depends only on ``(n, seed, epoch, bucket)``."""
    a = np.arange(n, dtype=np.int64)
    _shuffle_inplace(a, np.uint64(mix_key(seed, epoch, bucket)))
    return a


def shuffle_keyed(ids: np.ndarray, seed: int, epoch: int, bucket: int) -> np.ndarray:
    """Shuffle a copy of ``ids`` with the RNG keyed by ``(seed, epoch, bucket)``."""
    out = np.array(ids, dtype=np.int64, copy=True)
    _shuffle_inplace(out, np.uint64(mix_key(seed, epoch, bucket)))
    return out
