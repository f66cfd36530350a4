"""The per-epoch manifest: on-disk format and the public loader.

One folder per epoch, ``<root>/epoch-000N/`` (:func:`epoch_dir`), written atomically
(built in a temp folder, renamed into place) by ``dflash-prep pack``:

``manifest.json`` (format ``dflash-prep/manifest``, version 1)
    epoch, layout (``padded`` | ``varlen``), world_size, grad_accum, num_steps,
    num_microbatches, budget, options, ``plan_fingerprint``, ``data`` (kind, path,
    fingerprint, num_samples), ``inputs_fingerprint`` (plan + options + epoch: what the
    epoch is a pure function of), ``arrays`` (dtype, shape and SHA-256 of every array),
    ``fingerprint`` (of all of the above: the epoch's identity), ``summary`` (metrics).
``microbatches.npy``  int64 ``(M, 10)``, one row per micro-batch in manifest order
    (step, then rank, then accumulation index); columns :data:`COLUMNS`:
    ``start, count`` index ``sample_ids``; ``step, rank, accum``; ``bucket`` (-1 in
    varlen); ``max_len``; ``real_tokens``; ``padded_tokens`` (``count * max_len`` padded,
    ``real_tokens`` varlen); ``sum_sq_len`` (sum of L^2: the attention cost).
``sample_ids.npy``  int64 ``(N_used,)``: dataset row ids, micro-batch after micro-batch.
``sample_lens.npy`` int32 ``(N_used,)``: their lengths, so a trainer needs no shard to
    build masks or positions.
``cu_seqlens.npy``  int64 ``(N_used + M,)``, varlen only: micro-batch ``m`` owns entries
    ``[start + m, start + m + count]``, ``0, L0, L0+L1, ...``.
``dropped_ids.npy`` int64: samples left out by ``--drop-last`` (empty otherwise).

Every row of a step has the same ``world_size * grad_accum`` micro-batches, so row
``m`` is step ``m // (W*A)``, rank ``(m % (W*A)) // A``, accum ``m % A``.
:func:`open` memory-maps the arrays and checks format, version, shapes and (optionally)
fingerprints; ``dflash-prep verify`` (:mod:`dflash_prep.verify`) re-hashes and
recomputes everything.

World size is not elastic: a manifest packed for ``W x A`` is refused under any other
``W' x A'`` (:meth:`Manifest.check_world`), because its steps were balanced for ``W``
ranks. Re-pack the epoch with the new ``--world-size`` instead; the samples of every step
before the resume point are those the old manifest listed, so resume at a step boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from .errors import ConfigError, FingerprintMismatch, FormatError
from .fileio import atomic_dir, atomic_save_npy, atomic_write_json, fingerprint_array, fingerprint_json, load_npy, read_json

MANIFEST_FORMAT = "dflash-prep/manifest"
MANIFEST_VERSION = 1
MANIFEST_FILE = "manifest.json"
COLUMNS = ("start", "count", "step", "rank", "accum", "bucket", "max_len", "real_tokens", "padded_tokens", "sum_sq_len")
COL = {name: i for i, name in enumerate(COLUMNS)}
ARRAYS = {"microbatches": np.int64, "sample_ids": np.int64, "sample_lens": np.int32,
          "cu_seqlens": np.int64, "dropped_ids": np.int64}
LAYOUTS = ("padded", "varlen")


def epoch_dir(root: str | Path, epoch: int) -> Path:
    """``<root>/epoch-000N``: where epoch ``N`` of a manifest root lives."""
    if int(epoch) < 0:
        raise ConfigError(f"epoch must be >= 0, got {epoch}")
    return Path(root) / f"epoch-{int(epoch):04d}"


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as the trainer sees it (arrays are views of the memory-mapped files)."""

    index: int                  # row in the manifest
    step: int
    rank: int
    accum: int
    bucket: int                 # -1 in the varlen layout
    sample_ids: np.ndarray      # int64 dataset row ids
    sample_lens: np.ndarray     # int32 lengths of those rows
    max_len: int                # the padded row length (padded layout)
    real_tokens: int
    padded_tokens: int
    sum_sq_len: int
    cu_seqlens: np.ndarray | None   # int64 (count + 1,), varlen only


