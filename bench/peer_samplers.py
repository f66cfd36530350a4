"""The samplers and packers users would pick instead of dflash-prep, one epoch at a time.

Every peer returns a :class:`PeerEpoch`: ``order`` and ``offsets`` as int64 arrays in the
layout of :mod:`dflash_prep.pack.metrics` (micro-batch ``m`` is ``order[offsets[m]:offsets[m+1]]``),
in the order the peer yields micro-batches. A step at W ranks, A = 1 is W consecutive
micro-batches and the rank is the position inside the step, which is how each peer feeds
DDP: Lhotse's sampler draws W batches per step from one bucket (``sync_buckets``); HF
Accelerate and fairseq's ``ShardedIterator`` hand batch ``i`` to rank ``i % W``.

Which code runs (``PeerEpoch.impl`` says so in every result):

- Lhotse ``DynamicBucketingSampler`` + ``estimate_duration_buckets`` (the function behind
  ``estimate_duration_bins``): the real package, driven with dummy items whose
  ``duration`` is the token length, so ``max_duration`` is the token budget T and its
  ``TimeConstraint`` is exactly ``n * max_len <= T``.
- HF transformers ``LengthGroupedSampler``: the real class; fixed batch size, no budget.
- fairseq ``batch_by_size``: reimplemented from ``data_utils_fast.batch_by_size_vec``
  (fairseq does not install on Python 3.11 with current torch): a global sort by length,
  batches fixed once with ``required_batch_size_multiple = 8`` (its default), and only
  the batch order reshuffled per epoch with ``numpy_seed(seed + epoch)``.
- TRL best-fit-decreasing: the real ``trl.data_utils._pack_bfd`` applied per 1000-row
  chunk, as ``pack_dataset`` does through ``datasets.map(batched=True)`` (default batch
  size 1000); a faithful numba reimplementation (same segment tree, same FIFO tie rule)
  is used, and marked, when TRL is not installed. Packing is static; the trainer's
  random sampler only reorders the packed rows per epoch.
- full random: a keyed permutation per epoch, then greedy packing under T.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba as nb
import numpy as np

from dflash_prep.errors import ConfigError
from dflash_prep.formats.plan import Budget
from dflash_prep.pack.bucketing import greedy_offsets
from dflash_prep.pack.keyed import keyed_permutation, mix_key


@dataclass(frozen=True)
class PeerEpoch:
    """One epoch of one peer.

    Attributes:
        order: int64 sample ids, micro-batch after micro-batch.
        offsets: int64, ``M + 1`` entries, starts at 0.
        varlen: True when a micro-batch is a concatenation (no padding), so fill, not
            padding efficiency, is the measure.
        impl: ``"package X.Y"`` when the peer's own code ran, ``"reimplementation"`` otherwise.
    """

    order: np.ndarray
    offsets: np.ndarray
    varlen: bool
    impl: str

    def __post_init__(self):
        if self.order.dtype != np.int64 or self.offsets.dtype != np.int64:
            raise ConfigError("a PeerEpoch holds int64 order and offsets")
        if len(self.offsets) == 0 or self.offsets[0] != 0 or self.offsets[-1] != len(self.order):
            raise ConfigError("PeerEpoch offsets must start at 0 and end at len(order)")

    @property
    def num_batches(self) -> int:
        return len(self.offsets) - 1


def consecutive_steps(num_batches: int, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Step and rank of each micro-batch when W consecutive micro-batches form a step (A = 1)."""
    m = np.arange(num_batches, dtype=np.int64)
    return m // world_size, m % world_size


