"""The anchor digest: one hash over every sample's anchor positions in an epoch, two ways.

pack digests the draw from the per-sample counts alone (:class:`DigestJob`, on a second core
while the first packs; :func:`selection_digest`), without reading a mask; verify digests the
positions it regenerates from the masks (:func:`position_hashes` into an
:class:`AnchorDigest`). Both hash a sample as the bitmap of its drawn ranks among its
candidates, keyed by its id (:func:`_sample_hash`), so the two agree exactly when the sampler
(:mod:`dflash_prep.objectives.anchors`) reproduces itself. The digest is prefixed with the
sampler's and the scheme's versions (:data:`DIGEST_PREFIX`).
"""

from __future__ import annotations

import hashlib
import threading

import numba as nb
import numpy as np

from dflash_prep.errors import ConfigError
from dflash_prep.formats.fileio import FINGERPRINT_HEX
from dflash_prep.objectives.anchors import SAMPLER_VERSION, _base_key, _draw, _fold

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
