"""The DFlash anchor sampler: which positions of a sample start a draft block.

Definitions (DESIGN.md "Drafter training"): position ``a`` of a sample is *eligible* when
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
   keyed by ``mix_key(seed, epoch, PURPOSE_ANCHORS, sample_id)`` (:mod:`bucketing`); each
   64-bit output gives two 32-bit ``r`` (low half first), and a draw in ``[0, n)`` is
   ``(r * n) >> 32``: integer arithmetic, identical on every machine, bias below
   ``n / 2^32`` (2e-6 at n = 8192).
2. *positions*: rank ``i`` maps to the ``i``-th eligible position of the mask.

Nothing depends on batching, rank or world size: a sample's anchors are the same alone
or in any micro-batch, so resume is exact. Since the ranks depend only on counts, pack
budgets and digests anchors from the per-sample counts tokenize records
(:func:`anchor_counts`, :func:`selection_digest`), without reading a single mask; the
dataset fingerprint pins every mask, hence every position.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from .bucketing import _splitmix, mix_key
from .errors import ConfigError
from .fileio import fingerprint_array

POLICIES = ("cap", "density")
#: Key tag of the anchor RNG stream ("anchors"), apart from buckets, schedules and varlen.
PURPOSE_ANCHORS = 0x616E63686F7273
#: Version of the sampling algorithm; recorded in manifests, part of the digest.
SAMPLER_VERSION = 1
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_ANCHORS = 512


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


def anchor_counts(candidates, supervised, max_anchors: int, policy: str = "cap",
                  block_size: int = DEFAULT_BLOCK_SIZE) -> np.ndarray:
    """How many anchors :func:`sample_anchors` returns per sample (int32), from counts alone."""
    check_options(max_anchors, policy, block_size)
    c = np.asarray(candidates, np.int64)
    k = np.minimum(c, int(max_anchors))
    if policy == "density":
        s = np.asarray(supervised, np.int64)
        k = np.minimum(k, (s + int(block_size) - 1) // int(block_size))
    return np.maximum(k, 0).astype(np.int32)


# ----------------------------------------------------------------------------- the draw
@nb.njit(cache=True, inline="always")
def _fold(h, p):
    # one step of bucketing.mix_key: h' = splitmix(h ^ p) (the test checks they agree)
    h = (h ^ p) + np.uint64(0x9E3779B97F4A7C15)
    z = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@nb.njit(cache=True)
def _select(c, k, key, sel):
    # sel[:c] = 1 at a uniform k-subset of range(c) (Floyd), 0 elsewhere; sel[c:] untouched.
    if k >= c:
        sel[:c] = 1
        return
    flip = 2 * k > c                  # draw the c - k left out instead: fewer draws, same law
    d = c - k if flip else k
    sel[:c] = 0
    state = key
    spare = np.uint64(0)
    have = False
    for j in range(c - d, c):
        if have:
            r = spare
            have = False
        else:
            state, z = _splitmix(state)
            r = z & np.uint64(0xFFFFFFFF)
            spare = z >> np.uint64(32)
            have = True
        t = np.int64((r * np.uint64(j + 1)) >> np.uint64(32))   # floor(r / 2^32 * (j + 1))
        sel[t + (j - t) * np.int64(sel[t])] = 1                  # Floyd: t if free, else j (no branch)
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
                         block_size: int = DEFAULT_BLOCK_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """:func:`sample_anchors` for ``n`` masks concatenated (a varlen micro-batch).

    Returns ``(positions, offsets)``: int32 positions within each sample, sample after
    sample, and int64 offsets ``(n + 1,)``. Sample ``i``'s anchors are exactly
    ``sample_anchors(mask_i, sample_id=sample_ids[i], ...)``.
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
    return out, off


def sample_anchors(loss_mask: np.ndarray, *, seed: int, epoch: int, sample_id: int, max_anchors: int,
                   policy: str = "cap", block_size: int = DEFAULT_BLOCK_SIZE) -> np.ndarray:
    """The anchors of one sample: sorted, distinct, eligible int32 positions (module docstring)."""
    mask = np.asarray(loss_mask)
    pos, _ = sample_anchors_batch(mask, np.array([0, mask.shape[0]], np.int64), np.array([sample_id], np.int64),
                                  seed=seed, epoch=epoch, max_anchors=max_anchors, policy=policy,
                                  block_size=block_size)
    return pos


# ----------------------------------------------------------------------------- digest
@nb.njit(cache=True, parallel=True)
def _selection_hashes(ids, cand, k, base, out):
    # per sample: fold(id, C, k) then a multiply-add hash over the 8-byte words of its bitmap
    n = ids.shape[0]
    top = 1
    for i in range(n):
        top = max(top, cand[ids[i]])
    words = (top + 7) // 8
    n_chunks = (n + 1023) // 1024
    for ch in nb.prange(n_chunks):
        buf = np.zeros(words, np.uint64)
        sel = buf.view(np.uint8)
        for i in range(ch * 1024, min(ch * 1024 + 1024, n)):
            s = ids[i]
            c = np.int64(cand[s])
            ki = np.int64(k[s])
            h = _fold(_fold(_fold(np.uint64(0x616E63686F72), np.uint64(s)), np.uint64(c)), np.uint64(ki))
            if ki < c:                 # ki == c takes every candidate: nothing drawn
                w = (c + 7) // 8
                buf[w - 1] = 0         # the bytes past c in the last word stay zero
                _select(c, ki, _fold(base, np.uint64(s)), sel)
                acc = np.uint64(0)
                for j in range(w):
                    acc = (acc ^ buf[j]) * np.uint64(0x100000001B3)
                h = _fold(h, acc)
            out[i] = h


def selection_digest(sample_ids: np.ndarray, candidates: np.ndarray, counts: np.ndarray, *, seed: int,
                     epoch: int) -> str:
    """Digest of every anchor of the epoch, in ``sample_ids`` order, without the masks.

    Per sample: a 64-bit hash of ``(id, C, k, its anchor ranks)``; the digest is
    :func:`fileio.fingerprint_array` of those hashes plus :data:`SAMPLER_VERSION`. With the
    dataset fingerprint (which pins every loss mask, so every rank -> position map), it
    fixes every anchor position. ``candidates`` and ``counts`` are indexed by sample id.
    """
    ids = np.ascontiguousarray(sample_ids, np.int64)
    cand = np.ascontiguousarray(candidates, np.int64)
    k = np.ascontiguousarray(counts, np.int64)
    if (k > cand).any() or (k < 0).any():
        raise ConfigError("anchor counts must lie in 0..candidates")
    h = np.empty(len(ids), np.uint64)
    if len(ids):
        _selection_hashes(ids, cand, k, _base_key(seed, epoch), h)
    return f"v{SAMPLER_VERSION}:" + fingerprint_array(h)


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
