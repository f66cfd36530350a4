"""Step schedules: which micro-batches share an optimizer step, and which rank runs each.

An optimizer step is ``W`` ranks x ``A`` accumulation micro-batches. Given one epoch's
micro-batches, this module

1. makes their count a multiple of ``W * A`` (:func:`complete_steps`): either by splitting
   the micro-batches with the most samples in two (the default: every sample is still used
   exactly once, a split never exceeds the budget and never adds padding), or, with
   ``drop_last``, by dropping the epoch's last ``M mod (W*A)`` scheduled micro-batches;
2. orders them (:func:`order_microbatches`) with one of :data:`SCHEDULES`:

   - ``class-aware`` (default): each micro-batch gets the length class (definitions.md's 8
     token-weighted octile classes) of its token-weighted mean length ``sum L^2 / sum L``.
     Each class is shuffled with a keyed RNG, then the classes are interleaved in
     proportion to their sizes, so every run of ``W*A`` consecutive micro-batches holds each
     class's share to within one micro-batch. Sorting windows make micro-batches narrow
     in length, so this gives each step an even token mix. Seedlike, K=6, window 2048,
     W=8, A=1: step mix 0.025 against 0.104 for a full random shuffle;
   - ``stratified``: the same interleave over the plan's buckets instead of length classes
     (definitions.md: 0.130 at K=6);
   - ``random``: a keyed permutation of the micro-batches (definitions.md: 0.278 at K=6).
3. assigns the ``W*A`` micro-batches of each step to ranks (:func:`assign_ranks`): longest
   processing time first under the cost model, each rank taking exactly ``A`` of them, so
   every rank gets the same count (unequal counts deadlock DDP) and the most expensive
   rank is as cheap as LPT makes it.

All randomness is keyed by ``(seed, epoch, purpose, group)`` through
:func:`dflash_prep.pack.keyed.mix_key`; the interleave keys are float64 quotients, which
IEEE 754 rounds identically on every machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba as nb
import numpy as np

from dflash_prep.errors import ConfigError
from dflash_prep.pack.batch_stats import microbatch_stats
from dflash_prep.pack.keyed import _shuffle_inplace, mix_key

SCHEDULES = ("class-aware", "stratified", "random")
PURPOSE_SCHEDULE = 0x7363686564      # "sched"
PURPOSE_JITTER = 0x6A6974746572      # "jitter"


def microbatch_classes(real_tokens: np.ndarray, sum_sq: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Length class of each micro-batch: the class of its token-weighted mean length."""
    real = np.asarray(real_tokens, np.float64)
    mean_len = np.divide(np.asarray(sum_sq, np.float64), real, out=np.zeros_like(real), where=real > 0)
    return np.searchsorted(np.asarray(edges, np.float64), mean_len, side="right").astype(np.int64)


def interleave(group: np.ndarray, n_groups: int, *, seed: int, epoch: int) -> np.ndarray:
    """Order items so that every window holds each group's share (to within one item).

    Items of group ``g`` are shuffled (keyed by ``(seed, epoch, PURPOSE_SCHEDULE, g)``);
    the ``j``-th of its ``n_g`` items gets the position key ``(j + u_g) / n_g`` with a keyed
    offset ``u_g`` in [0, 1), and all items are sorted by key (ties by group). Returns the
    permutation (int64).
    """
    group = np.asarray(group, np.int64)
    m = group.shape[0]
    by_group = np.argsort(group, kind="stable")
    counts = np.bincount(group, minlength=n_groups)
    keys = np.empty(m, np.float64)
    starts = np.concatenate([[0], np.cumsum(counts)])
    for g in range(n_groups):
        s, e = int(starts[g]), int(starts[g + 1])
        if e == s:
            continue
        members = by_group[s:e].copy()
        _shuffle_inplace(members, np.uint64(mix_key(seed, epoch, PURPOSE_SCHEDULE, g)))
        by_group[s:e] = members
        u = (mix_key(seed, epoch, PURPOSE_JITTER, g) >> 11) * (1.0 / 2**53)   # [0, 1)
        keys[s:e] = (np.arange(e - s, dtype=np.float64) + u) / float(e - s)
    perm = np.lexsort((group[by_group], keys))
    return by_group[perm]


def order_microbatches(schedule: str, *, classes: np.ndarray, buckets: np.ndarray, n_buckets: int,
                       n_classes: int, seed: int, epoch: int) -> np.ndarray:
    """The epoch's micro-batch order under ``schedule`` (a permutation, int64)."""
    if schedule == "class-aware":
        return interleave(classes, n_classes, seed=seed, epoch=epoch)
    if schedule == "stratified":
        return interleave(buckets, n_buckets, seed=seed, epoch=epoch)
    if schedule == "random":
        perm = np.arange(len(classes), dtype=np.int64)
        _shuffle_inplace(perm, np.uint64(mix_key(seed, epoch, PURPOSE_SCHEDULE, -1)))
        return perm
    raise ConfigError(f"unknown --schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")


