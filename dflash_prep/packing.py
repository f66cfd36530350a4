"""The packing core shared by ``analyze`` (simulation) and ``pack`` (manifests).

Padded layout, one epoch, the seed's bucketed shuffle made exact:

1. Bucket ``k`` holds lengths in ``[b_{k-1}, b_k)`` (half-open, ``b_0 = 0``).
2. Each bucket's sample ids are shuffled by :func:`keyed_permutation`, an RNG keyed by
   ``(seed, epoch, bucket)`` alone: SplitMix64 over a counter, Fisher-Yates. It is ours,
   so a manifest is byte-identical on any machine and any NumPy version.
3. Optionally, the shuffled bucket is cut into consecutive windows of ``S`` samples and
   each window is sorted by length, longest first (stable, so ties keep shuffled order).
4. Greedy packing walks the bucket in that order and adds each sample to the open
   micro-batch while ``n * cost(max_len) <= budget`` (and ``n <= max_batch_size``), where
   ``cost(L) = L + alpha * L^2``. ``alpha = 0`` is the token budget ``n * max_len <= T``.
   A micro-batch never spans two buckets.

Every count and sum is int64 (or float64 for cost budgets). All loops are numba, O(N)
apart from the window sorts (O(N log S)).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from .errors import ConfigError

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


def bucket_index(lengths: np.ndarray, boundaries) -> np.ndarray:
    """Bucket of every sample: ``searchsorted(boundaries, L, 'right')`` (half-open buckets)."""
    b = np.asarray(boundaries, dtype=np.int64)
    return np.searchsorted(b, np.asarray(lengths, dtype=np.int64), side="right").astype(np.int64)


@nb.njit(cache=True)
def _window_sort(ids, lens, window):
    n = ids.shape[0]
    out = np.empty_like(ids)
    for s in range(0, n, window):
        e = min(s + window, n)
        chunk = ids[s:e]
        # longest first; mergesort is stable, so equal lengths keep their shuffled order
        key = -lens[chunk]
        idx = np.argsort(key, kind="mergesort")
        for t in range(e - s):
            out[s + t] = chunk[idx[t]]
    return out


def window_sort(ids: np.ndarray, lengths: np.ndarray, window: int) -> np.ndarray:
    """Sort each consecutive window of ``window`` ids by length, longest first."""
    if window <= 1 or ids.shape[0] <= 1:
        return np.asarray(ids, np.int64)
    return _window_sort(np.asarray(ids, np.int64), np.asarray(lengths, np.int64), int(window))


@nb.njit(cache=True)
def _greedy(ids, lens, budget, alpha, max_bs, out_offsets, base):
    # Appends batch end positions (offset by ``base``) to out_offsets; returns count written.
    m = 0
    n_open = 0
    mx = 0
    for i in range(ids.shape[0]):
        L = lens[ids[i]]
        new_mx = mx if mx > L else L
        c = new_mx + alpha * new_mx * new_mx
        if n_open > 0 and ((n_open + 1) * c > budget or n_open + 1 > max_bs):
            out_offsets[m] = base + i
            m += 1
            n_open = 1
            mx = L
        else:
            n_open += 1
            mx = new_mx
    if n_open > 0:
        out_offsets[m] = base + ids.shape[0]
        m += 1
    return m


def greedy_offsets(ids: np.ndarray, lengths: np.ndarray, budget: float, *, alpha: float = 0.0,
                   max_batch_size: int | None = None) -> np.ndarray:
    """Greedy-pack ``ids`` in the given order; return offsets (int64, starts with 0)."""
    ids = np.asarray(ids, np.int64)
    out = np.empty(ids.shape[0] + 1, np.int64)
    out[0] = 0
    mbs = np.int64(max_batch_size) if max_batch_size else np.int64(2**62)
    m = _greedy(ids, np.asarray(lengths, np.int64), float(budget), float(alpha), mbs, out[1:], 0)
    return out[: m + 1].copy()


def check_budget(lengths: np.ndarray, budget: float, alpha: float) -> None:
    """Every single sample must fit the budget on its own."""
    mx = int(np.asarray(lengths).max())
    need = mx + alpha * mx * mx
    if need > budget:
        unit = "cost" if alpha else "tokens"
        raise ConfigError(f"the longest sample ({mx} tokens) needs a budget of {need:.0f} {unit} on its own, "
                          f"but the budget is {budget:.0f}; raise --budget or truncate with tokenize --max-len")


def pack_padded_epoch(lengths: np.ndarray, boundaries, *, seed: int, epoch: int, budget: float,
                      alpha: float = 0.0, max_batch_size: int | None = None, window: int = 0):
    """One epoch of the bucketed shuffle (module docstring).

    Returns ``(order, offsets, batch_bucket)``: sample ids batch after batch, batch offsets
    (int64, ``M + 1``), and the bucket of each micro-batch. Batches come bucket by bucket;
    the step schedule in :mod:`dflash_prep.schedule` decides their final order.
    """
    lengths = np.asarray(lengths)
    check_budget(lengths, budget, alpha)
    lens64 = lengths.astype(np.int64, copy=False)
    bk = bucket_index(lens64, boundaries)
    n_buckets = len(boundaries) + 1
    by_bucket = np.argsort(bk, kind="stable")
    counts = np.bincount(bk, minlength=n_buckets)
    starts = np.concatenate([[0], np.cumsum(counts)])
    order = np.empty(lengths.shape[0], np.int64)
    offsets = np.empty(lengths.shape[0] + 1, np.int64)
    offsets[0] = 0
    batch_bucket = np.empty(lengths.shape[0], np.int64)
    mbs = np.int64(max_batch_size) if max_batch_size else np.int64(2**62)
    m = 0
    for k in range(n_buckets):
        s, e = int(starts[k]), int(starts[k + 1])
        if e == s:
            continue
        ids = shuffle_keyed(by_bucket[s:e], seed, epoch, k)
        if window and window > 1:
            ids = window_sort(ids, lens64, window)
        order[s:e] = ids
        got = _greedy(ids, lens64, float(budget), float(alpha), mbs, offsets[1 + m:], s)
        batch_bucket[m:m + got] = k
        m += got
    return order, offsets[: m + 1].copy(), batch_bucket[:m].copy()
