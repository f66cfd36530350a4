"""The packing core shared by ``analyze`` (simulation) and ``pack`` (manifests).

Padded layout, one epoch, the seed's bucketed shuffle made exact:

1. Bucket ``k`` holds lengths in ``[b_{k-1}, b_k)`` (half-open, ``b_0 = 0``).
2. Each bucket's sample ids are shuffled by :func:`dflash_prep.pack.keyed.keyed_permutation`, an RNG keyed by
   ``(seed, epoch, bucket)`` alone: SplitMix64 over a counter, Fisher-Yates. It is ours,
   so a manifest is byte-identical on any machine and any NumPy version.
3. Optionally, the shuffled bucket is cut into consecutive windows of ``S`` samples and
   each window is sorted by length, longest first (stable, so ties keep shuffled order).
4. Greedy packing walks the bucket in that order and adds each sample to the open
   micro-batch while ``n * cost(max_len) <= budget`` (and ``n <= max_batch_size``), where
   ``cost(L) = L + alpha * L^2``. ``alpha = 0`` is the token budget ``n * max_len <= T``.
   A micro-batch never spans two buckets.

The budget is one :class:`dflash_prep.formats.plan.Budget` (unit, value, alpha, max_batch_size),
passed whole from the plan to every packer here. Every count and sum is int64 (or float64
for cost budgets). All loops are numba, O(N)
apart from the window sorts (O(N log S)).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba as nb
import numpy as np

from dflash_prep.errors import ConfigError
from dflash_prep.formats.plan import Budget
from dflash_prep.pack.keyed import _shuffle_inplace, mix_key

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


def greedy_offsets(ids: np.ndarray, lengths: np.ndarray, budget: Budget) -> np.ndarray:
    """Greedy-pack ``ids`` in the given order under ``budget``; return offsets (int64, starts with 0)."""
    olens = np.asarray(lengths, np.int64)[np.asarray(ids, np.int64)]
    v, a, mbs = float(budget.value), float(budget.packing_alpha), np.int64(budget.batch_cap)
    m = _greedy_lens(olens, 0, len(olens), v, a, mbs, np.empty(0, np.int64), 0)  # count
    out = np.zeros(m + 1, np.int64)
    _greedy_lens(olens, 0, len(olens), v, a, mbs, out[1:], 0)  # write
    return out


def check_budget(lengths: np.ndarray, budget: Budget) -> None:
    """Every single sample must fit the budget on its own."""
    mx = int(np.asarray(lengths).max())
    alpha = budget.packing_alpha
    need = mx + alpha * mx * mx
    if need > budget.value:
        raise ConfigError(f"the longest sample ({mx} tokens) needs a budget of {need:.0f} {budget.unit} on its own, "
                          f"but the budget is {budget.value:.0f}; raise --budget or truncate with tokenize --max-len")


@nb.njit(cache=True)
def _group_by_bucket(lens, lut, n_buckets, packed, starts):
    # Stable counting sort by bucket (lut[L] = bucket of length L) into ``packed``, where each
    # entry is L << 32 | id: the length travels with its id through the shuffle and the
    # window sort, so no step reads lens[id] at a random place (a cache miss per sample).
    counts = np.zeros(n_buckets + 1, np.int64)
    for i in range(lens.shape[0]):
        counts[lut[lens[i]] + 1] += 1
    for k in range(n_buckets):
        counts[k + 1] += counts[k]
    starts[:] = counts
    for i in range(lens.shape[0]):
        k = lut[lens[i]]
        packed[counts[k]] = (np.int64(lens[i]) << np.int64(32)) | np.int64(i)
        counts[k] += 1


@nb.njit(cache=True)
def _sort_windows(packed, s, e, window, olens):
    # Longest first inside each window of packed[s:e]; ties keep their shuffled order. The key
    # (2^31 - L) << 32 | position is unique, so an unstable sort is exact and stable. Unpacks
    # in place: packed becomes the sample ids, olens their lengths.
    w = max(min(window, e - s), 1)
    key = np.empty(w, np.int64)
    ids = np.empty(w, np.int64)
    ln = np.empty(w, np.int64)
    low = np.int64(0xFFFFFFFF)
    for a in range(s, e, w):
        n = min(a + w, e) - a
        for t in range(n):
            ids[t] = packed[a + t] & low
            ln[t] = packed[a + t] >> np.int64(32)
        if w > 1:
            for t in range(n):
                key[t] = ((np.int64(2**31) - ln[t]) << np.int64(32)) | np.int64(t)
            ks = np.sort(key[:n])
            for t in range(n):
                j = ks[t] & low
                packed[a + t] = ids[j]
                olens[a + t] = ln[j]
        else:
            for t in range(n):
                packed[a + t] = ids[t]
                olens[a + t] = ln[t]


@nb.njit(cache=True)
def _greedy_lens(olens, s, e, budget, alpha, max_bs, out, m):
    # Greedy over contiguous lengths olens[s:e]; writes batch end positions to out (if any).
    n_open = 0
    mx = 0
    for i in range(s, e):
        L = olens[i]
        new_mx = mx if mx > L else L
        c = new_mx + alpha * new_mx * new_mx
        if n_open > 0 and ((n_open + 1) * c > budget or n_open + 1 > max_bs):
            if out.shape[0] > 0:
                out[m] = i
            m += 1
            n_open = 1
            mx = L
        else:
            n_open += 1
            mx = new_mx
    if n_open > 0:
        if out.shape[0] > 0:
            out[m] = e
        m += 1
    return m


def pack_padded(lengths: np.ndarray, boundaries, *, seed: int, epoch: int, budget: Budget, window: int = 0):
    """:func:`pack_padded_epoch` plus ``olens``, the lengths in ``order`` (int32).

    O(N) memory beyond the outputs: a counting sort groups ids by bucket, each bucket is
    shuffled and window-sorted in place, and the greedy pass runs twice over the contiguous
    ``olens`` (count, then write) so offsets take ``M + 1`` entries, not ``N + 1``.
    """
    lengths = np.asarray(lengths)
    check_budget(lengths, budget)
    alpha = budget.packing_alpha
    n = lengths.shape[0]
    if n >= 2**32 or int(lengths.max()) >= 2**24:
        raise ConfigError(f"the padded packer handles up to 2^32 samples of up to 2^24 tokens each; got {n} "
                          f"samples, the longest {int(lengths.max())}; split the dataset or truncate samples")
    n_buckets = len(boundaries) + 1
    lut = bucket_index(np.arange(int(lengths.max()) + 1), boundaries)     # bucket of every length
    order = np.empty(n, np.int64)                 # L << 32 | id until _sort_windows unpacks it
    starts = np.empty(n_buckets + 1, np.int64)
    _group_by_bucket(lengths, lut, n_buckets, order, starts)
    olens = np.empty(n, np.int32)
    mbs = np.int64(budget.batch_cap)
    none = np.empty(0, np.int64)
    per_bucket = []
    for k in range(n_buckets):
        s, e = int(starts[k]), int(starts[k + 1])
        if e > s:
            # the same swaps as shuffling the ids alone: keyed_permutation semantics are unchanged
            _shuffle_inplace(order[s:e], np.uint64(mix_key(seed, epoch, k)))
            _sort_windows(order, s, e, int(window), olens)
        per_bucket.append(_greedy_lens(olens, s, e, float(budget.value), float(alpha), mbs, none, 0) if e > s else 0)
    m = int(sum(per_bucket))
    offsets = np.empty(m + 1, np.int64)
    offsets[0] = 0
    batch_bucket = np.repeat(np.arange(n_buckets, dtype=np.int64), per_bucket)
    got = 0
    for k in range(n_buckets):
        if per_bucket[k]:
            got = _greedy_lens(olens, int(starts[k]), int(starts[k + 1]), float(budget.value), float(alpha), mbs,
                               offsets[1:], got)
    return order, offsets, batch_bucket, olens


def pack_padded_epoch(lengths: np.ndarray, boundaries, *, seed: int, epoch: int, budget: Budget, window: int = 0):
    """One epoch of the bucketed shuffle (module docstring).

    Returns ``(order, offsets, batch_bucket)``: sample ids batch after batch, batch offsets
    (int64, ``M + 1``), and the bucket of each micro-batch. Batches come bucket by bucket;
    the step schedule in :mod:`dflash_prep.pack.steps` decides their final order.
    """
    order, offsets, batch_bucket, _ = pack_padded(lengths, boundaries, seed=seed, epoch=epoch, budget=budget,
                                                  window=window)
    return order, offsets, batch_bucket


# ----------------------------------------------------------------------------- varlen
#: Key tags that keep the RNG streams of different purposes apart (buckets use 0..K-1).
PURPOSE_VARLEN = 0x7661726C656E      # "varlen"
#: Sort window pack uses when the plan sets none: repeat-pair 0.0065 < 0.01 at eff 0.990
#: on seedlike (K=6, T=65536); 4096 reaches 0.995 but repeats 0.013 of pairs.
DEFAULT_WINDOW = 2048


@nb.njit(cache=True)
def _first_fit(packed, budget, alpha, max_bs, n_open, counts, count_budget, weights, weight_budget, gen_of,
               close_rank):
    # First-fit over ``n_open`` open bins; packed[i] = L << 32 | id in arrival order. A sample
    # loads L + alpha * L^2 against ``budget`` and, when given (length > 0, indexed by id),
    # counts[id] against ``count_budget`` and weights[id] against ``weight_budget``.
    # gen_of[i] = generation (bin instance) of position i; close_rank[g] = index of
    # generation g in closing order. Returns the number of bins.
    has_c = counts.shape[0] > 0
    has_w = weights.shape[0] > 0
    a_buf = np.zeros(4096, np.float64)   # side loads of the next 4096 arrivals, gathered in a
    x_buf = np.zeros(4096, np.float64)   # tight loop (many loads in flight, no N-sized copy)
    load = np.zeros(n_open, np.float64)
    c_load = np.zeros(n_open, np.float64)
    w_load = np.zeros(n_open, np.float64)
    cnt = np.zeros(n_open, np.int64)
    gen = np.full(n_open, -1, np.int64)
    n_gen = 0
    m = 0
    for i in range(packed.shape[0]):
        if (has_c or has_w) and i % 4096 == 0:
            for q in range(min(4096, packed.shape[0] - i)):
                sid = packed[i + q] & np.int64(0xFFFFFFFF)
                if has_c:
                    a_buf[q] = counts[sid]
                if has_w:
                    x_buf[q] = weights[sid]
        L = np.float64(packed[i] >> np.int64(32))
        c = L + alpha * L * L
        a = a_buf[i % 4096]
        x = x_buf[i % 4096]
        k = -1
        for s in range(n_open):
            if (gen[s] >= 0 and load[s] + c <= budget and cnt[s] + 1 <= max_bs
                    and (not has_c or c_load[s] + a <= count_budget) and (not has_w or w_load[s] + x <= weight_budget)):
                k = s
                break
        if k < 0:
            for s in range(n_open):
                if gen[s] < 0:
                    k = s
                    break
        if k < 0:
            # no open bin fits: close the fullest (its highest fill fraction; lowest slot on
            # ties) and reuse its slot
            k = 0
            best = -1.0
            for s in range(n_open):
                f = load[s] / budget
                if has_c:
                    f = max(f, c_load[s] / count_budget)
                if has_w:
                    f = max(f, w_load[s] / weight_budget)
                if f > best:
                    best = f
                    k = s
            close_rank[gen[k]] = m
            m += 1
            gen[k] = -1
        if gen[k] < 0:
            gen[k] = n_gen
            n_gen += 1
            load[k] = 0.0
            c_load[k] = 0.0
            w_load[k] = 0.0
            cnt[k] = 0
        load[k] += c
        c_load[k] += a
        w_load[k] += x
        cnt[k] += 1
        gen_of[i] = gen[k]
    for s in range(n_open):          # the epoch's last bins close in slot order
        if gen[s] >= 0:
            close_rank[gen[s]] = m
            m += 1
    return m


@nb.njit(cache=True)
def _group_by_batch(packed, gen_of, close_rank, m, order, offsets, olens):
    # Stable counting sort of positions by batch: batch members keep their arrival order.
    counts = np.zeros(m + 1, np.int64)
    for i in range(packed.shape[0]):
        counts[close_rank[gen_of[i]] + 1] += 1
    for b in range(m):
        counts[b + 1] += counts[b]
    for b in range(m + 1):
        offsets[b] = counts[b]
    for i in range(packed.shape[0]):
        b = close_rank[gen_of[i]]
        order[counts[b]] = packed[i] & np.int64(0xFFFFFFFF)
        olens[counts[b]] = packed[i] >> np.int64(32)
        counts[b] += 1


def pack_varlen_epoch(lengths: np.ndarray, *, seed: int, epoch: int, budget: Budget, open_bins: int = 4):
    """:func:`pack_varlen` without ``olens``: ``(order, offsets)``."""
    order, offsets, _ = pack_varlen(lengths, seed=seed, epoch=epoch, budget=budget, open_bins=open_bins)
    return order, offsets


@dataclass(frozen=True)
class SideLoads:
    """What a varlen micro-batch budgets besides its tokens (the drafter objective's anchors
    and FLOPs, :mod:`dflash_prep.objectives.dflash`): per-sample arrays indexed by sample id.

    Attributes:
        counts: int32 per sample (anchors), summed against ``count_budget``.
        count_budget: the most ``counts`` one micro-batch holds.
        weights: float64 per sample (step FLOPs), summed against ``weight_budget``; None: no budget.
        weight_budget: the most ``weights`` one micro-batch holds.
    """

    counts: np.ndarray
    count_budget: float
    weights: np.ndarray | None = None
    weight_budget: float = np.inf


_NONE_I32 = np.zeros(0, np.int32)
_NONE_F64 = np.zeros(0, np.float64)


def pack_varlen(lengths: np.ndarray, *, seed: int, epoch: int, budget: Budget, open_bins: int = 4,
                side: SideLoads | None = None, purpose: int = PURPOSE_VARLEN):
    """One epoch of the varlen layout: random order, first-fit into a few open bins.

    Sequences are concatenated (``cu_seqlens``), so a micro-batch holds samples whose
    ``sum(L + alpha * L^2) <= budget`` (``alpha = 0``: ``sum(L) <= T``), at most
    ``max_batch_size`` of them, and, with ``side``, whose side loads stay within theirs. No
    bucketing: the order is a :func:`dflash_prep.pack.keyed.keyed_permutation` keyed by ``(seed, epoch, purpose)``.
    Each sample goes to the first open bin (in slot order) it fits; when none fits, the
    fullest bin (the highest fill fraction of any of its loads) is closed and its slot
    reopened. Bins are numbered in closing order; members keep their arrival order.

    One open bin is plain next-fit; each bin more raises the fill, with diminishing returns,
    and lets a short sample wait longer behind later ones (the default 4 bins' fill on
    seedlike: docs/benchmarks.md#pack, the varlen rows).

    Returns ``(order, offsets, olens)``: like :func:`pack_padded`, without buckets.
    """
    if open_bins < 1:
        raise ConfigError(f"--open-bins must be at least 1, got {open_bins}")
    lengths = np.asarray(lengths)
    check_budget(lengths, budget)
    n = lengths.shape[0]
    if n >= 2**32:
        raise ConfigError(f"the varlen packer handles up to 2^32 samples, got {n}; split the dataset")
    counts, cb, weights, wb = _NONE_I32, np.inf, _NONE_F64, np.inf
    if side is not None:
        counts, cb = np.ascontiguousarray(side.counts, np.int32), float(side.count_budget)
        if side.weights is not None:
            weights, wb = np.ascontiguousarray(side.weights, np.float64), float(side.weight_budget)
        if counts.shape[0] != n or (side.weights is not None and weights.shape[0] != n):
            raise ConfigError(f"side loads need one entry per sample ({n})")
    # L << 32 | id: the same swaps as shuffling the ids, and no later pass reads lengths at random
    ids = _length_keys(lengths)
    _shuffle_inplace(ids, np.uint64(mix_key(seed, epoch, purpose)))
    idx = np.int32 if n < 2**31 else np.int64      # bin generations < n: int32 halves the memory
    gen_of = np.empty(n, idx)
    close_rank = np.empty(n, idx)
    m = _first_fit(ids, float(budget.value), float(budget.packing_alpha), np.int64(budget.batch_cap), int(open_bins),
                   counts, cb, weights, wb, gen_of, close_rank)
    order = np.empty(n, np.int64)
    offsets = np.empty(m + 1, np.int64)
    olens = np.empty(n, np.int32)
    del lengths
    _group_by_batch(ids, gen_of, close_rank, m, order, offsets, olens)
    return order, offsets, olens


@nb.njit(cache=True)
def _length_keys_into(lengths, out):
    for i in range(lengths.shape[0]):
        out[i] = (np.int64(lengths[i]) << np.int64(32)) | np.int64(i)


def _length_keys(lengths: np.ndarray) -> np.ndarray:
    """``L << 32 | id`` per sample (int64), in one pass with no temporaries."""
    out = np.empty(lengths.shape[0], np.int64)
    _length_keys_into(lengths, out)
    return out
