"""The default plan: K and the sort window chosen together under a repeat-pair limit.

Efficiency rises with the local sort window (micro-batches become narrow in length) and
with K (narrower buckets); so does the repeat-pair rate, because a window that covers much
of a bucket puts the same neighbours together every epoch. The rule:

    among the simulated (K, window) pairs whose repeat-pair rate is <= max_repeat_pair
    (default 0.05: at least 95% of co-batched pairs are new each epoch), take the highest
    efficiency E*. Pairs within TIE = 0.5 pp of E* count as equal (0.5 pp is what a
    prediction is guaranteed to, against what pack realizes), and among those the lowest
    repeat-pair rate wins (then the smaller K, then the smaller window).

So the plan sits at the knee of the trade-off: near-sorted efficiency without spending
the repeat-pair budget on the last 0.1 pp. The plans it picks at 1M, 10M and 100M samples:
docs/benchmarks.md#analyze-predictions-at-1m-10m-and-100m-samples; a worked example:
docs/planning.md#worked-example-seedlike.

Windows are 0 and powers of two from 64 up to the first that covers the largest bucket
(:func:`window_grid`), so the grid grows with N. For each K both efficiency and the
repeat-pair rate grow with the window: the largest window within the limit is found by
bisection over the grid (for the first K; the next K gallops from its answer), then the
smallest window whose efficiency is within TIE of E* by bisection below it (about six
simulations per K). The chosen K then gets its full window table,
up to and including the first window past the limit. Every figure is a
:func:`dflash_prep.analyze.simulate.simulate` row (subsample, rescaled), so the cost is
independent of N.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash_prep.analyze.simulate import Simulated, Subsample, simulate
from dflash_prep.errors import ConfigError
from dflash_prep.formats.plan import Budget
from dflash_prep.pack import pack

JOINT_KS = (1, 2, 4, 6, 8, 16)   # K candidates of the joint choice
MIN_WINDOW = 64
TIE = 0.005


def window_grid(largest_bucket: int) -> list[int]:
    """0, 64, 128, ... up to the first power of two >= the largest bucket (sorting it whole)."""
    out, w = [0], MIN_WINDOW
    while True:
        out.append(w)
        if w >= largest_bucket:
            return out
        w *= 2


@dataclass
class Evaluator:
    """Simulated rows for (boundaries, window), memoised: the same pair is never packed twice."""

    sub: Subsample
    budget: Budget
    seed: int
    epochs: int

    def __post_init__(self):
        self._memo: dict[tuple, Simulated] = {}
        self._packs: dict = {}          # subsample packings shared by rows (calibration windows)

    def __call__(self, boundaries, window: int) -> Simulated:
        full, part = self.sub.bucket_sizes(boundaries)
        # a window at least as large as every bucket sorts each bucket whole: the same batches
        w_key = min(int(window), int(full.max()) if full.max() > 1 else 1)
        key = (tuple(int(b) for b in boundaries), w_key)
        if key not in self._memo:
            self._memo[key] = simulate(self.sub, boundaries, budget=self.budget, window=int(window), seed=self.seed,
                                       epochs=self.epochs, cache=self._packs)
        return self._memo[key]


def row(sim: Simulated, k: int, window: int) -> dict:
    return {"k": k, "window": int(window), "efficiency": sim.efficiency, "fill": sim.fill,
            "microbatches": sim.microbatches, "repeat_pair": sim.repeat_pair, "spread": sim.spread, "how": sim.how,
            "per_bucket_microbatches": sim.per_bucket_microbatches}


def best_window(ev: Evaluator, boundaries, k: int, grid: list[int], limit: float, start: int | None = None) -> dict:
    """The largest grid window whose repeat-pair rate is <= ``limit`` (window 0's row if none).

    From ``start`` (a grid window, e.g. the previous K's answer) it gallops one grid step
    at a time; without one it bisects the grid. Both assume the rate grows with the window.
    """
    def at(i):
        return row(ev(boundaries, grid[i]), k, grid[i])

    if start is None:
        lo, hi = 0, len(grid) - 1     # invariant: grid[lo] within the limit (window 0 assumed)
        top = at(hi)
        if top["repeat_pair"] <= limit:
            return top
        best = at(0)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            r = at(mid)
            if r["repeat_pair"] <= limit:
                lo, best = mid, r
            else:
                hi = mid
        return best
    i = int(np.searchsorted(grid, start)) if start in grid else len(grid) // 2
    i = min(i, len(grid) - 1)
    r = at(i)
    if r["repeat_pair"] <= limit:
        while i + 1 < len(grid):
            nxt = at(i + 1)
            if nxt["repeat_pair"] > limit:
                break
            r, i = nxt, i + 1
        return r
    while i > 0:
        i -= 1
        r = at(i)
        if r["repeat_pair"] <= limit:
            return r
    return r


def smallest_window_reaching(ev: Evaluator, boundaries, k: int, grid: list[int], upto: int, target: float,
                             start: int | None = None) -> dict:
    """The smallest grid window <= ``upto`` whose efficiency is >= ``target`` (efficiency grows
    with the window; ``upto``'s row is assumed to reach it). From ``start`` (e.g. the previous
    K's answer) it walks one grid step at a time, else it bisects."""
    hi = grid.index(upto)

    def at(i):
        return row(ev(boundaries, grid[i]), k, grid[i])

    if start is not None and start in grid and grid.index(start) < hi:
        i = grid.index(start)
        r = at(i)
        if r["efficiency"] >= target:
            while i > 0:
                lower = at(i - 1)
                if lower["efficiency"] < target:
                    break
                r, i = lower, i - 1
            return r
        while i + 1 < hi:
            i += 1
            r = at(i)
            if r["efficiency"] >= target:
                return r
        return at(hi)
    lo, best = -1, at(hi)               # grid[hi] reaches the target; grid[lo] does not (or lo = -1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        r = at(mid)
        if r["efficiency"] >= target:
            hi, best = mid, r
        else:
            lo = mid
    return best


def pick(rows: list[dict], limit: float) -> tuple[dict, bool]:
    """The rule of the module docstring over ``rows``; (row, True) or, when nothing is within
    the limit, (the lowest repeat-pair row, False)."""
    ok = [r for r in rows if r["repeat_pair"] <= limit]
    if not ok:
        return min(rows, key=lambda r: (r["repeat_pair"], -r["efficiency"], r["k"], r["window"])), False
    top = max(r["efficiency"] for r in ok)
    near = [r for r in ok if r["efficiency"] >= top - TIE]
    return min(near, key=lambda r: (r["repeat_pair"], r["k"], r["window"])), True


def window_table(ev: Evaluator, boundaries, k: int, grid: list[int], limit: float, extra=()) -> list[dict]:
    """Rows for the grid's windows in order, up to and including the first past ``limit``,
    plus any ``extra`` windows (a window given on the command line)."""
    rows = []
    for w in grid:
        rows.append(row(ev(boundaries, w), k, w))
        if rows[-1]["repeat_pair"] > limit:
            break
    have = {r["window"] for r in rows}
    rows += [row(ev(boundaries, w), k, w) for w in extra if w not in have]
    return sorted(rows, key=lambda r: r["window"])


def choose(ev: Evaluator, refined: list, *, ks, window: int | None, limit: float) -> dict:
    """Joint choice over ``ks`` (K values) and the window (fixed when ``window`` is given).

    Returns ``{"k", "window", "within_limit", "candidates": per K the row the rule picks
    among that K's rows, "evaluated": every row the choice simulated}``.
    """
    if window is not None:
        cands = [row(ev(refined[k - 1], window), k, window) for k in ks]
        chosen, ok = pick(cands, limit)
        return {"k": chosen["k"], "window": chosen["window"], "within_limit": ok, "candidates": cands,
                "evaluated": cands}
    grids, cands, start = {}, [], None
    for k in ks:
        full, _ = ev.sub.bucket_sizes(refined[k - 1])
        grids[k] = window_grid(int(full.max()))
        cands.append(best_window(ev, refined[k - 1], k, grids[k], limit, start))
        start = cands[-1]["window"] or None
    evaluated = list(cands)
    ok_rows = [r for r in cands if r["repeat_pair"] <= limit]
    if ok_rows:
        target = max(r["efficiency"] for r in ok_rows) - TIE
        # smaller windows of the same K have a lower repeat-pair rate: the smallest still near E*
        start = None
        for r in ok_rows:
            if r["efficiency"] >= target:
                evaluated.append(smallest_window_reaching(ev, refined[r["k"] - 1], r["k"], grids[r["k"]], r["window"],
                                                          target, start))
                start = evaluated[-1]["window"]
    chosen, ok = pick(evaluated, limit)
    per_k = [pick([r for r in evaluated if r["k"] == k], limit)[0] for k in ks]
    return {"k": chosen["k"], "window": chosen["window"], "within_limit": ok, "candidates": per_k,
            "evaluated": evaluated}


def step_mix(sub: Subsample, plan, *, world_size: int, grad_accum: int) -> dict | None:
    """Step mix and rank imbalance of the plan's epoch 0 packed by ``pack`` over the subsample
    (class-aware schedule, W x A); None when the subsample has fewer micro-batches than a step."""
    cfg = pack.PackConfig(world_size=world_size, grad_accum=grad_accum)
    try:
        res = pack.build_epoch(np.asarray(sub.lengths), plan, cfg, 0)
    except ConfigError:
        return None
    s = res.header["summary"]
    return {"step_mix": s["step_mix"], "rank_imbalance": s["rank_imbalance"], "world_size": world_size,
            "grad_accum": grad_accum}
