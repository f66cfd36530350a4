"""Optimal bucket boundaries: a numba DP over the distinct lengths of a length histogram.

Objective. For boundaries ``b_1 < ... < b_{K-1}`` (bucket k holds ``[b_{k-1}, b_k)``), the
expected padded tokens of one epoch of :func:`dflash_prep.pack.bucketing.pack_padded_epoch`
(window 0): each bucket shuffled, then packed greedily while ``n * cost(max) <= budget``
(``cost(L) = L + alpha*L^2``; ``alpha = 0`` for a token budget). Real tokens are fixed, so
minimising padded tokens maximises padding efficiency.

Two models of one bucket's packing, both from the histogram alone (cost independent of N):

- The search's O(1) model (:func:`_mean_max`). Every sample is padded to the max of ~n
  i.i.d. draws from its bucket, ``E[max] = U - sum_t (v_{t+1} - v_t) exp(-n tail_t / N_b)``
  (tail_t: samples above v_t in the bucket), with ``n = budget / cost(E[max]) - 1/2``
  solved as a fixed point (two evaluations and a secant step). The sum is O(1):
  ``S_j(a) = sum_{t<j} g_t exp(-a (Q_j - Q_t))`` obeys ``S_{j+1}(a) = exp(-a c_{j+1})
  (S_j(a) + g_j)`` and is tabulated once on a log-linear grid of ``a = n / N_b``; a bucket
  starting at i subtracts ``exp(-a (Q_j - Q_i)) S_i(a)``. Good for narrow buckets holding
  many samples per micro-batch; it misjudges wide buckets and micro-batches of a few
  samples, so it only ranks candidates (its error, ``bench/analyze_accuracy.py``:
  docs/benchmarks.md#analyze-model-accuracy).
- The renewal chain (:func:`dflash_prep.analyze.renewal.renewal`, :meth:`Model.bucket`): greedy packing of an i.i.d.
  stream solved exactly over (samples so far, max so far) states, O(values x n_max) per
  bucket; its error against simulated ``pack_padded_epoch``:
  docs/benchmarks.md#analyze-model-accuracy. Every prediction (``plan.predicted``, the
  tables) comes from it.

Search. Candidates are all D distinct lengths (no grid). ``best[k][j] = min_i best[k-1][i-1]
+ cost(i, j)`` over buckets ``[v_i, v_j]`` under the O(1) model; each layer is solved by
divide and conquer on the monotone argmin (O(K D log D) evaluations; its time:
docs/benchmarks.md#analyze-speed). ``exhaustive=True`` runs the O(K D^2) DP; where
near-ties break monotonicity the two differ by < 1e-6 of padded tokens (tests bound it).
:meth:`Model.refine` then polishes the boundaries against the renewal chain wherever the
two models disagree by more than 0.1 pp (pattern search per boundary, down to one
distinct length; optionally from several starts, best kept). At small budgets the result
is a local optimum of the chain, not a proven global one. All counts and token sums are
int64; padded tokens are float64 (exact integers to 2^53, beyond 10^15 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba as nb
import numpy as np

from dflash_prep.analyze.renewal import polish, renewal
from dflash_prep.errors import ConfigError, InputError
from dflash_prep.pack.batch_stats import count_lengths

_E_MAX = 6           # a = n / N_b >= 2**6 leaves every term below exp(-64): S(a) == 0


@dataclass(frozen=True)
class Histogram:
    """Distinct lengths and how many samples have each.

    Attributes:
        values: strictly increasing int64 lengths (>= 1).
        counts: int64 samples per value (>= 1).
    """

    values: np.ndarray
    counts: np.ndarray

    def __post_init__(self):
        v, c = self.values, self.counts
        if v.ndim != 1 or v.shape != c.shape:
            raise InputError(f"histogram values and counts must be 1-D of equal length, got {v.shape} and {c.shape}")
        if v.shape[0] == 0:
            raise InputError("no samples; nothing to analyze (the length source is empty)")
        if v.dtype != np.int64 or c.dtype != np.int64:
            raise InputError("histogram values and counts must be int64")
        if v[0] < 1 or (v.shape[0] > 1 and np.any(np.diff(v) <= 0)):
            raise InputError("histogram values must be positive and strictly increasing")
        if np.any(c < 1):
            raise InputError("histogram counts must be positive")

    @property
    def num_samples(self) -> int:
        return int(self.counts.sum())

    @property
    def total_tokens(self) -> int:
        return int((self.values * self.counts).sum())

    @property
    def max_len(self) -> int:
        return int(self.values[-1])


def histogram(lengths: np.ndarray) -> Histogram:
    """Histogram of a lengths array in O(N) (a numba counting pass; int64 counts)."""
    lengths = np.asarray(lengths)
    if lengths.shape[0] == 0:
        raise InputError("no samples; nothing to analyze (the length source is empty)")
    lo, hi = int(lengths.min()), int(lengths.max())
    if lo < 0:
        raise InputError(f"found a negative length ({lo}); lengths count tokens")
    if hi <= 1 << 24:
        c = count_lengths(lengths, hi)
        v = np.flatnonzero(c).astype(np.int64)
        return Histogram(v, c[v])
    v, c = np.unique(lengths, return_counts=True)
    return Histogram(v.astype(np.int64), c.astype(np.int64))


@dataclass(frozen=True)
class PackModel:
    """The packing rule the model predicts (mirrors ``pack_padded_epoch``'s arguments).

    Attributes:
        budget: T in tokens, or C in cost units when ``alpha > 0``.
        alpha: the packing cost weight: a micro-batch of n samples with max L needs
            ``n * (L + alpha * L^2) <= budget``.
        max_batch_size: optional cap on samples per micro-batch (None: no cap).
    """

    budget: float
    alpha: float = 0.0
    max_batch_size: int | None = None

    def __post_init__(self):
        if not self.budget > 0:
            raise ConfigError(f"the budget must be positive, got {self.budget}")
        if self.alpha < 0:
            raise ConfigError(f"alpha must be >= 0, got {self.alpha}")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ConfigError(f"--max-batch-size must be at least 1, got {self.max_batch_size}")

    @property
    def cap(self) -> float:
        return float(self.max_batch_size) if self.max_batch_size else 1e18

    def check_fits(self, max_len: int) -> None:
        need = max_len + self.alpha * max_len * max_len
        if need > self.budget:
            unit = "cost" if self.alpha else "tokens"
            raise ConfigError(f"the longest sample ({max_len} tokens) needs a budget of {need:.0f} {unit} on its "
                              f"own, but the budget is {self.budget:.0f}; raise --budget or truncate the data "
                              "(tokenize --max-len)")


# ----------------------------------------------------------------------------- numba core
# The decay rate a = n / N_b is tabulated on a log-linear grid: SUB points per octave,
# linear in a inside each. A grid index then comes from the float's exponent and top
# mantissa bits, with no log() in the inner loop (interpolation error < 0.1% of S).
SUB_BITS = 4
SUB = 1 << SUB_BITS
_MANT_SHIFT = 52 - SUB_BITS
_FRAC_SCALE = 1.0 / float(1 << _MANT_SHIFT)


@nb.njit(cache=True)
def _tail_table(values, counts, e0, n_grid):
    # ST[g, j] = sum_{t<j} (v_{t+1} - v_t) * exp(-a_g * (Q_j - Q_t)),
    # a_g = 2**(e0 + g // SUB) * (1 + (g % SUB) / SUB).  (n_grid, D) float64: a scan over
    # bucket starts i reads one grid row contiguously.
    d = values.shape[0]
    ST = np.zeros((n_grid, d))
    for g in range(n_grid):
        a = 2.0 ** (e0 + g // SUB) * (1.0 + (g % SUB) / SUB)
        acc = 0.0
        for j in range(1, d):
            acc = np.exp(-a * float(counts[j])) * (acc + float(values[j] - values[j - 1]))
            if acc < 1e-30:
                acc = 0.0  # no denormals: they are 100x slower to interpolate
            ST[g, j] = acc
    return ST


@nb.njit(cache=True, inline="always")
def _grid_pos(a, fbuf, ibuf, e0):
    # (grid index, fraction) of a > 0 from its IEEE-754 bits
    fbuf[0] = a
    bits = ibuf[0]
    e = ((bits >> 52) & 0x7FF) - 1023
    g = (e - e0) * SUB + ((bits >> _MANT_SHIFT) & (SUB - 1))
    f = float(bits & ((1 << _MANT_SHIFT) - 1)) * _FRAC_SCALE
    return g, f


@nb.njit(cache=True, inline="always")
def _interp(ST, col, g, f):
    if g < 0:
        return ST[0, col]
    if g >= ST.shape[0] - 1:
        return ST[ST.shape[0] - 1, col]
    return ST[g, col] * (1.0 - f) + ST[g + 1, col] * f


@nb.njit(cache=True, inline="always")
def _batch_n(m, budget, alpha, cap):
    n = budget / (m + alpha * m * m) - 0.5
    if n > cap:
        n = cap
    if n < 1.0:
        n = 1.0
    return n


@nb.njit(cache=True, inline="always")
def _step(i, j, m, U, lo, nb_, tail_i, ST, fbuf, ibuf, e0, budget, alpha, cap):
    # One model evaluation: E[max] of the bucket i..j for the batch size that max m implies.
    n = _batch_n(m, budget, alpha, cap)
    if n >= nb_:
        return U  # the whole bucket is one micro-batch, padded to its top
    g, f = _grid_pos(n / nb_, fbuf, ibuf, e0)
    s = _interp(ST, j, g, f)
    e = n / nb_ * tail_i
    if e < 16.0:  # below: exp(-16) * S_i < 1e-7 * max_len, nothing
        s -= np.exp(-e) * _interp(ST, i, g, f)
    m = U - s
    return lo if m < lo else (U if m > U else m)


@nb.njit(cache=True)
def _mean_max(i, j, values, P, ST, fbuf, ibuf, e0, budget, alpha, cap):
    """E[max] of the bucket of distinct values i..j (inclusive): a pure function of (i, j).

    m = f(m) with f decreasing in m, so the root lies in [f(U), f(f(U))]; two evaluations
    and one secant step land on it (f is nearly linear there).
    """
    U = float(values[j])
    if i == j:
        return U
    lo = float(values[i])
    nb_ = float(P[j + 1] - P[i])
    tail_i = float(P[j + 1] - P[i + 1])  # samples above v_i in the bucket
    m1 = _step(i, j, U, U, lo, nb_, tail_i, ST, fbuf, ibuf, e0, budget, alpha, cap)
    if m1 >= U:
        return U
    m2 = _step(i, j, m1, U, lo, nb_, tail_i, ST, fbuf, ibuf, e0, budget, alpha, cap)
    g0 = m1 - U
    g1 = m2 - m1
    den = g1 - g0
    if den <= 0.0:
        return m2
    m = m1 - g1 * (m1 - U) / den
    lo_b = m1 if m1 < m2 else m2
    hi_b = m2 if m1 < m2 else m1
    return lo_b if m < lo_b else (hi_b if m > hi_b else m)


@nb.njit(cache=True)
def _search(values, P, ST, fbuf, ibuf, e0, budget, alpha, cap, K):
    """Layered DP, each layer by divide and conquer on the monotone argmin.

    ``best[k, j]``: least expected padded tokens for values 0..j in k buckets;
    ``arg[k, j]``: the first value index of the last bucket (ties go to the lowest index).
    Layer k solves j = mid first, scanning every i, then recurses on each half with the
    candidate range cut at the argmin: ``arg[k, j]`` is non-decreasing in j whenever the
    bucket cost has the Monge property, which ``N_b * max`` has (the wider bucket above
    pays for every sample it adds). O(K D log D) model evaluations; ``_search_exhaustive``
    is the O(K D^2) check, and the tests assert both agree.
    """
    d = values.shape[0]
    best = np.full((K + 1, d), np.inf)
    arg = np.full((K + 1, d), -1, np.int64)
    for j in range(d):
        best[1, j] = float(P[j + 1]) * _mean_max(0, j, values, P, ST, fbuf, ibuf, e0, budget, alpha, cap)
        arg[1, j] = 0
    stack = np.empty((4 * (d + 2), 4), np.int64)  # (jlo, jhi, ilo, ihi) ranges still to solve
    for k in range(2, K + 1):
        top = 0
        stack[0, 0], stack[0, 1], stack[0, 2], stack[0, 3] = k - 1, d - 1, k - 1, d - 1
        top = 1
        while top > 0:
            top -= 1
            jlo, jhi, ilo, ihi = stack[top, 0], stack[top, 1], stack[top, 2], stack[top, 3]
            if jlo > jhi:
                continue
            mid = (jlo + jhi) // 2
            hi = ihi if ihi < mid else mid
            bv = np.inf
            bi = -1
            for i in range(max(ilo, k - 1), hi + 1):
                c = float(P[mid + 1] - P[i]) * _mean_max(i, mid, values, P, ST, fbuf, ibuf, e0, budget, alpha, cap)
                v = best[k - 1, i - 1] + c
                if v < bv:
                    bv = v
                    bi = i
            best[k, mid] = bv
            arg[k, mid] = bi
            stack[top, 0], stack[top, 1], stack[top, 2], stack[top, 3] = jlo, mid - 1, ilo, bi
            top += 1
            stack[top, 0], stack[top, 1], stack[top, 2], stack[top, 3] = mid + 1, jhi, bi, ihi
            top += 1
    return best, arg


@nb.njit(cache=True)
def _search_exhaustive(values, P, ST, fbuf, ibuf, e0, budget, alpha, cap, K):
    """The same DP over every (i, j): O(K D^2) additions, O(D^2) model evaluations."""
    d = values.shape[0]
    best = np.full((K + 1, d), np.inf)
    arg = np.full((K + 1, d), -1, np.int64)
    row = np.empty(d)
    for j in range(d):
        for i in range(j + 1):
            row[i] = float(P[j + 1] - P[i]) * _mean_max(i, j, values, P, ST, fbuf, ibuf, e0, budget, alpha, cap)
        best[1, j] = row[0]
        arg[1, j] = 0
        kmax = K if K < j + 1 else j + 1
        for k in range(2, kmax + 1):
            bv = np.inf
            bi = -1
            for i in range(k - 1, j + 1):
                v = best[k - 1, i - 1] + row[i]
                if v < bv:
                    bv = v
                    bi = i
            best[k, j] = bv
            arg[k, j] = bi
    return best, arg


# ----------------------------------------------------------------------------- public API
class Model:
    """The per-bucket cost model over one histogram and packing rule (tables built once)."""

    def __init__(self, hist: Histogram, pack: PackModel):
        pack.check_fits(hist.max_len)
        self.hist, self.pack = hist, pack
        self.P = np.concatenate([[0], np.cumsum(hist.counts)]).astype(np.int64)      # (D+1,) samples
        self.R = np.concatenate([[0], np.cumsum(hist.values * hist.counts)]).astype(np.int64)  # (D+1,) tokens
        # a = n / N_b lies in [1 / N, budget]; beyond 2**6 every term is below exp(-64)
        self.e0 = int(np.floor(np.log2(0.5 / float(self.P[-1])))) - 1
        n_grid = (_E_MAX - self.e0 + 1) * SUB
        self.ST = _tail_table(hist.values, hist.counts, self.e0, n_grid)  # (n_grid, D)
        self._fbuf = np.zeros(1, np.float64)
        self._ibuf = self._fbuf.view(np.int64)
        self._buckets: dict[tuple[int, int], dict] = {}  # renewal-chain results, by (i, j)

    def _args(self):
        return (self.hist.values, self.P, self.ST, self._fbuf, self._ibuf, self.e0,
                float(self.pack.budget), float(self.pack.alpha), float(self.pack.cap))

    def dp_bucket(self, i: int, j: int) -> dict:
        """The search's O(1) model for the bucket of distinct-value indices ``i..j``."""
        v, P, ST, fb, ib, e0, T, al, cap = self._args()
        m = _mean_max(i, j, v, P, ST, fb, ib, e0, T, al, cap)
        count = int(P[j + 1] - P[i])
        return {"count": count, "mean_max": m, "padded": count * m,
                "batch_size": min(_batch_n(m, T, al, cap), float(count))}

    def dp_cost(self, i: int, j: int) -> float:
        """Expected padded tokens of the bucket ``i..j`` as the search scores it."""
        return self.dp_bucket(i, j)["padded"]

    def bucket(self, i: int, j: int) -> dict:
        """Prediction for the bucket of distinct-value indices ``i..j`` (inclusive).

        Greedy packing of the shuffled bucket, solved as a renewal chain (:mod:`.renewal`):
        exact for an i.i.d. stream, so only finite-bucket effects remain (plus half a
        micro-batch for the bucket's last, partial one). A bucket that fits in one
        micro-batch is exact: one batch padded to its top.
        """
        if (i, j) in self._buckets:
            return self._buckets[(i, j)]
        h, pk = self.hist, self.pack
        v = h.values[i:j + 1].astype(np.float64)
        c = h.counts[i:j + 1].astype(np.float64)
        count = int(self.P[j + 1] - self.P[i])
        top = float(v[-1])
        top_cost = top + pk.alpha * top * top
        if count * top_cost <= pk.budget and count <= pk.cap:
            m, n, mb, occ = top, float(count), 1.0, count * top_cost
        else:
            e_nm, e_n, e_nc = renewal(v, c, float(pk.budget), float(pk.alpha), float(pk.cap), 60, 1e-8)
            m, n = e_nm / e_n, e_n
            mb = count / e_n + 0.5
            occ = count * e_nc / e_n
        out = {"lo": int(v[0]), "hi": int(top) + 1, "count": count, "tokens": int(self.R[j + 1] - self.R[i]),
               "mean_max": m, "padded": count * m, "batch_size": n, "microbatches": mb, "occupied": occ}
        self._buckets[(i, j)] = out
        return out

    def index_ranges(self, boundaries) -> list[tuple[int, int]]:
        """Distinct-value index range of every non-empty bucket for ``boundaries``."""
        v = self.hist.values
        cuts = np.searchsorted(v, np.asarray(boundaries, np.int64), side="left")
        edges = np.unique(np.concatenate([[0], cuts, [len(v)]]))
        return [(int(a), int(b) - 1) for a, b in zip(edges[:-1], edges[1:]) if b > a]

    def predict(self, boundaries) -> dict:
        """Predicted efficiency, fill and micro-batches of one epoch for ``boundaries`` (window 0).

        Uses the renewal chain per bucket (:meth:`bucket`), not the search's O(1) model.
        """
        buckets = [self.bucket(i, j) for i, j in self.index_ranges(boundaries)]
        padded = sum(b["padded"] for b in buckets)
        mb = sum(b["microbatches"] for b in buckets)
        occupied = sum(b["occupied"] for b in buckets)
        return {"efficiency": self.hist.total_tokens / padded, "fill": occupied / (mb * self.pack.budget),
                "microbatches": mb, "padded_tokens": padded, "buckets": buckets}

    def disagreement(self, boundaries) -> float:
        """|efficiency under the search's O(1) model - efficiency under the renewal chain|."""
        ranges = self.index_ranges(boundaries)
        total = self.hist.total_tokens
        fast = sum(self.dp_cost(i, j) for i, j in ranges)
        return abs(total / fast - total / self.predict(boundaries)["padded_tokens"])

    def refine(self, boundaries, *, tol: float = 1e-3, starts=(), max_sweeps: int = 4) -> tuple[int, ...]:
        """Polish searched boundaries against the renewal chain where the O(1) model is off.

        The search's model is within ~0.1 pp for narrow buckets holding many samples per
        micro-batch but misjudges wide buckets and small budgets. When its efficiency for
        ``boundaries`` differs from :meth:`predict`'s by more than ``tol``, each boundary is
        moved by pattern search (steps halving to one distinct length) to the position with
        the least predicted padded tokens of its two buckets, sweeping until nothing moves.
        The same polish is run from every boundary set in ``starts`` with as many cuts, and
        the best result by the chain wins. Returns ``boundaries`` unchanged when the two
        models agree.
        """
        if len(boundaries) == 0 or self.disagreement(boundaries) <= tol:
            return tuple(int(b) for b in boundaries)
        best, best_pad = None, np.inf
        for cand in (boundaries, *(s for s in starts if len(s) == len(boundaries))):
            got = self._polish(cand, max_sweeps)
            pad = self.predict(got)["padded_tokens"]
            if pad < best_pad * (1 - 1e-12):
                best, best_pad = got, pad
        return best

    def _polish(self, boundaries, max_sweeps: int) -> tuple[int, ...]:
        ranges = self.index_ranges(boundaries)
        if len(ranges) < 2:
            return tuple(int(b) for b in boundaries)
        starts = polish([i for i, _ in ranges] + [len(self.hist.values)],
                        lambda i, j: self.bucket(i, j)["padded"], max_sweeps)
        return tuple(int(self.hist.values[i]) for i in starts[1:-1])

    def search(self, K: int, *, exhaustive: bool = False) -> "SearchResult":
        """Optimal boundaries for every k = 1..K (K is capped at the number of distinct lengths).

        ``exhaustive`` runs the O(K D^2) DP instead of divide and conquer (same answer when
        the argmin is monotone; the tests and ``bench/analyze_speed.py`` check that it is).
        """
        if K < 1:
            raise ConfigError(f"--buckets must be at least 1, got {K}")
        k_eff = min(int(K), len(self.hist.values))
        fn = _search_exhaustive if exhaustive else _search
        best, arg = fn(*self._args(), k_eff)
        v = self.hist.values
        d = len(v)
        per_k = []
        for k in range(1, k_eff + 1):
            bounds, j = [], d - 1
            for kk in range(k, 0, -1):
                i = int(arg[kk, j])
                if kk > 1:
                    bounds.append(int(v[i]))
                j = i - 1
            per_k.append(tuple(reversed(bounds)))
        return SearchResult(requested=int(K), boundaries=tuple(per_k),
                            padded=tuple(float(best[k, d - 1]) for k in range(1, k_eff + 1)),
                            total_tokens=self.hist.total_tokens)


@dataclass(frozen=True)
class SearchResult:
    """Optimal boundaries for k = 1..len(boundaries) and their padded tokens under the search's model.

    ``len(boundaries)`` is ``min(requested, distinct lengths)``. :meth:`efficiency` is the
    search's O(1)-model figure; :meth:`Model.predict` gives the renewal-chain prediction.
    """

    requested: int
    boundaries: tuple[tuple[int, ...], ...]   # boundaries[k-1]: k-1 cuts for k buckets
    padded: tuple[float, ...]
    total_tokens: int

    def efficiency(self, k: int) -> float:
        return self.total_tokens / self.padded[k - 1]