def array_identity(arrays: dict[str, np.ndarray]) -> dict:
    return {name: {"dtype": str(a.dtype), "shape": list(a.shape), "sha256": fingerprint_array(a)}
            for name, a in sorted(arrays.items())}


def epoch_fingerprint(header: dict) -> str:
    """Fingerprint of everything but the summary: identity, options and array hashes."""
    return fingerprint_json({k: v for k, v in header.items() if k not in ("fingerprint", "summary", "format", "version")})


def write(path: str | Path, header: dict, arrays: dict[str, np.ndarray], *, overwrite: bool = False) -> Path:
    """Write one epoch folder atomically; ``header`` gains ``arrays`` and ``fingerprint``."""
    missing = [n for n in ARRAYS if n not in arrays and not (n == "cu_seqlens" and header["layout"] == "padded")]
    if missing:
        raise ValueError(f"manifest.write: missing arrays {missing}")
    header = dict(header, arrays=array_identity(arrays))
    header["fingerprint"] = epoch_fingerprint(header)
    path = Path(path)
    with atomic_dir(path, overwrite=overwrite) as tmp:
        for name, a in arrays.items():
            atomic_save_npy(tmp / f"{name}.npy", a)
        atomic_write_json(tmp / MANIFEST_FILE, header, format=MANIFEST_FORMAT, version=MANIFEST_VERSION)
    return path


class Manifest:
    """A memory-mapped epoch manifest (see the module docstring for the format)."""

    def __init__(self, path: Path, header: dict, arrays: dict[str, np.ndarray]):
        self.path = path
        self.header = header
        self.arrays = arrays
        self.table = arrays["microbatches"]

    # -- header fields the trainer uses
    epoch = property(lambda self: int(self.header["epoch"]))
    layout = property(lambda self: self.header["layout"])
    world_size = property(lambda self: int(self.header["world_size"]))
    grad_accum = property(lambda self: int(self.header["grad_accum"]))
    num_steps = property(lambda self: int(self.header["num_steps"]))
    num_microbatches = property(lambda self: int(self.header["num_microbatches"]))
    plan_fingerprint = property(lambda self: self.header["plan_fingerprint"])
    data_fingerprint = property(lambda self: self.header["data"]["fingerprint"])
    fingerprint = property(lambda self: self.header["fingerprint"])
    summary = property(lambda self: dict(self.header.get("summary", {})))
    meta = property(lambda self: {k: v for k, v in self.header.items() if k not in ("arrays", "summary")})
    sample_ids = property(lambda self: self.arrays["sample_ids"])
    sample_lens = property(lambda self: self.arrays["sample_lens"])
    dropped_ids = property(lambda self: self.arrays["dropped_ids"])

    def check_world(self, world_size: int, grad_accum: int) -> None:
        """Refuse a trainer whose ``W x A`` differs from the one this epoch was packed for."""
        if (int(world_size), int(grad_accum)) != (self.world_size, self.grad_accum):
            raise ConfigError(
                f"{self.path}: packed for world size {self.world_size} x grad accum {self.grad_accum}, but the trainer "
                f"runs {world_size} x {grad_accum}; steps are not elastic. Re-pack with `dflash-prep pack --world-size "
                f"{world_size} --grad-accum {grad_accum} --overwrite` and resume at a step boundary")

    def microbatch(self, index: int) -> MicroBatch:
        row = self.table[index]
        s, n = int(row[COL["start"]]), int(row[COL["count"]])
        cu = None
        if self.layout == "varlen":
            cu = self.arrays["cu_seqlens"][s + index: s + index + n + 1]
        return MicroBatch(index=int(index), step=int(row[COL["step"]]), rank=int(row[COL["rank"]]),
                          accum=int(row[COL["accum"]]), bucket=int(row[COL["bucket"]]),
                          sample_ids=self.sample_ids[s:s + n], sample_lens=self.sample_lens[s:s + n],
                          max_len=int(row[COL["max_len"]]), real_tokens=int(row[COL["real_tokens"]]),
                          padded_tokens=int(row[COL["padded_tokens"]]), sum_sq_len=int(row[COL["sum_sq_len"]]),
                          cu_seqlens=cu)

    def microbatches(self, rank: int, start_step: int = 0) -> Iterator[MicroBatch]:
        """Rank ``rank``'s micro-batches in manifest order (step, then accum) from ``start_step``."""
        if not 0 <= int(rank) < self.world_size:
            raise ConfigError(f"{self.path}: rank {rank} is outside world size {self.world_size}")
        if not 0 <= int(start_step) <= self.num_steps:
            raise ConfigError(f"{self.path}: start step {start_step} is outside 0..{self.num_steps}")
        per_step = self.world_size * self.grad_accum
        for step in range(int(start_step), self.num_steps):
            base = step * per_step + int(rank) * self.grad_accum
            for a in range(self.grad_accum):
                yield self.microbatch(base + a)

    def step_real_tokens(self, step: int) -> int:
        """Real tokens of a whole optimizer step: the loss normaliser (all ranks, all accum)."""
        per_step = self.world_size * self.grad_accum
        return int(self.table[step * per_step:(step + 1) * per_step, COL["real_tokens"]].sum())


