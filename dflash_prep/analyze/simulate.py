"""Simulated epochs whose cost does not grow with N: a fixed-size subsample, rescaled.

``analyze`` needs, for many (boundaries, window) pairs, what ``pack`` would realize:
efficiency, fill, micro-batches, within-batch spread and the repeat-pair rate between two
epochs. Packing all N samples for each pair is O(N) per row (430 s at 100M samples); here
every row packs the same subsample of at most ``SUBSAMPLE`` (2^19) samples instead.

The subsample is systematic over the length histogram, so it is deterministic and keeps
every bucket's length distribution to within one sample per distinct length: distinct
value v gets ``floor(C_v S / N) - floor(C_{v-1} S / N)`` copies (``C``: cumulative counts).
It is packed by :func:`dflash_prep.pack.bucketing.pack_padded` itself (same keyed shuffle,
sort windows and greedy rule), for ``epochs`` epochs.

What carries over unchanged: efficiency, fill and spread depend on the window (an absolute
number of samples) and on each bucket's length distribution, not on the bucket's size,
except through its last partial micro-batch (< 0.01 pp at 2^19 samples).

What is rescaled: the repeat-pair rate of bucket b. Two samples co-batched in epoch e can
meet again in epoch e+1 only if the shuffle puts them in the same sort window, which for a
bucket of n samples cut into windows of w happens with probability

    P(w, n) = (floor(n / w) w (w - 1) + r (r - 1)) / (n (n - 1)),   r = n mod w,

and given that, the chance that the window's sort and the greedy pass put them in one
micro-batch again, Q(w), depends only on w and the length distribution. So the subsample's
per-bucket rate ``rp_s = P(w, S_b) Q(w)`` gives ``rp_b = P(w_b, N_b) Q(w_b)`` with

- ``w <= S_b / 8``: ``Q(w_b) = Q(w)``, measured;
- larger windows: Q is measured at the calibration window ``w_c`` (a power of two
  <= S_b / 8; a subsampled bucket that is one or two windows starts its micro-batches at
  the same place every epoch and overstates Q) and carried to ``w_b = min(w, N_b)`` by the
  ratio ``Q_model(w_b) / Q_model(w_c)`` of a large-window model (:func:`_q_model`): the
  sorted window as tie groups of ``w p_v`` samples per length, micro-batches cut every
  ``T // cost(v)`` positions at a random phase. (Model alone vs full pack, seedlike,
  400K: Q within 0.035 from w = 256 to the whole bucket.) Its limit explains why large
  windows stay fresh at scale: a co-batched pair is then two samples of one length whose
  tie order was reshuffled, met again with probability (batch size) / N_v;
- window 0 (no sort): ``rp_b = rp_s (S_b - 1) / (N_b - 1)``: co-batched by chance alone.

The epoch rate is the pair-weighted mean over buckets (co-batched pairs scale with
``N_b / S_b``). With ``N <= SUBSAMPLE`` nothing is rescaled: the rows are exact
simulations of ``pack``. ``bench/analyze_accuracy.py`` compares all of this with full
``pack`` runs at 1M, 10M and 100M samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numba as nb
import numpy as np

from dflash_prep.analyze.optimize import Histogram
from dflash_prep.errors import ConfigError
from dflash_prep.formats.plan import Budget
from dflash_prep.pack.bucketing import pack_padded

SUBSAMPLE = 1 << 19   # samples every simulated row packs (at most)


def subsample_counts(hist: Histogram, size: int = SUBSAMPLE) -> np.ndarray:
    """Per distinct length, how many copies the systematic subsample keeps (int64, sums to min(N, size))."""
    n = hist.num_samples
    if n <= size:
        return hist.counts.copy()
    cum = np.cumsum(hist.counts)
    # floor(C * S / N) in exact integer arithmetic (C * S < 2^63 for N, S < 2^31)
    kept = (cum * np.int64(size)) // np.int64(n)
    return np.diff(kept, prepend=0).astype(np.int64)


@dataclass(frozen=True)
class Subsample:
    """The lengths every simulated row packs, and the bucket sizes of the full data."""

    hist: Histogram            # the full data's histogram
    lengths: np.ndarray        # (S,) int32, grouped by length (each bucket is shuffled anyway)

    @classmethod
    def of(cls, hist: Histogram, size: int = SUBSAMPLE) -> "Subsample":
        if size < 2:
            raise ConfigError(f"the simulation subsample needs at least 2 samples, got {size}")
        return cls(hist, np.repeat(hist.values, subsample_counts(hist, size)).astype(np.int32))

    @property
    def exact(self) -> bool:
        """True when the subsample is the whole data (nothing is rescaled)."""
        return len(self.lengths) == self.hist.num_samples

    def bucket_sizes(self, boundaries) -> tuple[np.ndarray, np.ndarray]:
        """(N_b full, S_b subsample) per bucket, int64."""
        cuts = np.asarray(boundaries, np.int64)
        full = np.bincount(np.searchsorted(cuts, self.hist.values, side="right"), weights=self.hist.counts,
                           minlength=len(cuts) + 1).astype(np.int64)
        sub = np.bincount(np.searchsorted(cuts, self.lengths, side="right"), minlength=len(cuts) + 1)
        return full, sub.astype(np.int64)


@dataclass
class Simulated:
    """Means over the simulated epochs, scaled to the full data."""

    efficiency: float
    fill: float
    microbatches: float
    repeat_pair: float
    spread: float
    per_bucket_microbatches: list = field(default_factory=list)
    how: str = ""


# ----------------------------------------------------------------------------- numba passes
@nb.njit(cache=True)
def _epoch_stats(olens, offsets, bucket, alpha, n_buckets, per_bucket_mb):
    # One sequential pass: real, padded, occupied (budget unit) tokens and sum of spreads.
    real = np.int64(0)
    padded = np.int64(0)
    occ = 0.0
    spread = 0.0
    for b in range(offsets.shape[0] - 1):
        mx = np.int64(0)
        mn = np.int64(2**62)
        for i in range(offsets[b], offsets[b + 1]):
            L = np.int64(olens[i])
            real += L
            if L > mx:
                mx = L
            if L < mn:
                mn = L
        n = offsets[b + 1] - offsets[b]
        padded += n * mx
        occ += n * (mx + alpha * mx * mx)
        spread += (mx - mn) / mx
        per_bucket_mb[bucket[b]] += 1
    return real, padded, occ, spread


@nb.njit(cache=True)
def _bucket_repeat_pairs(order_a, offsets_a, bucket_a, order_b, offsets_b, n_samples, n_buckets):
    # Per bucket: pairs co-batched in epoch a, and how many of them share a batch in epoch b.
    batch_of = np.empty(n_samples, np.int64)
    for m in range(offsets_b.shape[0] - 1):
        for i in range(offsets_b[m], offsets_b[m + 1]):
            batch_of[order_b[i]] = m
    pairs = np.zeros(n_buckets, np.int64)
    again = np.zeros(n_buckets, np.int64)
    widest = 0
    for m in range(offsets_a.shape[0] - 1):
        widest = max(widest, offsets_a[m + 1] - offsets_a[m])
    buf = np.empty(widest, np.int64)
    for m in range(offsets_a.shape[0] - 1):
        n = offsets_a[m + 1] - offsets_a[m]
        k = bucket_a[m]
        pairs[k] += n * (n - 1) // 2
        cur = buf[:n]
        for t in range(n):
            cur[t] = batch_of[order_a[offsets_a[m] + t]]
        cur.sort()
        run = 1
        for t in range(1, n + 1):
            if t < n and cur[t] == cur[t - 1]:
                run += 1
            else:
                again[k] += run * (run - 1) // 2
                run = 1
    return pairs, again


# ----------------------------------------------------------------------------- rescaling
def same_window_probability(w: int, n: int) -> float:
    """P(two distinct samples of a shuffled n-sample bucket fall in one window of w)."""
    if n < 2:
        return 1.0
    w = min(int(w), int(n))
    q, r = divmod(int(n), w)
    return (q * w * (w - 1) + r * (r - 1)) / (n * (n - 1))


@nb.njit(cache=True, inline="always")
def _f2(s, n):
    # F2(s) = (n - s)_+^3 / (6 n): d^2 F2 / ds^2 = max(0, 1 - s / n)
    return (n - s) ** 3 / (6.0 * n) if s < n else 0.0


@nb.njit(cache=True)
def _q_model(values, counts, window, budget, alpha, cap):
    # Q(w) of one bucket in the large-window model: the sorted window is the bucket's tie groups,
    # longest first, group v holding m_v = w p_v samples in random order; micro-batches are cut
    # every n_v = budget // cost(v) positions at a uniformly random phase, so two samples d apart
    # share one with probability (1 - d / n)_+. c(a, b) is that probability for a sample of
    # group a and one of group b (uniform positions inside their groups); Q = sum c^2 / sum c
    # over pairs, weighted by how many pairs of the bucket have those lengths.
    d = values.shape[0]
    tot = counts.sum()
    s1 = 0.0
    s2 = 0.0
    for i in range(d - 1, -1, -1):
        v = float(values[i])
        n = float(budget // (v + alpha * v * v))
        if n > cap:
            n = cap
        ma = window * counts[i] / tot
        # same group: |X - Y| of two uniform positions in [0, ma]
        u = ma if ma < n else n
        if ma > 0:
            c = 2.0 / (ma * ma) * (ma * u - u * u / 2 - ma * u * u / (2 * n) + u ** 3 / (3 * n))
        else:
            c = 1.0
        wgt = counts[i] * (counts[i] - 1) / 2.0
        s1 += wgt * c
        s2 += wgt * c * c
        g = 0.0
        for j in range(i - 1, -1, -1):
            if g >= n:
                break
            mb = window * counts[j] / tot
            # d = g + X + Y, X ~ U[0, ma], Y ~ U[0, mb]: a mixed second difference of F2
            c = (_f2(g + ma + mb, n) - _f2(g + ma, n) - _f2(g + mb, n) + _f2(g, n)) / (ma * mb)
            wgt = float(counts[i]) * float(counts[j])
            s1 += wgt * c
            s2 += wgt * c * c
            g += mb
    return s2 / s1 if s1 > 0 else 0.0


CAL_FRACTION = 8   # a window measures Q only while the subsample's bucket holds >= 8 of it


def calibration_window(window: int, n_sub: int) -> int:
    """The window at which a bucket of ``n_sub`` subsampled samples measures Q for ``window``.

    A window must leave the subsampled bucket several windows (CAL_FRACTION): a bucket that
    is one sorted window starts its micro-batches at the same place every epoch, so the
    same neighbours meet far more often than in a bucket of many windows (phase locking).
    """
    cap = max(2, n_sub // CAL_FRACTION)
    return window if window <= cap else 1 << (cap.bit_length() - 1)


def rescale_repeat(rate_sub: float, window: int, n_full: int, n_sub: int, q_model=None, w_meas: int | None = None
                   ) -> float:
    """A bucket's repeat-pair rate at ``n_full`` samples from the subsample's (module docstring).

    ``rate_sub`` was measured at window ``w_meas`` (default ``window``); when that is smaller
    than ``window``, ``q_model(w)``, the large-window model's Q, carries the measured
    ``Q(w_meas)`` to ``min(window, n_full)`` by its ratio.
    """
    if n_full <= n_sub or n_sub < 2:
        return rate_sub
    if window <= 1:
        return rate_sub * (n_sub - 1) / (n_full - 1)
    w_meas = window if w_meas is None else w_meas
    q = rate_sub / same_window_probability(w_meas, n_sub)          # Q(w_meas), measured
    w_full = min(window, n_full)
    if w_full != w_meas and q_model is not None:
        base = q_model(w_meas)
        q = q * q_model(w_full) / base if base > 0 else q
    return min(1.0, q * same_window_probability(w_full, n_full))


def _pack_epochs(sub, boundaries, window, *, budget: Budget, seed, epochs, cache):
    """Pack the subsample ``epochs`` times: (per-epoch efficiency, fill, spread, micro-batches per
    bucket summed over epochs, pairs and repeated pairs per bucket between epochs 0 and 1)."""
    # a window holding every subsampled bucket whole sorts each of them: the same packing
    window = min(int(window), max(int(sub.bucket_sizes(boundaries)[1].max()), 1))
    key = (tuple(int(b) for b in boundaries), window, epochs)
    if cache is not None and key in cache:
        return cache[key]
    n_b = len(boundaries) + 1
    effs, fills, sps = [], [], []
    mb = np.zeros(n_b, np.int64)
    prev = pairs = again = None
    for ep in range(epochs):
        order, offsets, bucket, olens = pack_padded(sub.lengths, boundaries, seed=seed, epoch=ep, budget=budget,
                                                    window=window)
        alpha = budget.packing_alpha
        real, padded, occ, spread = _epoch_stats(olens, offsets, bucket, float(alpha), n_b, mb)
        m = len(offsets) - 1
        effs.append(real / padded)
        fills.append((occ if alpha else padded) / (m * float(budget.value)))
        sps.append(spread / m)
        if ep == 1:
            pairs, again = _bucket_repeat_pairs(prev[0], prev[1], prev[2], order, offsets, len(sub.lengths), n_b)
        prev = (order, offsets, bucket)
        del olens
    out = (effs, fills, sps, mb, pairs, again)
    if cache is not None:
        cache[key] = out
    return out


def simulate(sub: Subsample, boundaries, *, budget: Budget, window: int = 0, seed: int = 0, epochs: int = 2,
             cache: dict | None = None) -> Simulated:
    """Pack the subsample for ``epochs`` epochs (>= 2) and scale the means to the full data.

    Efficiency, fill and spread are means over the epochs; the repeat-pair rate compares
    epochs 0 and 1, per bucket, rescaled as the module docstring derives. Where ``window``
    is too large for a subsampled bucket (:func:`calibration_window`), its Q is measured by
    a second packing at the calibration window and carried over by the model. ``cache``
    (a dict) memoises packings across calls.
    """
    if epochs < 2:
        raise ConfigError(f"--sim-epochs must be at least 2 (the repeat-pair rate compares two), got {epochs}")
    n_b = len(boundaries) + 1
    full, part = sub.bucket_sizes(boundaries)
    kw = dict(budget=budget, seed=seed, epochs=epochs, cache=cache)
    effs, fills, sps, mb, pairs, again = _pack_epochs(sub, boundaries, window, **kw)
    scaled = (full > part) & (part >= 2)
    w_cal = min([calibration_window(window, int(part[k])) for k in range(n_b) if scaled[k]] or [window])
    if window > 1 and w_cal < window:
        _, _, _, _, pairs_c, again_c = _pack_epochs(sub, boundaries, w_cal, **kw)
    else:
        w_cal, pairs_c, again_c = window, pairs, again
    scale = np.divide(full, part, out=np.zeros(n_b), where=part > 0)
    hv, hc = sub.hist.values, sub.hist.counts
    edges = np.searchsorted(hv, np.asarray([0, *boundaries, int(hv[-1]) + 1], np.int64), side="left")
    cap = float(budget.max_batch_size) if budget.max_batch_size else 1e18

    def q_model(k):
        vals, cnts = hv[edges[k]:edges[k + 1]], hc[edges[k]:edges[k + 1]].astype(np.float64)
        return lambda w: _q_model(vals, cnts, float(w), float(budget.value), float(budget.packing_alpha), cap)

    rates = []
    for k in range(n_b):
        direct = not scaled[k] or window <= 1 or calibration_window(window, int(part[k])) == window
        p, a, wm = (pairs[k], again[k], window) if direct else (pairs_c[k], again_c[k], w_cal)
        rates.append(rescale_repeat(a / p if p else 0.0, window, int(full[k]), int(part[k]), q_model(k), wm))
    w_pairs = pairs * scale
    rp = float(np.dot(w_pairs, rates) / w_pairs.sum()) if w_pairs.sum() else 0.0
    # the last partial micro-batch of a bucket does not scale with it
    mb_mean = mb / epochs
    per_bucket = np.where(part > 0, (mb_mean - 0.5) * scale + 0.5, 0.0)
    how = f"{epochs} sim epochs" + ("" if sub.exact else f" of a {len(sub.lengths):,}-sample subsample, rescaled")
    return Simulated(float(np.mean(effs)), float(np.mean(fills)), float(per_bucket.sum()), rp, float(np.mean(sps)),
                     per_bucket.tolist(), how)


@nb.njit(cache=True)
def _sorted_greedy(values, counts, budget, alpha, cap):
    # Greedy over the globally sorted (ascending) stream, one distinct length at a time:
    # a batch whose newest (= longest) sample has length v holds at most nv = budget // cost(v).
    n_open = np.int64(0)
    mx = 0.0
    mn = 0.0
    m = np.int64(0)
    padded = 0.0
    occ = 0.0
    spread = 0.0
    for t in range(values.shape[0]):
        v = float(values[t])
        cv = v + alpha * v * v
        nv = np.int64(budget // cv)
        if nv > cap:
            nv = cap
        c = counts[t]
        while c > 0:
            if n_open == 0:
                mn = v
            room = nv - n_open
            if room <= 0:       # v does not fit beside the open batch: close it (its max is mx)
                m += 1
                padded += n_open * mx
                occ += n_open * (mx + alpha * mx * mx)
                spread += (mx - mn) / mx
                n_open = 0
                continue
            take = room if room < c else c
            n_open += take
            mx = v
            c -= take
            if c > 0:
                m += 1
                padded += n_open * mx
                occ += n_open * (mx + alpha * mx * mx)
                spread += (mx - mn) / mx
                n_open = 0
    if n_open > 0:
        m += 1
        padded += n_open * mx
        occ += n_open * (mx + alpha * mx * mx)
        spread += (mx - mn) / mx
    return m, padded, occ, spread


def sorted_static(hist: Histogram, *, budget: Budget) -> dict:
    """Global sort by length, fixed greedy batches, from the histogram in O(distinct + batches).

    Exactly ``greedy_offsets(argsort(lengths))``'s efficiency, fill, micro-batches and spread,
    without sorting N samples (the tests compare both).
    """
    cap, alpha = np.int64(budget.batch_cap), budget.packing_alpha
    m, padded, occ, spread = _sorted_greedy(hist.values, hist.counts, float(budget.value), float(alpha), cap)
    return {"efficiency": hist.total_tokens / padded, "fill": (occ if alpha else padded) / (m * float(budget.value)),
            "microbatches": float(m), "spread": spread / m}
