"""The DFlash anchor sampler: which positions of a sample start a draft block.

Definitions (docs/definitions.md "Drafter training"): position ``a`` of a sample is *eligible* when
``loss_mask[a] == loss_mask[a + 1] == 1``; the sample's *candidates* are
``C = sum_t lm[t] * lm[t + 1]`` and its *supervised* tokens ``S = sum_t lm[t]``. Every
sample gets ``k`` anchors, drawn without replacement among its candidates and sorted:

- ``cap`` (default): ``k = min(max_anchors, C)`` (the public recipe: 512 at B = 16);
- ``density``: ``k = min(max_anchors, C, ceil(S / block_size))``: one block of ``B`` draft
  tokens per ``B`` supervised tokens, so the draft slots cover each sample's supervised
  tokens about once, whatever its length, and the cap still applies.

The draw is a pure function of ``(seed, epoch, sample id, C, k)``, taken in two stages:

1. *ranks*: a uniform ``k``-subset of ``range(C)`` by Floyd's algorithm on a ``C``-byte
   bitmap, read back in increasing order (no sort). When ``2k > C`` it draws the ``C - k``
   left-out candidates instead (the complement of a uniform subset is uniform), so a
   sample costs ``min(k, C - k)`` draws; ``k == C`` draws nothing. The RNG is SplitMix64
   keyed by ``mix_key(seed, epoch, PURPOSE_ANCHORS, sample_id)`` (:mod:`dflash_prep.pack.keyed`); each
   64-bit output gives two 32-bit ``r`` (low half first), and a draw in ``[0, n)`` is
   ``(r * n) >> 32``: integer arithmetic, identical on every machine, bias below
   ``n / 2^32`` (2e-6 at n = 8192).
2. *positions*: rank ``i`` maps to the ``i``-th eligible position of the mask.

Nothing depends on batching, rank or world size: a sample's anchors are the same alone
or in any micro-batch, so resume is exact. Since the ranks depend only on counts, pack
budgets and digests anchors from the per-sample counts tokenize records
(:func:`anchor_counts`, :class:`dflash_prep.objectives.anchor_digest.DigestJob`), without reading a single mask; the
dataset fingerprint pins every mask, hence every position.

Speed: the digest draws every anchor of the epoch (``min(k, C - k)`` draws per sample), so
it is most of a large drafter pack; a Floyd step is branch-free, its stores going to
addresses known before the collision test is read (:func:`_floyd_step`). Its cost in a
100M-sample pack (``bench/drafter_data.py``): docs/benchmarks.md#drafter-data-paths.
"""

from __future__ import annotations


import numba as nb
import numpy as np

from dflash_prep.errors import ConfigError
from dflash_prep.pack.keyed import _splitmix, mix_key

POLICIES = ("cap", "density")
#: Key tag of the anchor RNG stream ("anchors"), apart from buckets, schedules and varlen.
PURPOSE_ANCHORS = 0x616E63686F7273
#: Version of the sampling algorithm; recorded in manifests, part of the digest.
SAMPLER_VERSION = 1
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_ANCHORS = 512
DEFAULT_POLICY = "cap"


