"""From manifest to tensors: one rank's micro-batches, in manifest order, prefetched FIFO.

Data flow: the tokenized dataset (Arrow shards, memory-mapped; ``ds.sample(i)`` returns
zero-copy ``int32`` ids and ``uint8`` loss mask) + the epoch manifest
(``m.microbatches(rank, start_step)``, manifest order) -> :func:`iter_steps` groups one
rank's micro-batches by optimizer step -> :class:`Prefetcher` builds them on a background
thread -> the training loop.

Labels (exact semantics, both layouts): for a sample with ids ``x[0..n-1]`` and loss mask
``m[0..n-1]``, position ``t`` predicts ``x[t+1]`` and its label is ``x[t+1]`` when
``m[t+1] == 1``, else ``-100`` (ignored). The last position of every sample has label
``-100``, so no label ever crosses a document boundary, padded or concatenated; padding
positions are ``-100`` too. ``n_targets`` counts the labels that are not ``-100``: the
real target tokens the loss is normalised by.

The loader is a pure function of (dataset, manifest, rank, start step): that is what lets a
resumed run see exactly the batches a straight run would have seen.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field, fields, replace
from typing import Iterable, Iterator

import numpy as np
import torch

from dflash_prep.errors import FormatError

IGNORE = -100


class TensorBatch:
    """A dataclass of one micro-batch's tensors and counts: every objective's batch type is one."""

    def to(self, device: torch.device):
        """A copy with every tensor field on ``device`` (non-blocking from pinned memory)."""
        moved = {f.name: v.to(device, non_blocking=True) for f in fields(self)
                 if isinstance(v := getattr(self, f.name), torch.Tensor)}
        return replace(self, **moved)


@dataclass
class Batch(TensorBatch):
    """One micro-batch as tensors (CPU, pinned when the trainer runs on CUDA).

    Padded: ``input_ids``/``labels`` are ``(B, L)`` int64, ``lengths`` is ``(B,)`` int32.
    Varlen: ``input_ids``/``labels``/``position_ids`` are ``(T,)`` int64, ``cu_seqlens`` is
    ``(N + 1,)`` int32 and ``max_seqlen`` the longest sample.
    """

    layout: str
    step: int
    accum: int
    sample_ids: np.ndarray
    input_ids: torch.Tensor
    labels: torch.Tensor
    n_targets: int
    real_tokens: int
    padded_tokens: int
    lengths: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    max_seqlen: int = 0

    def model_inputs(self) -> dict:
        if self.layout == "varlen":
            return {"cu_seqlens": self.cu_seqlens, "max_seqlen": self.max_seqlen, "position_ids": self.position_ids}
        return {"lengths": self.lengths}


@dataclass
class StepBatches:
    """Everything one rank feeds into one optimizer step (may be empty on a short step)."""

    epoch: int
    step: int
    micro: list[Batch] = field(default_factory=list)


def shifted_labels(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Labels for one sample: ``ids[t+1]`` where ``mask[t+1]``, else -100; last is -100."""
    out = np.full(ids.shape[0], IGNORE, np.int64)
    if ids.shape[0] > 1:
        out[:-1] = np.where(mask[1:] != 0, ids[1:], IGNORE)
    return out


def _vocab(ds) -> int | None:
    info = getattr(ds, "tokenizer_info", None)
    v = info.get("vocab_size") if isinstance(info, dict) else getattr(info, "vocab_size", None)
    return int(v) if v else None