def _from_batches(batches: list, impl: str, varlen: bool = False) -> PeerEpoch:
    sizes = np.fromiter((len(b) for b in batches), np.int64, len(batches))
    offsets = np.zeros(len(batches) + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    order = np.fromiter((i for b in batches for i in b), np.int64, int(offsets[-1]))
    return PeerEpoch(order, offsets, varlen, impl)


def _version(pkg: str) -> str:
    from importlib.metadata import version
    return f"package {pkg} {version(pkg)}"


# ----------------------------------------------------------------------------- full random
def full_random_epoch(lengths: np.ndarray, *, budget: int, seed: int, epoch: int) -> PeerEpoch:
    """Shuffle everything (keyed by seed, epoch), then greedy-pack under ``n * max_len <= T``."""
    order = keyed_permutation(len(lengths), seed, epoch, 0)
    return PeerEpoch(order, greedy_offsets(order, lengths, Budget(value=budget)), False,
                     "reference (dflash_prep.pack.bucketing)")


# ----------------------------------------------------------------------------- Lhotse
class _Item:
    """The least a Lhotse sampler reads from a cut: ``id`` and ``duration`` (= token length)."""

    __slots__ = ("id", "duration")

    def __init__(self, i: int, d: float):
        self.id = i
        self.duration = d


class Lhotse:
    """Lhotse ``DynamicBucketingSampler`` over dummy items; built once, iterated per epoch.

    ``num_buckets``: when ``bins_from_all`` is True, boundaries come from
    ``estimate_duration_buckets`` over all lengths (equal token mass per bucket, as
    ``estimate_duration_bins`` does); otherwise the sampler estimates them itself from its
    first ``num_cuts_for_bins_estimate`` (10,000) items, its default behaviour.
    """

    def __init__(self, lengths: np.ndarray, *, budget: int, num_buckets: int, world_size: int,
                 seed: int, bins_from_all: bool = True):
        from lhotse.dataset.sampling.dynamic_bucketing import DynamicBucketingSampler, estimate_duration_buckets

        self.items = [_Item(i, float(x)) for i, x in enumerate(np.asarray(lengths).tolist())]
        bins = estimate_duration_buckets(self.items, num_buckets) if bins_from_all else None
        self.sampler = DynamicBucketingSampler(
            self.items, max_duration=float(budget), num_buckets=num_buckets, duration_bins=bins,
            shuffle=True, drop_last=False, world_size=world_size, rank=0, seed=seed)
        self.boundaries = [float(b) for b in self.sampler.duration_bins]
        self.impl = _version("lhotse")

    def epoch(self, epoch: int) -> PeerEpoch:
        """All ranks' micro-batches of one epoch, in the order the ranks consume them.

        ``CutSampler.__next__`` draws ``world_size`` batches per step and keeps one; we read
        ``_next_batch`` directly to keep all W. The final partial step is kept as is
        (Lhotse would re-split it so that every rank gets some samples).
        """
        self.sampler.set_epoch(epoch)
        iter(self.sampler)
        batches = []
        while True:
            try:
                batch = self.sampler._next_batch()
            except StopIteration:
                break
            batches.append([c.id for c in batch])
        return _from_batches(batches, self.impl)


# ----------------------------------------------------------------------------- HF transformers
def hf_length_grouped_epoch(lengths: np.ndarray, *, batch_size: int, seed: int, epoch: int) -> PeerEpoch:
    """``transformers.trainer_pt_utils.LengthGroupedSampler``: random permutation, mega-batches
    of 50 x batch sorted by length (longest first), consecutive chunks of ``batch_size``.
    The generator is seeded with ``seed + epoch``, as ``Trainer`` reseeds per epoch."""
    import torch
    from transformers.trainer_pt_utils import LengthGroupedSampler

    g = torch.Generator()
    g.manual_seed(int(mix_key(seed, epoch)) & 0x7FFF_FFFF_FFFF_FFFF)
    sampler = LengthGroupedSampler(batch_size, lengths=np.asarray(lengths).tolist(), generator=g)
    order = np.fromiter(iter(sampler), np.int64, len(lengths))
    n = len(order)
    offsets = np.append(np.arange(0, n, batch_size, dtype=np.int64), np.int64(n))
    return PeerEpoch(order, offsets, False, _version("transformers"))


# ----------------------------------------------------------------------------- fairseq
@nb.njit(cache=True)
def _batch_by_size_vec(indices, num_tokens, max_tokens, max_sentences, bsz_mult):
    # Line-by-line port of fairseq/data/data_utils_fast.pyx::batch_by_size_vec.
    n = indices.shape[0]
    ends = np.zeros(n + 1, np.int64)
    count = 0
    batch_start = 0
    tail_max = 0
    batch_max = 0
    for pos in range(n):
        t = num_tokens[indices[pos]]
        tail_max = tail_max if tail_max > t else t
        new_end = pos + 1
        new_max = batch_max if batch_max > tail_max else tail_max
        new_sent = new_end - batch_start
        overflow = (max_sentences > 0 and new_sent > max_sentences) or (max_tokens > 0 and new_sent * new_max > max_tokens)
        size_ok = new_sent < bsz_mult or new_sent % bsz_mult == 0
        if overflow:
            tail_tokens = tail_max * (new_end - ends[count])
            if max_tokens > 0 and tail_tokens > max_tokens:
                count += 1
                ends[count] = pos
                tail_max = num_tokens[indices[pos]]
            batch_start = ends[count]
            count += 1
            new_max = tail_max
        if overflow or size_ok:
            ends[count] = new_end
            batch_max = new_max
            tail_max = 0
    if ends[count] != n:
        count += 1
        ends[count] = n
    offsets = np.zeros(count + 2, np.int64)  # batch j is indices[offsets[j]:offsets[j+1]]
    offsets[1:] = ends[: count + 1]
    return offsets


class FairseqBatchBySize:
    """fairseq's ``batch_by_size`` (reimplemented): sort once, batch once, shuffle batch order.

    ``ordered_indices``: a random permutation under ``numpy_seed(seed)``, then a stable sort
    by length, so ties are random and lengths ascend. Batches are fixed for the whole run.
    """

    impl = "reimplementation (fairseq batch_by_size_vec, bsz_mult=8)"

    def __init__(self, lengths: np.ndarray, *, budget: int, seed: int, required_batch_size_multiple: int = 8):
        lens = np.asarray(lengths, np.int64)
        perm = np.random.RandomState(seed).permutation(len(lens)).astype(np.int64)
        self.indices = perm[np.argsort(lens[perm], kind="mergesort")]
        self.ends = _batch_by_size_vec(self.indices, lens, np.int64(budget), np.int64(0),
                                       np.int64(required_batch_size_multiple))
        self.seed = seed

    def epoch(self, epoch: int) -> PeerEpoch:
        """``EpochBatchIterator``: ``np.random.shuffle(batches)`` under ``numpy_seed(seed + epoch)``."""
        nb_ = len(self.ends) - 1
        perm = np.random.RandomState(self.seed + epoch).permutation(nb_)
        starts, stops = self.ends[:-1][perm], self.ends[1:][perm]
        sizes = (stops - starts).astype(np.int64)
        offsets = np.zeros(nb_ + 1, np.int64)
        np.cumsum(sizes, out=offsets[1:])
        # gather the batches in shuffled order: position p of output batch j is indices[starts[j] + p]
        pos = np.repeat(starts - offsets[:-1], sizes) + np.arange(int(offsets[-1]), dtype=np.int64)
        return PeerEpoch(self.indices[pos], offsets, False, self.impl)


# ----------------------------------------------------------------------------- TRL BFD
@nb.njit(cache=True)
def _set(tree, size, val, on):
    i = size + val - 1
    tree[i] = val if on else 0
    while i > 1:
        i >>= 1
        a = tree[2 * i]
        b = tree[2 * i + 1]
        tree[i] = a if a >= b else b


@nb.njit(cache=True)
def _bfd_bins(lens_desc, seq_length):
    # TRL's _pack_bfd: a max segment tree over "free space" values 1..seq_length finds the
    # smallest open space >= length; bins with equal space are used first-in first-out.
    size = 1
    while size < seq_length:
        size <<= 1
    tree = np.zeros(2 * size, np.int64)
    n = lens_desc.shape[0]
    head = np.full(seq_length + 1, -1, np.int64)
    tail = np.full(seq_length + 1, -1, np.int64)
    nxt = np.full(n + 1, -1, np.int64)
    bin_of = np.empty(n, np.int64)
    n_bins = 0

    _set(tree, size, seq_length, True)
    for k in range(n):
        L = lens_desc[k]
        i = 1
        while i < size:
            i = 2 * i if tree[2 * i] >= L else 2 * i + 1
        space = tree[i]
        if space < seq_length:
            b = head[space]
            head[space] = nxt[b]
            if head[space] == -1:
                tail[space] = -1
                _set(tree, size, space, False)
        else:
            b = n_bins
            n_bins += 1
        bin_of[k] = b
        space -= L
        nxt[b] = -1
        if tail[space] == -1:
            head[space] = b
        else:
            nxt[tail[space]] = b
        tail[space] = b
        if space > 0:
            _set(tree, size, space, True)
    return bin_of, n_bins


def bfd_pack_reimpl(lengths: np.ndarray, seq_length: int) -> list[list[int]]:
    """Bins (lists of positions into ``lengths``) exactly as TRL's ``_pack_bfd`` forms them."""
    lens = np.asarray(lengths, np.int64)
    desc = np.argsort(-lens, kind="stable")  # pyarrow's descending sort is stable too
    bin_of, n_bins = _bfd_bins(lens[desc], int(seq_length))
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    for pos, b in zip(desc.tolist(), bin_of.tolist()):
        bins[b].append(pos)
    return bins


def bfd_pack_trl(lengths: np.ndarray, seq_length: int) -> list[list[int]]:
    """Bins from TRL's own ``_pack_bfd`` on a one-column table (values = the sample position)."""
    import pyarrow as pa
    from trl.data_utils import _pack_bfd

    lens = np.asarray(lengths, np.int64)
    offsets = np.zeros(len(lens) + 1, np.int32)
    np.cumsum(lens, out=offsets[1:])
    values = np.repeat(np.arange(len(lens), dtype=np.int32), lens)
    table = pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))})
    out = _pack_bfd(table, seq_length=int(seq_length))
    flat = out["input_ids"].combine_chunks().flatten().to_numpy()
    row_off = out["input_ids"].combine_chunks().offsets.to_numpy()
    seg = out["seq_lengths"].combine_chunks()
    seg_lens = seg.flatten().to_numpy().astype(np.int64)
    seg_off = seg.offsets.to_numpy()
    bins = []
    for r in range(len(out)):
        starts = row_off[r] + np.concatenate([[0], np.cumsum(seg_lens[seg_off[r]:seg_off[r + 1]])[:-1]])
        bins.append(flat[starts].astype(np.int64).tolist())
    return bins