def check_options(max_anchors: int, policy: str, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
    """Raise :class:`ConfigError` for an unknown policy or a non-positive cap or block size."""
    if policy not in POLICIES:
        raise ConfigError(f"--anchor-policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if int(max_anchors) < 1:
        raise ConfigError(f"--max-anchors must be at least 1, got {max_anchors}")
    if int(block_size) < 2:
        raise ConfigError(f"--block-size must be at least 2 (one anchor token plus draft slots), got {block_size}")


# ----------------------------------------------------------------------------- counts
@nb.njit(cache=True)
def _mask_counts(mask, cu, sup, cand):
    for i in range(cu.shape[0] - 1):
        s = np.int64(0)
        c = np.int64(0)
        prev = 0
        for t in range(cu[i], cu[i + 1]):
            v = 1 if mask[t] != 0 else 0
            s += v
            c += v & prev
            prev = v
        sup[i] = s
        cand[i] = c


def mask_counts(loss_mask: np.ndarray, cu_seqlens: np.ndarray | None = None):
    """Supervised tokens ``S`` and anchor candidates ``C`` (module docstring).

    One mask (1-D, any integer or bool dtype) gives two ints. With ``cu_seqlens`` (int64,
    ``(n + 1,)``), ``loss_mask`` holds ``n`` masks concatenated and the result is two
    int32 arrays of ``n``.
    """
    mask = np.ascontiguousarray(loss_mask).view(np.uint8) if np.asarray(loss_mask).dtype == np.bool_ \
        else np.ascontiguousarray(loss_mask)
    single = cu_seqlens is None
    cu = np.array([0, mask.shape[0]], np.int64) if single else np.ascontiguousarray(cu_seqlens, np.int64)
    if cu[0] != 0 or cu[-1] != mask.shape[0] or (np.diff(cu) < 0).any():
        raise ConfigError(f"cu_seqlens must rise from 0 to the mask length {mask.shape[0]}")
    sup, cand = np.zeros(len(cu) - 1, np.int64), np.zeros(len(cu) - 1, np.int64)
    _mask_counts(mask, cu, sup, cand)
    if single:
        return int(sup[0]), int(cand[0])
    return sup.astype(np.int32), cand.astype(np.int32)


def chunk_mask_counts(mask: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(S, C)`` of consecutive samples whose masks are concatenated in ``mask``."""
    cu = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(np.asarray(lengths, np.int64), out=cu[1:])
    return mask_counts(mask, cu)


@nb.njit(cache=True, inline="always")
def anchor_count(c, s, max_anchors, density, block_size):
    """``k`` of one sample from its candidates ``c`` and supervised tokens ``s`` (numba)."""
    k = min(np.int64(c), max_anchors)
    if density:
        k = min(k, (np.int64(s) + block_size - 1) // block_size)
    return max(k, 0)


@nb.njit(cache=True, parallel=True)
def _anchor_counts(cand, sup, max_anchors, density, block_size, out):
    for i in nb.prange(cand.shape[0]):
        out[i] = anchor_count(cand[i], sup[i], max_anchors, density, block_size)


def anchor_counts(candidates, supervised, max_anchors: int, policy: str = "cap",
                  block_size: int = DEFAULT_BLOCK_SIZE) -> np.ndarray:
    """How many anchors :func:`sample_anchors` returns per sample (int32), from counts alone."""
    check_options(max_anchors, policy, block_size)
    c, s = np.asarray(candidates), np.asarray(supervised)
    c = c if c.dtype.kind in "iu" else c.astype(np.int64)
    s = s if s.dtype.kind in "iu" else s.astype(np.int64)
    if c.shape != s.shape:
        raise ConfigError(f"candidates {c.shape} and supervised {s.shape} need one entry per sample each")
    out = np.empty(c.shape[0], np.int32)
    _anchor_counts(np.ascontiguousarray(c), np.ascontiguousarray(s), np.int64(max_anchors), policy == "density",
                   np.int64(block_size), out)
    return out


# ----------------------------------------------------------------------------- the draw
@nb.njit(cache=True, inline="always")
def _fold(h, p):
    # one step of keyed.mix_key: h' = splitmix(h ^ p) (the test checks they agree)
    h = (h ^ p) + np.uint64(0x9E3779B97F4A7C15)
    z = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@nb.njit(cache=True, inline="always")
def _floyd_step(j, t, sel):
    # Floyd's step j: take t if free, else j (never taken before: every element so far is < j).
    # Branch-free, and both store addresses are known before sel[t] is read (sel[j] is written
    # first, so t == j ends taken): the CPU need not wait on the load to place the stores.
    # faster than ``sel[j if sel[t] else t] = 1``, whose branch mispredicts on collisions
    # (docs/benchmarks.md#drafter-data-paths)
    sel[j] = sel[t]
    sel[t] = 1


@nb.njit(cache=True, inline="always")
def _draw(c, d, key, sel):
    # Floyd: marks a uniform d-subset of range(c) in sel (zero on entry). Two draws per
    # SplitMix64 output, low half first; a draw in [0, j + 1) is floor(r / 2^32 * (j + 1)).
    state = key
    low = np.uint64(0xFFFFFFFF)
    j = c - d
    while j < c:
        state, z = _splitmix(state)
        _floyd_step(j, np.int64(((z & low) * np.uint64(j + 1)) >> np.uint64(32)), sel)
        j += 1
        if j < c:
            _floyd_step(j, np.int64(((z >> np.uint64(32)) * np.uint64(j + 1)) >> np.uint64(32)), sel)
            j += 1


@nb.njit(cache=True)
def _select(c, k, key, sel):
    # sel[:c] = 1 at a uniform k-subset of range(c), 0 elsewhere; sel[c:] untouched.
    if k >= c:
        sel[:c] = 1
        return
    flip = 2 * k > c                  # draw the c - k left out instead: fewer draws, same law
    sel[:c] = 0
    _draw(c, c - k if flip else k, key, sel)
    if flip:
        for i in range(c):
            sel[i] ^= 1


@nb.njit(cache=True)
def _ranks(c, k, key, sel, out):
    # the k-subset in increasing order (out[:k])
    _select(c, k, key, sel)
    n = 0
    for i in range(c):
        out[n] = i
        n += sel[i]


@nb.njit(cache=True)
def _sample_many(mask, cu, ids, k, base, out, out_off):
    # positions of every sample's anchors, concatenated in input order
    top = 1
    for i in range(ids.shape[0]):
        top = max(top, cu[i + 1] - cu[i])
    sel = np.empty(top, np.uint8)
    rank = np.empty(top, np.int64)
    pos = np.empty(top, np.int32)
    for i in range(ids.shape[0]):
        c = 0
        prev = 0
        for t in range(cu[i], cu[i + 1]):
            v = 1 if mask[t] != 0 else 0
            if v and prev:
                pos[c] = t - 1 - cu[i]
                c += 1
            prev = v
        ki = k[i]
        _ranks(c, ki, _fold(base, np.uint64(ids[i])), sel, rank)
        o = out_off[i]
        for j in range(ki):
            out[o + j] = pos[rank[j]]


def _base_key(seed: int, epoch: int) -> np.uint64:
    return np.uint64(mix_key(seed, epoch, PURPOSE_ANCHORS))


def sample_anchors_batch(loss_mask: np.ndarray, cu_seqlens: np.ndarray, sample_ids: np.ndarray, *, seed: int,
                         epoch: int, max_anchors: int, policy: str = "cap",
                         block_size: int = DEFAULT_BLOCK_SIZE, with_counts: bool = False):
    """:func:`sample_anchors` for ``n`` masks concatenated (a varlen micro-batch).

    Returns ``(positions, offsets)``: int32 positions within each sample, sample after
    sample, and int64 offsets ``(n + 1,)``. Sample ``i``'s anchors are exactly
    ``sample_anchors(mask_i, sample_id=sample_ids[i], ...)``. ``with_counts`` also returns
    the :func:`mask_counts` the draw was sized from: ``(positions, offsets, S, C)``.
    """
    mask = np.ascontiguousarray(loss_mask)
    if mask.dtype == np.bool_:
        mask = mask.view(np.uint8)
    cu = np.ascontiguousarray(cu_seqlens, np.int64)
    ids = np.ascontiguousarray(sample_ids, np.int64)
    if len(cu) != len(ids) + 1:
        raise ConfigError(f"cu_seqlens has {len(cu)} entries for {len(ids)} samples; it needs one more")
    if len(ids) and ids.min() < 0:
        raise ConfigError("sample ids must be >= 0")
    sup, cand = mask_counts(mask, cu)
    k = anchor_counts(cand, sup, max_anchors, policy, block_size)
    off = np.zeros(len(ids) + 1, np.int64)
    np.cumsum(k, out=off[1:])
    out = np.empty(int(off[-1]), np.int32)
    if len(ids):
        _sample_many(mask, cu, ids, k.astype(np.int64), _base_key(seed, epoch), out, off)
    return (out, off, sup, cand) if with_counts else (out, off)


def sample_anchors(loss_mask: np.ndarray, *, seed: int, epoch: int, sample_id: int, max_anchors: int,
                   policy: str = "cap", block_size: int = DEFAULT_BLOCK_SIZE) -> np.ndarray:
    """The anchors of one sample: sorted, distinct, eligible int32 positions (module docstring)."""
    mask = np.asarray(loss_mask)
    pos, _ = sample_anchors_batch(mask, np.array([0, mask.shape[0]], np.int64), np.array([sample_id], np.int64),
                                  seed=seed, epoch=epoch, max_anchors=max_anchors, policy=policy,
                                  block_size=block_size)
    return pos


@nb.njit(cache=True)
def _bad_samples(mask, cu, pos, off, bad):
    n_bad = 0
    for i in range(cu.shape[0] - 1):
        L = cu[i + 1] - cu[i]
        ok = True
        last = -1
        for j in range(off[i], off[i + 1]):
            a = pos[j]
            if a <= last or a < 0 or a + 1 >= L or mask[cu[i] + a] == 0 or mask[cu[i] + a + 1] == 0:
                ok = False
                break
            last = a
        if not ok:
            bad[n_bad] = i
            n_bad += 1
    return n_bad


def ineligible(loss_mask: np.ndarray, cu_seqlens: np.ndarray, positions: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Indices of the samples whose positions are not sorted, distinct and eligible."""
    mask = np.ascontiguousarray(loss_mask)
    mask = mask.view(np.uint8) if mask.dtype == np.bool_ else mask
    cu, off = np.ascontiguousarray(cu_seqlens, np.int64), np.ascontiguousarray(offsets, np.int64)
    if len(off) != len(cu) or off[-1] != len(positions):
        raise ConfigError("anchor offsets must have one entry per cu_seqlens entry and end at the positions' length")
    bad = np.empty(len(cu) - 1, np.int64)
    n = _bad_samples(mask, cu, np.ascontiguousarray(positions, np.int32), off, bad)
    return bad[:n]
