"""The definitions of dflash_prep/docs/definitions.md, computed from batches, once, for every stage.

A *batching* of one epoch is two int64 arrays: ``order`` (sample ids, batch after batch)
and ``offsets`` (length ``M + 1``; batch ``m`` is ``order[offsets[m]:offsets[m+1]]``).
A *step layout* adds ``step`` and ``rank`` per micro-batch. Lengths are indexed by
sample id. All token counts and sums are int64: 100M samples x 8191 tokens overflows int32.

- efficiency      = real tokens / padded tokens, padded tokens = sum_m n_m * max_m.
- fill            = occupied tokens / (M * budget). Occupied is padded tokens in the padded
                    layout and real tokens in varlen.
- repeat-pair     = of the unordered pairs sharing a micro-batch in epoch e, the fraction
                    sharing one again in epoch e+1.
- step mix        = mean over steps of the TV distance between the step's real-token shares
                    in the 8 token-weighted octile classes and the uniform 1/8.
- cost            = per row Lmax + alpha * Lmax^2 (padded) or L + alpha * L^2 (varlen).
- rank imbalance  = mean over steps of max_rank cost / mean_rank cost - 1.

These are deliberately plain NumPy so that they stay an independent check on the numba
packers in :mod:`dflash_prep.pack.bucketing`.
"""

from __future__ import annotations

import numpy as np

N_CLASSES = 8


def alpha_for(model_dim: int | None) -> float:
    """Attention-vs-linear cost weight: ``1 / (12 * d_model)``; 0 when no model dim is given."""
    return 0.0 if not model_dim else 1.0 / (12.0 * float(model_dim))


def batch_stats(lengths: np.ndarray, order: np.ndarray, offsets: np.ndarray):
    """Per micro-batch (count, real tokens, max length), all int64."""
    lens = np.asarray(lengths, dtype=np.int64)[order]
    counts = np.diff(offsets).astype(np.int64)
    nonempty = counts > 0
    starts = offsets[:-1][nonempty]
    real = np.zeros(len(counts), np.int64)
    mx = np.zeros(len(counts), np.int64)
    if len(lens):
        real[nonempty] = np.add.reduceat(lens, starts)
        mx[nonempty] = np.maximum.reduceat(lens, starts)
    return counts, real, mx


def efficiency(lengths, order, offsets) -> float:
    counts, real, mx = batch_stats(lengths, order, offsets)
    padded = int((counts * mx).sum())
    return float(real.sum()) / padded if padded else 1.0


def fill(lengths, order, offsets, budget: float, *, varlen: bool = False, alpha: float = 0.0) -> float:
    """Occupied / (M * budget). Under a cost budget (``alpha > 0``) occupancy is counted in the
    budget's own unit, the packing cost of each micro-batch, so fill is the share of C used."""
    counts, real, mx = batch_stats(lengths, order, offsets)
    if len(counts) == 0:
        return 1.0
    if alpha:
        occupied = batch_cost(lengths, order, offsets, alpha, varlen=varlen).sum()
    else:
        occupied = real.sum() if varlen else (counts * mx).sum()
    return float(occupied) / (len(counts) * float(budget))


def efficiency_and_fill(lengths, order, offsets, budget: float, *, alpha: float = 0.0) -> tuple[float, float]:
    """:func:`efficiency` and :func:`fill` (padded layout) from one pass over the batches."""
    counts, real, mx = batch_stats(lengths, order, offsets)
    if len(counts) == 0:
        return 1.0, 1.0
    padded = int((counts * mx).sum())
    mxf = mx.astype(np.float64)
    occupied = float((counts * (mxf + alpha * mxf * mxf)).sum()) if alpha else float(padded)
    return (float(real.sum()) / padded if padded else 1.0), occupied / (len(counts) * float(budget))


def batch_cost(lengths, order, offsets, alpha: float, *, varlen: bool = False) -> np.ndarray:
    """Cost per micro-batch (float64), definitions.md's balance model."""
    counts, real, mx = batch_stats(lengths, order, offsets)
    if not varlen:
        mxf = mx.astype(np.float64)
        return counts * (mxf + alpha * mxf * mxf)
    lens = np.asarray(lengths, dtype=np.float64)[order]
    per = lens + alpha * lens * lens
    out = np.zeros(len(counts), np.float64)
    nz = counts > 0
    if len(per):
        out[nz] = np.add.reduceat(per, offsets[:-1][nz])
    return out


