"""The manifests as a PyTorch object, for any trainer: HF Trainer, Lightning, torchtitan, a plain loop.

:class:`ManifestLoader` is a ``torch.utils.data.IterableDataset`` over (dataset, manifest
epochs, rank). It yields this rank's micro-batches in manifest order (step, then
accumulation slot), epoch after epoch, built on a background thread by
:class:`~dflash_prep.train.data.Prefetcher` (strictly FIFO). Our own trainer consumes the
same object through :meth:`ManifestLoader.steps`.

    from dflash_prep.train.loader import ManifestLoader
    loader = ManifestLoader.from_paths("data/tok", "data/tok/plan.json", "manifests",
                                       rank=rank, world_size=world, epochs=3)
    for batch in torch.utils.data.DataLoader(loader, batch_size=None):   # one micro-batch each
        loss = model(**batch).loss ...
    state = loader.state_dict()        # save with your checkpoint
    loader.load_state_dict(state)      # a rebuilt loader continues at the next micro-batch

Exact resume: the state is the cursor ``(epoch, step, micro)`` of the next micro-batch not
yet handed out (not the prefetcher's position), plus the fingerprint of the plan, so a
loader restored from it yields exactly the micro-batches a straight run would have yielded
next, and a state from another plan or world size is refused. Use ``DataLoader(...,
batch_size=None, num_workers=0)``: batches are already built ahead on a thread, and
worker processes would each hold a copy of the cursor.

Collation (``collate=``):

- ``"hf"`` (default), the transformers convention: ``labels`` are *not* shifted (the model
  shifts them): ``labels[t] = input_ids[t]`` where ``loss_mask[t] == 1``, else -100.
  Padded micro-batches give ``input_ids``, ``labels``, ``attention_mask`` (B, L) int64.
  Varlen micro-batches give one packed row: ``input_ids``, ``labels``, ``position_ids``
  (1, T) with positions restarting at 0 in every document and the first label of every
  document set to -100, so a label never crosses a document, plus ``cu_seq_lens_q`` /
  ``cu_seq_lens_k`` (int32, N+1) and ``max_length_q`` / ``max_length_k``, the keyword
  arguments transformers' flash-attention path reads for packed sequences. Every batch
  also carries ``num_items_in_batch``: this micro-batch's target count (labels != -100).
- ``"trainer"``: our trainer's :class:`~dflash_prep.train.data.Batch` (labels already
  shifted, see :mod:`dflash_prep.train.data`).

For loss normalisation across accumulation and ranks (definitions.md: divide by the targets of the
whole optimizer step), sum ``num_items_in_batch`` over the step's micro-batches and
all-reduce it, as our trainer does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

import torch

from dflash_prep.errors import ConfigError, FingerprintMismatch, FormatError

from dflash_prep.train.data import IGNORE, Batch, Prefetcher, StepBatches, iter_steps

STATE_FORMAT = "dflash-prep/loader-state"
STATE_VERSION = 1
COLLATES = ("hf", "trainer")


def hf_collate(b: Batch) -> dict:
    """A :class:`Batch` (shifted labels) in the transformers convention (unshifted labels)."""
    ids = b.input_ids
    lab = torch.full_like(b.labels, IGNORE)
    # our label at t is the target x[t+1] (or -100); unshifted, that target sits at t+1
    if b.layout == "padded":
        lab[:, 1:] = b.labels[:, :-1]
        L = ids.shape[1]
        attn = (torch.arange(L)[None, :] < b.lengths[:, None].long()).long()  # (B, L)
        out = {"input_ids": ids, "labels": lab, "attention_mask": attn}
    else:
        lab[1:] = b.labels[:-1]
        lab[b.cu_seqlens[:-1].long()] = IGNORE  # a document's first token is never a target of the previous one
        out = {"input_ids": ids[None], "labels": lab[None], "position_ids": b.position_ids[None],
               "cu_seq_lens_q": b.cu_seqlens, "cu_seq_lens_k": b.cu_seqlens,
               "max_length_q": int(b.max_seqlen), "max_length_k": int(b.max_seqlen)}
    out["num_items_in_batch"] = int(b.n_targets)
    return out


class ManifestLoader(torch.utils.data.IterableDataset):
    """One rank's micro-batches over the epochs ``epochs``, in manifest order, resumable.

    ``source`` is a :class:`~dflash_prep.train.source.FileSource` (or any object with its
    ``dataset``, ``plan_fingerprint`` and ``manifest(epoch)`` members). ``epochs`` is a count
    (epochs ``0..n-1``) or an explicit increasing sequence. ``world_size``, when given, must
    match every manifest's (a manifest balanced for other ranks is refused).
    """

    def __init__(self, source, *, rank: int = 0, world_size: int | None = None, epochs: int | Sequence[int] = 1,
                 collate: str = "hf", pad_id: int | None = None, pin: bool = False, prefetch: int = 4):
        if collate not in COLLATES:
            raise ConfigError(f"collate must be one of {', '.join(COLLATES)}, got {collate!r}")
        self.epochs = list(range(int(epochs))) if isinstance(epochs, int) else [int(e) for e in epochs]
        if not self.epochs or any(e < 0 for e in self.epochs) or self.epochs != sorted(set(self.epochs)):
            raise ConfigError(f"epochs must be a count >= 1 or increasing epoch numbers >= 0, got {epochs!r}")
        if rank < 0 or (world_size is not None and not 0 <= rank < world_size):
            raise ConfigError(f"rank {rank} is outside world size {world_size}")
        if prefetch < 1:
            raise ConfigError(f"prefetch must be >= 1, got {prefetch}")
        self.source, self.rank, self.world_size = source, int(rank), world_size
        self.collate, self.pin, self.prefetch = collate, pin, int(prefetch)
        if pad_id is None:
            from dflash_prep.train.source import tokenizer_field

            pad_id = int(tokenizer_field(source.dataset, "pad_id", 0))
        self.pad_id = int(pad_id)
        self._cursor = (self.epochs[0], 0, 0)   # (epoch, step, micro) of the next micro-batch handed out
        self.wait_s = 0.0
        self._opened: dict = {}

    @classmethod
    def from_paths(cls, data: str | Path, plan: str | Path, manifests: str | Path, **kw) -> "ManifestLoader":
        """A loader over the outputs of ``tokenize``, ``analyze`` and ``pack`` (missing epochs are an error)."""
        from dflash_prep.train.source import FileSource

        return cls(FileSource(data, plan, manifests, pack_missing=False), **kw)

    # --- resume ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        e, s, m = self._cursor
        return {"format": STATE_FORMAT, "version": STATE_VERSION, "epoch": e, "step": s, "micro": m,
                "rank": self.rank, "world_size": self.world_size, "epochs": list(self.epochs),
                "plan_fingerprint": str(self.source.plan_fingerprint)}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise FormatError(f"not a {STATE_FORMAT} state (got {type(state).__name__}); pass what state_dict() returned")
        if state.get("version") != STATE_VERSION:
            raise FormatError(f"{STATE_FORMAT} version {state.get('version')} is not supported (this is version "
                              f"{STATE_VERSION}); restart the epoch or use the dflash-prep that wrote it")
        if str(state["plan_fingerprint"]) != str(self.source.plan_fingerprint):
            raise FingerprintMismatch(f"loader state is from plan {state['plan_fingerprint']}, this loader reads plan "
                                      f"{self.source.plan_fingerprint}; resume with the plan the run started with")
        if (state["rank"], state["world_size"]) != (self.rank, self.world_size):
            raise ConfigError(f"loader state is for rank {state['rank']} of {state['world_size']}, this loader is rank "
                              f"{self.rank} of {self.world_size}; restore each rank's own state")
        e, s, m = int(state["epoch"]), int(state["step"]), int(state["micro"])
        if e not in self.epochs and e != self.epochs[-1] + 1:
            raise ConfigError(f"loader state points at epoch {e}, outside this loader's epochs {self.epochs}")
        self._cursor = (e, s, m)

    # --- iteration -----------------------------------------------------------------------
    def manifest(self, epoch: int):
        """The epoch's manifest, opened (and checked) once and kept."""
        if epoch not in self._opened:
            m = self.source.manifest(epoch)
            if self.world_size is not None and int(m.world_size) != self.world_size:
                raise ConfigError(f"manifest epoch {epoch} was packed for world size {m.world_size}, not "
                                  f"{self.world_size}; re-pack it with `dflash-prep pack --world-size {self.world_size}`")
            self._opened = {epoch: m}   # one epoch at a time: manifests are memory-mapped, not held
        return self._opened[epoch]

    def open_epoch(self, epoch: int, start_step: int = 0, build=None) -> Prefetcher:
        """This rank's steps ``start_step..`` of ``epoch`` as a FIFO :class:`Prefetcher` of
        :class:`StepBatches` (a context manager; ``wait_s`` is the consumer's blocked time).
        ``build(mb)`` replaces the default micro-batch builder (the trainer's objectives use it:
        a drafter batch adds anchors and blocks)."""
        it = iter_steps(self.source.dataset, self.manifest(epoch), self.rank, start_step=start_step,
                        pad_id=self.pad_id, pin=self.pin, build=build)
        return Prefetcher(it, self.prefetch)

    def steps(self, *, start: tuple[int, int] | None = None) -> Iterator[StepBatches]:
        """Whole optimizer steps (this rank's accumulation micro-batches) from ``start``
        ``(epoch, step)`` or the cursor, over the remaining epochs."""
        e0, s0 = (self._cursor[0], self._cursor[1]) if start is None else start
        for epoch in [e for e in self.epochs if e >= e0]:
            with self.open_epoch(epoch, s0 if epoch == e0 else 0) as pf:
                for sb in pf:
                    self._cursor = (epoch, sb.step + 1, 0)
                    yield sb
                self.wait_s += pf.wait_s
            self._cursor = (epoch + 1, 0, 0)

    def __iter__(self) -> Iterator:
        epoch, step, micro = self._cursor
        for sb in self.steps(start=(epoch, step)):
            skip = micro if (sb.epoch, sb.step) == (epoch, step) else 0
            for i, b in enumerate(sb.micro):
                if i < skip:
                    continue
                done = i + 1 == len(sb.micro)
                self._cursor = (sb.epoch, sb.step + 1, 0) if done else (sb.epoch, sb.step, i + 1)
                yield hf_collate(b) if self.collate == "hf" else b