def read_header(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise FormatError(f"{path}: manifest folder not found; run `dflash-prep pack --epoch N --out ROOT` "
                          "(epochs live in ROOT/epoch-000N)")
    return read_json(path / MANIFEST_FILE, format=MANIFEST_FORMAT, versions=(MANIFEST_VERSION,))


def open(path: str | Path, *, plan_fingerprint: str | None = None, data_fingerprint: str | None = None) -> Manifest:  # noqa: A001
    """Open an epoch folder memory-mapped.

    Checks the format name and version, that every array is present, readable and of the
    recorded dtype and shape, and the given fingerprints; each failure is a
    :class:`FormatError` / :class:`FingerprintMismatch` naming the file and the fix.
    Array contents are re-hashed only by ``verify``.
    """
    path = Path(path)
    header = read_header(path)
    arrays = {}
    for name, meta in header.get("arrays", {}).items():
        if name not in ARRAYS:
            raise FormatError(f"{path}: unknown array {name!r} in {MANIFEST_FILE}; re-pack with this dflash-prep")
        a = load_npy(path / f"{name}.npy", dtype=ARRAYS[name])
        if list(a.shape) != list(meta["shape"]):
            raise FormatError(f"{path / (name + '.npy')}: shape {list(a.shape)} but {MANIFEST_FILE} records "
                              f"{meta['shape']}; the manifest is corrupt, re-pack the epoch with --overwrite")
        arrays[name] = a
    for name in ARRAYS:
        if name not in arrays and not (name == "cu_seqlens" and header.get("layout") == "padded"):
            raise FormatError(f"{path}: {name}.npy is not listed in {MANIFEST_FILE}; the manifest is corrupt, re-pack it")
    m = Manifest(path, header, arrays)
    if m.table.ndim != 2 or m.table.shape != (m.num_microbatches, len(COLUMNS)):
        raise FormatError(f"{path}: microbatches.npy has shape {m.table.shape}, expected ({m.num_microbatches}, "
                          f"{len(COLUMNS)}); re-pack the epoch with --overwrite")
    if plan_fingerprint is not None and plan_fingerprint != m.plan_fingerprint:
        raise FingerprintMismatch(f"{path}: packed from plan {m.plan_fingerprint}, not from plan {plan_fingerprint}; "
                                  "re-pack with the current plan (`dflash-prep pack --overwrite`)")
    if data_fingerprint is not None and data_fingerprint != m.data_fingerprint:
        raise FingerprintMismatch(f"{path}: packed for data {m.data_fingerprint}, not for data {data_fingerprint}; "
                                  "re-run analyze and pack for this dataset")
    return m