def _read(ds, sid: int, expect_len: int | None, where: str, vocab: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    ids, mask = ds.sample(int(sid))
    if vocab is not None and ids.shape[0] and (int(ids.max()) >= vocab or int(ids.min()) < 0):
        bad = int(ids[(ids >= vocab) | (ids < 0)][0])
        shard = ds.shard_of(int(sid)) if hasattr(ds, "shard_of") else getattr(ds, "folder", "the dataset")
        raise FormatError(f"{shard}: sample {sid} holds token id {bad}, outside the vocabulary of {vocab} "
                          f"({where}); the shard is corrupt or was tokenized with another tokenizer. Run "
                          "`dflash-prep verify DATA`, then re-run `dflash-prep tokenize --overwrite`")
    if ids.shape[0] != mask.shape[0]:
        raise FormatError(f"{where}: sample {sid} has {ids.shape[0]} ids but {mask.shape[0]} mask entries; "
                          "the dataset is corrupt, re-run `dflash-prep tokenize --overwrite`")
    if expect_len is not None and ids.shape[0] > expect_len:
        raise FormatError(f"{where}: sample {sid} has {ids.shape[0]} tokens but the manifest's max_len is "
                          f"{expect_len}; the manifest belongs to other data, re-run `dflash-prep pack`")
    return ids, mask


@dataclass
class Documents:
    """A micro-batch's documents packed back to back (numpy): ``ids`` int64 / ``mask`` uint8 ``[T]``,
    ``lens`` int64 ``[D]``, ``cu`` int64 ``[D + 1]`` (document offsets), ``pos`` int64 ``[T]``
    (positions restarting per document), and ``where`` (the micro-batch, for error messages)."""

    sids: np.ndarray
    ids: np.ndarray
    mask: np.ndarray
    lens: np.ndarray
    cu: np.ndarray
    pos: np.ndarray
    where: str


def read_documents(ds, mb, *, epoch: int, vocab_size: int) -> Documents:
    """The documents of one manifest micro-batch, packed (any layout), for an objective that trains
    a drafter on a frozen target: every id must be a row of the target's vocabulary."""
    sids = np.asarray(mb.sample_ids, np.int64)
    where = f"epoch {epoch} step {mb.step} rank {mb.rank} accum {mb.accum}"
    if sids.shape[0] == 0:
        raise FormatError(f"{where}: empty micro-batch; the manifest is corrupt, re-run `dflash-prep pack`")
    samples = [_read(ds, s, None, where) for s in sids]
    lens = np.fromiter((a.shape[0] for a, _ in samples), np.int64, len(samples))
    T = int(lens.sum())
    if T > np.iinfo(np.int32).max:
        raise FormatError(f"{where}: {T} tokens overflow int32 cu_seqlens; lower the pack budget")
    ids = np.concatenate([a for a, _ in samples]).astype(np.int64)      # (T,)
    mask = np.concatenate([m for _, m in samples]).astype(np.uint8)     # (T,)
    if ids.size and (ids.max() >= vocab_size or ids.min() < 0):
        raise FormatError(f"{where}: token id {int(ids.max())} is outside the target's vocabulary ({vocab_size}); "
                          "the dataset was tokenized with another tokenizer: re-tokenize with the target's")
    cu = np.zeros(len(samples) + 1, np.int64)
    np.cumsum(lens, out=cu[1:])
    pos = np.arange(T, dtype=np.int64) - np.repeat(cu[:-1], lens)      # (T,) restarts per document
    return Documents(sids=sids, ids=ids, mask=mask, lens=lens, cu=cu, pos=pos, where=where)


def build_batch(ds, mb, layout: str, *, pad_id: int = 0, pin: bool = False) -> Batch:
    """Tensors for one manifest micro-batch (attributes per the manifest contract)."""
    sids = np.asarray(mb.sample_ids, np.int64)
    where = f"epoch step {mb.step} rank {mb.rank} accum {mb.accum}"
    if sids.shape[0] == 0:
        raise FormatError(f"{where}: empty micro-batch; the manifest is corrupt, re-run `dflash-prep pack`")
    vocab = _vocab(ds)
    samples = [_read(ds, s, int(mb.max_len) if layout == "padded" else None, where, vocab) for s in sids]
    lens = np.fromiter((a.shape[0] for a, _ in samples), np.int64, len(samples))
    real = int(lens.sum())
    if layout == "padded":
        B, L = len(samples), int(lens.max())
        ids = np.full((B, L), pad_id, np.int64)  # (B, L)
        lab = np.full((B, L), IGNORE, np.int64)  # (B, L)
        for r, (a, m) in enumerate(samples):
            ids[r, : a.shape[0]] = a
            lab[r, : a.shape[0]] = shifted_labels(a, m)
        out = dict(lengths=torch.from_numpy(lens.astype(np.int32)))
        padded = B * L
    elif layout == "varlen":
        if real > np.iinfo(np.int32).max:
            raise FormatError(f"{where}: {real} tokens overflow int32 cu_seqlens; lower the pack budget")
        ids = np.concatenate([a for a, _ in samples]).astype(np.int64)  # (T,)
        lab = np.concatenate([shifted_labels(a, m) for a, m in samples])  # (T,)
        cu = np.zeros(len(samples) + 1, np.int32)
        cu[1:] = np.cumsum(lens)  # fits: real <= int32 max was checked above
        pos = np.arange(real, dtype=np.int64) - np.repeat(cu[:-1].astype(np.int64), lens)  # (T,) restarts per sample
        out = dict(cu_seqlens=torch.from_numpy(cu), position_ids=torch.from_numpy(pos), max_seqlen=int(lens.max()))
        padded = real
    else:
        raise FormatError(f"{where}: unknown manifest layout {layout!r} (expected 'padded' or 'varlen')")
    ids_t, lab_t = torch.from_numpy(ids), torch.from_numpy(lab)
    if pin:
        ids_t, lab_t = ids_t.pin_memory(), lab_t.pin_memory()
        out = {k: (v.pin_memory() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}
    return Batch(layout=layout, step=int(mb.step), accum=int(mb.accum), sample_ids=sids, input_ids=ids_t,
                 labels=lab_t, n_targets=int((lab != IGNORE).sum()), real_tokens=real, padded_tokens=int(padded), **out)


def iter_steps(ds, manifest, rank: int, *, start_step: int = 0, pad_id: int = 0,
               pin: bool = False, build=None) -> Iterator[StepBatches]:
    """Yield one :class:`StepBatches` per step ``start_step .. num_steps-1``, in manifest order.

    ``build(mb)`` turns a manifest micro-batch into the objective's batch (default
    :func:`build_batch` in the manifest's layout).

    Every rank yields every step, even one where it holds no micro-batch, so all ranks
    make the same collective calls and never deadlock on unequal counts.
    """
    n_steps = int(manifest.num_steps)
    cur = StepBatches(int(manifest.epoch), int(start_step))
    for mb in manifest.microbatches(rank, start_step=start_step):
        s = int(mb.step)
        if s < cur.step:
            raise FormatError(f"manifest epoch {manifest.epoch}: rank {rank} micro-batch for step {s} comes after "
                              f"step {cur.step}; the manifest is not in step order, re-run `dflash-prep pack`")
        while cur.step < s:
            yield cur
            cur = StepBatches(cur.epoch, cur.step + 1)
        cur.micro.append(build(mb) if build is not None else build_batch(ds, mb, manifest.layout, pad_id=pad_id,
                                                                         pin=pin))
    while cur.step < n_steps:
        yield cur
        cur = StepBatches(cur.epoch, cur.step + 1)


class _Raised:
    def __init__(self, exc: Exception):
        self.exc = exc


_END = object()


class Prefetcher:
    """Run an iterator on a background thread, ``depth`` items ahead, strictly FIFO.

    One producer thread, one bounded ``queue.Queue``: items come out in exactly the order
    the iterator produced them, never reordered by which is ready first (seed 2's bug). An
    exception in the producer is re-raised in the consumer at the position it happened.
    ``wait_s`` accumulates the time the consumer spent blocked (the data-wait figure).
    """

    def __init__(self, it: Iterable, depth: int = 4):
        self._it = iter(it)
        self._q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self.wait_s = 0.0
        self._thread = threading.Thread(target=self._run, name="dflash-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for item in self._it:
                if not self._put(item):
                    return
        except Exception as e:  # handed to the consumer, re-raised there
            self._put(_Raised(e))
            return
        self._put(_END)

    def __iter__(self):
        return self

    def __next__(self):
        t0 = time.perf_counter()
        item = self._q.get()
        self.wait_s += time.perf_counter() - t0
        if item is _END:
            self._q.put(_END)  # stay exhausted
            raise StopIteration
        if isinstance(item, _Raised):
            raise item.exc
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