class TrlBfd:
    """TRL ``pack_dataset(strategy="bfd")``: packed once, in map chunks of ``chunk`` rows.

    Each packed row (at most ``seq_length`` = T tokens, concatenated) is one varlen
    micro-batch. Per epoch only the order of packed rows changes (the trainer's random
    sampler, keyed by (seed, epoch)), so the composition never changes.
    """

    def __init__(self, lengths: np.ndarray, *, budget: int, seed: int, chunk: int = 1000, use_trl: bool | None = None):
        if use_trl is None:
            try:
                from trl.data_utils import _pack_bfd  # noqa: F401  (private: absent in some versions)
                use_trl = True
            except ImportError:
                use_trl = False
        pack = bfd_pack_trl if use_trl else bfd_pack_reimpl
        self.impl = _version("trl") if use_trl else "reimplementation (TRL _pack_bfd)"
        lens = np.asarray(lengths, np.int64)
        self.bins: list[list[int]] = []
        for s in range(0, len(lens), chunk):
            self.bins.extend([[s + i for i in b] for b in pack(lens[s:s + chunk], budget)])
        self.seed = seed

    def epoch(self, epoch: int) -> PeerEpoch:
        perm = keyed_permutation(len(self.bins), self.seed, epoch, 0)
        return _from_batches([self.bins[i] for i in perm.tolist()], self.impl, varlen=True)