def batch_ids(order: np.ndarray, offsets: np.ndarray, num_samples: int) -> np.ndarray:
    """Micro-batch index of every sample id (-1 where a sample is not in this epoch)."""
    out = np.full(num_samples, -1, np.int64)
    out[order] = np.repeat(np.arange(len(offsets) - 1, dtype=np.int64), np.diff(offsets))
    return out


def repeat_pair_rate(order_a, offsets_a, order_b, offsets_b, num_samples: int) -> float:
    """Fraction of epoch-a co-batched pairs that are co-batched again in epoch b.

    Exact, O(N log N): group epoch-a samples by (batch_a, batch_b); a group of c samples
    holds c*(c-1)/2 repeated pairs.
    """
    ba = batch_ids(order_a, offsets_a, num_samples)
    bb = batch_ids(order_b, offsets_b, num_samples)
    sa = np.asarray(order_a, np.int64)
    bb_a = bb[sa]
    if (bb_a < 0).any():  # samples absent from epoch b pair with nobody there
        sa, bb_a = sa[bb_a >= 0], bb_a[bb_a >= 0]
    n_a = np.diff(offsets_a).astype(np.int64)
    pairs_a = int((n_a * (n_a - 1) // 2).sum())
    if pairs_a == 0 or len(sa) == 0:
        return 0.0
    key = np.sort(ba[sa] * np.int64(len(offsets_b)) + bb_a)
    # run lengths of equal keys: c samples share (batch_a, batch_b) -> c*(c-1)/2 repeated pairs
    ends = np.concatenate([np.flatnonzero(key[1:] != key[:-1]) + 1, [len(key)]])
    c = np.diff(ends, prepend=0).astype(np.int64)
    return float((c * (c - 1) // 2).sum()) / pairs_a


def class_edges(lengths: np.ndarray, n_classes: int = N_CLASSES) -> np.ndarray:
    """Token-weighted quantile edges: each class holds ~1/n_classes of all real tokens.

    Class ``c`` holds lengths in ``[edges[c-1], edges[c])``. Seedlike gives about
    830, 1106, 1372, 1665, 2021, 2512, 3388.
    """
    vals, cnt = np.unique(np.asarray(lengths, np.int64), return_counts=True)
    cum = np.cumsum(vals * cnt)
    total = cum[-1]
    qs = [total * q / n_classes for q in range(1, n_classes)]
    return vals[np.searchsorted(cum, qs, side="left")].astype(np.int64)


def step_mix(lengths, order, offsets, step_of_batch: np.ndarray, *, edges: np.ndarray | None = None) -> float:
    """Mean over steps of TV(real-token shares per length class, uniform)."""
    lens = np.asarray(lengths, np.int64)
    if edges is None:
        edges = class_edges(lens)
    k = len(edges) + 1
    sample_lens = lens[order]
    cls = np.searchsorted(edges, sample_lens, side="right")
    bstep = np.repeat(np.asarray(step_of_batch, np.int64), np.diff(offsets))
    keep = bstep >= 0
    if not keep.any():
        return 0.0
    n_steps = int(bstep[keep].max()) + 1
    tok = np.zeros((n_steps, k), np.float64)
    np.add.at(tok, (bstep[keep], cls[keep]), sample_lens[keep])
    tot = tok.sum(1, keepdims=True)
    used = tot[:, 0] > 0
    shares = tok[used] / tot[used]
    return float((0.5 * np.abs(shares - 1.0 / k).sum(1)).mean())


def rank_imbalance(cost_of_batch: np.ndarray, step_of_batch: np.ndarray, rank_of_batch: np.ndarray, world_size: int) -> float:
    """Mean over steps of (max rank cost / mean rank cost - 1)."""
    st = np.asarray(step_of_batch, np.int64)
    keep = st >= 0
    if not keep.any():
        return 0.0
    n_steps = int(st[keep].max()) + 1
    per = np.zeros((n_steps, world_size), np.float64)
    np.add.at(per, (st[keep], np.asarray(rank_of_batch, np.int64)[keep]), np.asarray(cost_of_batch)[keep])
    mean = per.mean(1)
    ok = mean > 0
    return float((per[ok].max(1) / mean[ok] - 1.0).mean())


def within_batch_spread(lengths, order, offsets) -> float:
    """Mean over micro-batches of (max - min) / max length: how narrow batches are."""
    lens = np.asarray(lengths, np.int64)[order]
    counts = np.diff(offsets)
    nz = counts > 0
    st = offsets[:-1][nz]
    mx = np.maximum.reduceat(lens, st).astype(np.float64)
    mn = np.minimum.reduceat(lens, st).astype(np.float64)
    return float(((mx - mn) / mx).mean()) if len(mx) else 0.0