def complete_steps(offsets: np.ndarray, step_size: int, *, drop_last: bool, where: str = "this epoch") -> np.ndarray:
    """Make the number of micro-batches a multiple of ``step_size`` by splitting (module doc).

    With ``drop_last`` the offsets are returned unchanged (the scheduler drops the tail).
    Otherwise the micro-batches with the most samples (lowest index on ties) are split at
    their midpoint, one split per micro-batch per round, until the count is a multiple.
    Raises ConfigError when there are fewer micro-batches than one step, or too few
    samples to split into whole steps.
    """
    offsets = np.asarray(offsets, np.int64)
    m = len(offsets) - 1
    if m < step_size:
        raise ConfigError(f"{where} packs into {m} micro-batches, fewer than one step of world size x grad accum "
                          f"= {step_size}; lower --world-size/--grad-accum or the budget, or use more data")
    need = (-m) % step_size
    if drop_last or need == 0:
        return offsets
    while need:
        counts = np.diff(offsets)
        splittable = np.flatnonzero(counts >= 2)
        if len(splittable) == 0:
            raise ConfigError(f"{where}: {m} micro-batches of one sample each cannot be split into whole steps of "
                              f"{step_size}; pass --drop-last")
        pick = splittable[np.argsort(-counts[splittable], kind="stable")[:need]]
        mids = offsets[pick] + counts[pick] // 2
        offsets = np.sort(np.concatenate([offsets, mids]))
        need -= len(pick)
    return offsets


@nb.njit(cache=True)
def _lpt(cost, world_size, grad_accum, slot):
    # cost in step order; slot[i] = rank * A + accum of item i inside its step.
    s = world_size * grad_accum
    n_steps = cost.shape[0] // s
    load = np.zeros(world_size, np.float64)
    used = np.zeros(world_size, np.int64)
    for t in range(n_steps):
        base = t * s
        idx = np.argsort(-cost[base:base + s], kind="mergesort")
        load[:] = 0.0
        used[:] = 0
        for j in range(s):
            i = idx[j]
            best = -1
            for r in range(world_size):
                if used[r] < grad_accum and (best < 0 or load[r] < load[best]):
                    best = r
            slot[base + i] = best * grad_accum + used[best]
            used[best] += 1
            load[best] += cost[base + i]


def assign_ranks(cost: np.ndarray, world_size: int, grad_accum: int):
    """Place each step's micro-batches on ranks; returns (perm, step, rank, accum).

    ``cost`` is per micro-batch in schedule order, its length a multiple of ``W * A``.
    ``perm`` reorders the micro-batches into manifest order: step, then rank, then accum.
    Within a step, micro-batches go in decreasing cost to the least-loaded rank that still
    has room (ties: the lower rank; exactly ``A`` per rank).
    """
    cost = np.ascontiguousarray(cost, np.float64)
    s = world_size * grad_accum
    m = cost.shape[0]
    if m % s:
        raise ConfigError(f"internal: {m} micro-batches is not a multiple of the step size {s}")
    slot = np.empty(m, np.int64)
    _lpt(cost, int(world_size), int(grad_accum), slot)
    step = np.arange(m, dtype=np.int64) // s
    dest = step * s + slot                      # manifest position of each scheduled micro-batch
    perm = np.empty(m, np.int64)
    perm[dest] = np.arange(m, dtype=np.int64)
    pos = np.arange(m, dtype=np.int64) % s
    return perm, step, pos // grad_accum, pos % grad_accum


@dataclass(frozen=True)
class ScheduledEpoch:
    """Packed micro-batches made into whole, ordered steps (:func:`schedule_epoch`).

    ``offsets``/``bucket`` after any splits; per packed micro-batch ``real``, ``mx``, ``sq``
    (sum of L^2), ``class_tok`` (tokens per length class) and ``count``; ``sched`` the kept
    micro-batches in schedule order (a multiple of the step size) and ``dropped`` the ones
    ``drop_last`` leaves out; ``n_split`` how many micro-batches were split in two."""

    offsets: np.ndarray
    bucket: np.ndarray
    n_split: int
    real: np.ndarray
    mx: np.ndarray
    sq: np.ndarray
    class_tok: np.ndarray
    count: np.ndarray
    sched: np.ndarray
    dropped: np.ndarray


def schedule_epoch(offsets: np.ndarray, bucket: np.ndarray, olens: np.ndarray, edges: np.ndarray, *,
                   schedule: str, step_size: int, drop_last: bool, n_buckets: int, seed: int, epoch: int,
                   where: str) -> ScheduledEpoch:
    """Steps 1-2 of the module docstring for one epoch's packed micro-batches: complete the
    steps (split or drop), then order the micro-batches with ``schedule``. ``pack`` and the
    resume re-pack (:mod:`dflash_prep.pack.repack`) both build their steps here."""
    split = complete_steps(offsets, step_size, drop_last=drop_last, where=where)
    n_split = len(split) - len(offsets)
    if n_split:                        # split micro-batches keep their bucket
        bucket = bucket[np.searchsorted(offsets, split[:-1], side="right") - 1]
        offsets = split
    real, mx, sq, class_tok = microbatch_stats(olens, offsets, edges)
    classes = microbatch_classes(real, sq, edges)
    sched = order_microbatches(schedule, classes=classes, buckets=bucket, n_buckets=n_buckets,
                               n_classes=len(edges) + 1, seed=seed, epoch=epoch)
    n_keep = len(sched) - len(sched) % step_size
    return ScheduledEpoch(offsets, bucket, int(n_split), real, mx, sq, class_tok, np.diff(offsets),
                          sched[:n_keep], sched[n_keep:])


def step_mix_of(class_tok: np.ndarray, rows: np.ndarray, step_size: int) -> float:
    """Step mix (docs/definitions.md) of the micro-batches ``rows`` in manifest order, from
    their per-class token counts: mean over steps of the TV distance of the class shares from
    uniform."""
    steps_tok = class_tok[rows].reshape(-1, step_size, class_tok.shape[1]).sum(1).astype(np.float64)
    if not len(steps_tok):
        return 0.0
    shares = steps_tok / np.maximum(steps_tok.sum(1, keepdims=True), 1.0)
    return float((0.5 * np.abs(shares - 1.0 / class_tok.shape[1]).sum(1)).mean())
