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
   keyed by ``mix_key(seed, epoch, PURPOSE_ANCHORS, sample_id)`` (:mod:`bucketing`); each
   64-bit output gives two 32-bit ``r`` (low half first), and a draw in ``[0, n)`` is
   ``(r * n) >> 32``: integer arithmetic, identical on every machine, bias below
   ``n / 2^32`` (2e-6 at n = 8192).
2. *positions*: rank ``i`` maps to the ``i``-th eligible position of the mask.

Nothing depends on batching, rank or world size: a sample's anchors are the same alone
or in any micro-batch, so resume is exact. Since the ranks depend only on counts, pack
budgets and digests anchors from the per-sample counts tokenize records
(:func:`anchor_counts`, :class:`DigestJob`), without reading a single mask; the
dataset fingerprint pins every mask, hence every position.

Speed: the digest draws every anchor of the epoch, ~215 draws per seedlike sample at the
public cap (``min(k, C - k)``), so it is most of a 100M-sample pack. A Floyd step costs
~2.3 ns: its stores go to addresses known before the collision test is read
(:func:`_floyd_step`). Measured (``bench/drafter_data.py``): 10M seedlike samples digest in
5.3 s on one core, 3.2 s on two.
"""

from __future__ import annotations

import hashlib
import threading

import numba as nb
import numpy as np

from dflash_prep.errors import ConfigError
from dflash_prep.formats.fileio import FINGERPRINT_HEX
from dflash_prep.pack.bucketing import _splitmix, mix_key

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
    # one step of bucketing.mix_key: h' = splitmix(h ^ p) (the test checks they agree)
    h = (h ^ p) + np.uint64(0x9E3779B97F4A7C15)
    z = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@nb.njit(cache=True, inline="always")
def _floyd_step(j, t, sel):
    # Floyd's step j: take t if free, else j (never taken before: every element so far is < j).
    # Branch-free, and both store addresses are known before sel[t] is read (sel[j] is written
    # first, so t == j ends taken): the CPU need not wait on the load to place the stores.
    # 1.7x faster than ``sel[j if sel[t] else t] = 1``, whose branch mispredicts on collisions.
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


# ----------------------------------------------------------------------------- digest
#: Version of the digest's definition (:func:`selection_digest`); with :data:`SAMPLER_VERSION`
#: it prefixes every digest, so a manifest digested another way is told apart from a wrong draw.
DIGEST_SCHEME = 2
DIGEST_PREFIX = f"s{SAMPLER_VERSION}d{DIGEST_SCHEME}:"
_SAMPLE_TAG = np.uint64(0x616E63686F72)      # the first fold of every sample's hash
#: Samples per chunk of the digest at most (8 bytes of hash each: 32 MiB buffers, reused);
#: smaller epochs cut 32 chunks (of 65,536 at least), so both threads get work.
DIGEST_CHUNK = 1 << 22


@nb.njit(cache=True, inline="always")
def _bitmap_hash(words, w):
    # 64-bit hash of words[:w] (a 0/1 byte map read 8 bytes at a time): four independent
    # multiply-xorshift lanes, so the CPU overlaps them; folded with w at the end
    p = np.uint64(0x9E3779B97F4A7C15)
    a0 = np.uint64(0x243F6A8885A308D3)
    a1 = np.uint64(0x13198A2E03707344)
    a2 = np.uint64(0xA4093822299F31D0)
    a3 = np.uint64(0x082EFA98EC4E6C89)
    j = 0
    while j + 4 <= w:
        a0 = (a0 ^ words[j]) * p
        a1 = (a1 ^ words[j + 1]) * p
        a2 = (a2 ^ words[j + 2]) * p
        a3 = (a3 ^ words[j + 3]) * p
        a0 ^= a0 >> np.uint64(29)
        a1 ^= a1 >> np.uint64(29)
        a2 ^= a2 >> np.uint64(29)
        a3 ^= a3 >> np.uint64(29)
        j += 4
    while j < w:
        a0 = (a0 ^ words[j]) * p
        a0 ^= a0 >> np.uint64(29)
        j += 1
    return _fold(_fold(_fold(_fold(np.uint64(w), a0), a1), a2), a3)


@nb.njit(cache=True, inline="always")
def _sample_hash(s, c, k, acc):
    return _fold(_fold(_fold(_fold(_SAMPLE_TAG, np.uint64(s)), np.uint64(c)), np.uint64(k)), acc)


@nb.njit(cache=True, nogil=True)
def _count_hashes(cand, k, base, top, lo, out):
    # out[i]: hash of sample lo + i from its counts and its draw (nogil: DigestJob's threads)
    words = np.zeros((top + 8) // 8, np.uint64)
    sel = words.view(np.uint8)
    for i in range(out.shape[0]):
        s = lo + i
        c = np.int64(cand[s])
        ki = np.int64(k[s])
        d = c - ki if 2 * ki > c else ki          # the side _select draws: the smaller one
        acc = np.uint64(0)
        if d > 0:
            w = (c + 7) // 8
            words[:w] = 0
            _draw(c, d, _fold(base, np.uint64(s)), sel)
            acc = _bitmap_hash(words, w)
        out[i] = _sample_hash(s, c, ki, acc)


@nb.njit(cache=True)
def _position_hashes(mask, cu, ids, pos, off, out):
    # out[i]: the same hash from sample i's positions: its mask gives every candidate's rank
    top = 1
    for i in range(cu.shape[0] - 1):
        top = max(top, cu[i + 1] - cu[i])
    words = np.zeros((top + 8) // 8, np.uint64)
    sel = words.view(np.uint8)
    for i in range(cu.shape[0] - 1):
        ki = off[i + 1] - off[i]
        words[:(cu[i + 1] - cu[i] + 7) // 8] = 0     # c <= L
        c = 0
        prev = 0
        j = off[i]
        for t in range(cu[i], cu[i + 1]):
            v = 1 if mask[t] != 0 else 0
            if v and prev:
                if j < off[i + 1] and pos[j] == t - 1 - cu[i]:
                    sel[c] = 1
                    j += 1
                c += 1
            prev = v
        acc = np.uint64(0)
        if min(ki, c - ki) > 0:
            if 2 * ki > c:                        # Floyd drew the left-out side
                for r in range(c):
                    sel[r] ^= 1
            acc = _bitmap_hash(words, (c + 7) // 8)
        out[i] = _sample_hash(ids[i], c, ki, acc)


class AnchorDigest:
    """The epoch's anchor digest, fed every sample's 64-bit hash in id order, chunk by chunk.

    ``sha256(b"dflash-prep anchors" | N as 8 bytes | h_0 | ... | h_{N-1})`` (little-endian
    uint64), its first 128 bits in hex after :data:`DIGEST_PREFIX`, over all ``N`` samples
    of the dataset: a sample's anchors do not depend on which samples an epoch keeps (the
    manifest's ``sample_ids.npy`` has its own hash), so the digest needs no packing result
    and pack computes it while it packs. ``h_s`` hashes ``(s, C_s, k_s, the draw)``; the
    draw is a hash of the 0/1 byte map over ``range(C_s)`` of the side Floyd draws (the
    chosen ranks when ``2k <= C``, the left-out ones otherwise), 0 when nothing is drawn.
    Pack computes ``h_s`` from the counts and the draw (:class:`DigestJob`); verify from
    the positions it regenerates from the masks (:func:`position_hashes`): the two meet
    only if every anchor position agrees.
    """

    def __init__(self, n_samples: int):
        self.n = int(n_samples)
        self.fed = 0
        self._h = hashlib.sha256(b"dflash-prep anchors")
        self._h.update(self.n.to_bytes(8, "little"))

    def update(self, hashes: np.ndarray) -> None:
        h = np.ascontiguousarray(hashes, "<u8")
        self._h.update(memoryview(h).cast("B"))
        self.fed += int(h.shape[0])

    def hexdigest(self) -> str:
        if self.fed != self.n:
            raise ConfigError(f"anchor digest fed {self.fed} sample hashes for {self.n} samples")
        return DIGEST_PREFIX + self._h.hexdigest()[:FINGERPRINT_HEX]


class DigestJob:
    """:func:`selection_digest`, computed by a background thread while the caller packs.

    The thread takes chunks of samples in id order (1/32 of the epoch, within 65,536 and
    :data:`DIGEST_CHUNK`; a nogil kernel that draws every sample's anchors, the bulk of a
    100M-sample epoch's CPU time); finished chunks are hashed in order. :meth:`result` joins in on the chunks left, so the job also
    runs on both cores once the caller waits. :meth:`cancel` stops it (on an error).
    """

    def __init__(self, candidates: np.ndarray, counts: np.ndarray, *, seed: int, epoch: int,
                 background: bool = True, chunk: int | None = None):
        cand, k = np.ascontiguousarray(candidates), np.ascontiguousarray(counts)   # int32 stays int32
        if cand.dtype.kind not in "iu" or k.dtype.kind not in "iu" or cand.shape != k.shape or cand.ndim != 1:
            raise ConfigError("candidates and counts must be integer arrays of one length (one entry per sample id)")
        if len(k) and (int(k.min()) < 0 or (k > cand).any()):
            raise ConfigError("anchor counts must lie in 0..candidates")
        self._cand, self._k = cand, k
        self._chunk = int(chunk) if chunk else min(DIGEST_CHUNK, max(1 << 16, -(-len(cand) // 32)))
        self._top = int(cand.max()) if len(cand) else 0
        self._base = _base_key(seed, epoch)
        self._n_chunks = -(-len(cand) // self._chunk)
        self._next = self._hashed = 0
        self._ready: dict[int, np.ndarray] = {}
        self._free: list[np.ndarray] = []
        self._digest = AnchorDigest(len(cand))
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="anchor-digest", daemon=True)
        if background:
            self._thread.start()

    def _claim(self):
        with self._lock:
            if self._next >= self._n_chunks or self._error is not None:
                return None
            i = self._next
            self._next += 1
            buf = self._free.pop() if self._free else np.empty(self._chunk, np.uint64)
        return i, buf

    def _work(self) -> None:
        try:
            while (got := self._claim()) is not None:
                i, buf = got
                lo = i * self._chunk
                part = buf[:min(self._chunk, len(self._cand) - lo)]
                _count_hashes(self._cand, self._k, self._base, self._top, lo, part)
                with self._lock:
                    self._ready[i] = part
                    while self._hashed in self._ready:
                        done = self._ready.pop(self._hashed)
                        self._digest.update(done)
                        self._free.append(done.base if done.base is not None else done)
                        self._hashed += 1
        except BaseException as e:       # re-raised by result(), in the caller's thread
            with self._lock:
                self._error = self._error or e

    def cancel(self) -> None:
        with self._lock:
            self._next = self._n_chunks
        if self._thread.ident is not None:
            self._thread.join()

    def result(self) -> str:
        self._work()
        if self._thread.ident is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._digest.hexdigest()


def selection_digest(candidates: np.ndarray, counts: np.ndarray, *, seed: int, epoch: int) -> str:
    """The epoch's anchor digest (:class:`AnchorDigest`) from the per-sample counts alone.

    ``candidates`` and ``counts`` are indexed by sample id, over the whole dataset. With the
    dataset fingerprint (which pins every mask, so every rank -> position map) the digest
    fixes every anchor position. Both cores (:class:`DigestJob` and this thread).
    """
    return DigestJob(candidates, counts, seed=seed, epoch=epoch).result()


def position_hashes(loss_mask: np.ndarray, cu_seqlens: np.ndarray, sample_ids: np.ndarray, positions: np.ndarray,
                    offsets: np.ndarray) -> np.ndarray:
    """Each sample's digest hash (:class:`AnchorDigest`) from its anchor positions and mask
    (``n`` masks concatenated, as :func:`sample_anchors_batch` returns them); uint64 ``(n,)``.
    Positions that are not eligible leave the hash wrong: :func:`ineligible` names them."""
    mask = np.ascontiguousarray(loss_mask)
    mask = mask.view(np.uint8) if mask.dtype == np.bool_ else mask
    cu, off = np.ascontiguousarray(cu_seqlens, np.int64), np.ascontiguousarray(offsets, np.int64)
    ids = np.ascontiguousarray(sample_ids, np.int64)
    if len(off) != len(cu) or len(ids) + 1 != len(cu):
        raise ConfigError("position_hashes needs one cu_seqlens and one offsets entry per sample, plus one")
    out = np.empty(len(ids), np.uint64)
    if len(ids):
        _position_hashes(mask, cu, ids, np.ascontiguousarray(positions, np.int32), off, out)
    return out


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
