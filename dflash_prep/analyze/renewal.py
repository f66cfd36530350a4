"""Greedy packing of one shuffled bucket, solved exactly as a renewal chain.

A shuffled bucket is (up to finite-size effects) an i.i.d. stream from the bucket's length
histogram. Greedy packing of that stream is a Markov chain over the open micro-batch's
state (samples so far, longest so far); a micro-batch closes when the next sample does not
fit, and that sample opens the next one. The chain gives the expected padded tokens per
sample and samples per micro-batch exactly for the stream. Against simulated
``pack_padded_epoch`` the residue is the shuffled bucket's finiteness and its last, partial
micro-batch (``bench/analyze_accuracy.py``: docs/benchmarks.md#analyze-model-accuracy).

Cost: O(values x n_max) per power iteration (n_max = budget // cost(shortest)), ~5
iterations; milliseconds for a bucket, which is why the boundary search in
:mod:`dflash_prep.analyze.optimize` scores buckets with its O(1) model and uses this one to predict
and, through :func:`polish`, to move the searched boundaries where the two disagree.
"""

from __future__ import annotations

import numba as nb
import numpy as np


@nb.njit(cache=True)
def renewal(vals, cnts, budget, alpha, cap, iters, tol):
    """Greedy packing of an endless i.i.d. stream from one bucket, solved exactly.

    State of the open micro-batch: (n samples, max value index t), distribution x_n[t].
    The next sample u joins if ``(n+1) * cost(max(t, u)) <= budget`` (and n+1 <= cap);
    otherwise the batch closes with n * v_t padded tokens and u opens the next one, so
    the first-sample distribution pi of a batch is the stationary law of rejected
    samples (power iteration from pi = p). Per layer n this is O(values) with prefix sums.
    Returns (E[n * max], E[n], E[n * cost(max)]) per batch: padded tokens per sample is
    the first over the second.
    """
    d = vals.shape[0]
    tot = cnts.sum()
    p = cnts / tot
    F = np.cumsum(p)
    cost = vals + alpha * vals * vals
    pi = p.copy()
    e_nm = 0.0
    e_n = 1.0
    e_nc = 0.0
    for _ in range(iters):
        x = pi.copy()
        rej_all = 0.0            # rejected-sample mass spread over every u (as p[u])
        rej_from = np.zeros(d + 1)  # mass spread over u >= index (difference array)
        e_nm = 0.0
        e_n = 0.0
        e_nc = 0.0
        top = d - 1  # highest index that can hold mass
        n = 1
        while top >= 0:
            # lim: highest value index a batch of n+1 samples may have
            lim = -1
            if n + 1 <= cap:
                lim = top
                while lim >= 0 and (n + 1) * cost[lim] > budget:
                    lim -= 1
            a_hi = 0.0
            a_lo = 0.0
            cl_n = 0.0
            cl_nm = 0.0
            cl_nc = 0.0
            for t in range(top + 1):
                if t > lim:
                    c = x[t]
                    a_hi += x[t]
                else:
                    c = x[t] * (1.0 - F[lim])
                    a_lo += x[t]
                cl_n += c
                cl_nm += c * vals[t]
                cl_nc += c * cost[t]
            e_n += n * cl_n
            e_nm += n * cl_nm
            e_nc += n * cl_nc
            rej_all += a_hi
            rej_from[lim + 1] += a_lo
            # survivors: stay at t (u <= t) or move up to u (t < u <= lim)
            run = 0.0
            for t in range(lim + 1):
                xt = x[t]
                x[t] = xt * F[t] + p[t] * run
                run += xt
            top = lim
            n += 1
        rej = p * (rej_all + np.cumsum(rej_from)[:d])
        rej /= rej.sum()
        diff = np.abs(rej - pi).sum()
        pi = rej
        if diff < tol:
            break
    return e_nm, e_n, e_nc


def polish(starts: list[int], cost, max_sweeps: int = 4) -> list[int]:
    """Coordinate descent on bucket starts against ``cost(i, j)`` (a bucket's padded tokens).

    ``starts`` holds the first distinct-value index of every bucket plus the number of
    values at the end. Each inner start moves by pattern search (a step of 1/16 of the room
    between its neighbours, halving to 1) to where its two buckets cost least; sweeps repeat
    until nothing moves. Returns the new starts; a local optimum of ``cost``.
    """
    starts = list(starts)
    for _ in range(max_sweeps):
        moved = False
        for k in range(1, len(starts) - 1):
            lo, hi = starts[k - 1] + 1, starts[k + 1] - 1
            c = starts[k]
            f = cost(starts[k - 1], c - 1) + cost(c, starts[k + 1] - 1)
            step = max(1, (hi - lo) // 16)
            while step >= 1:
                best = None
                for cand in (c - step, c + step):
                    if lo <= cand <= hi:
                        g = cost(starts[k - 1], cand - 1) + cost(cand, starts[k + 1] - 1)
                        if g < f * (1 - 1e-12):
                            best, f = cand, g
                if best is None:
                    step //= 2
                else:
                    c, moved = best, True
            starts[k] = c
        if not moved:
            break
    return starts
