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
    ``start, count`` (the micro-batch is ``sample_ids[start:start + count]``); ``step,
    rank, accum``; ``bucket`` (-1 in varlen); ``max_len``; ``real_tokens``;
    ``padded_tokens`` (``count * max_len`` padded, ``real_tokens`` varlen); ``sum_sq_len``
    (sum of L^2: the attention cost).
``sample_ids.npy``  int64 ``(N_used,)``: dataset row ids. The rows' segments tile it
    exactly, in packing order rather than row order (writing it in row order would cost
    an N-sized gather, seconds and an N-sized temporary at 100M samples).
``sample_lens.npy`` int32 ``(N_used,)``: their lengths, so a trainer needs no shard to
    build masks or positions.
``cu_seqlens.npy``  int64 ``(N_used + 1,)``, varlen only: prefix sums of ``sample_lens``;
    a micro-batch's ``cu_seqlens`` is ``cu[start:start + count + 1] - cu[start]``.
``dropped_ids.npy`` int64, sorted: samples left out by ``--drop-last`` (empty otherwise).
``anchor_counts.npy`` int32 ``(N_used,)``, ``--objective dflash`` only: anchors of each
    ``sample_ids`` entry; ``manifest.json``'s ``dflash`` block records B, max_anchors, the
    policy, the anchor seed, the budgets, the cost model and the anchor digest
    (:mod:`dflash_prep.objectives.dflash`). ``anchors.npy`` int32 (``--store-anchors``): every
    anchor position within its sample, concatenated in ``sample_ids`` order.
``d2t.npy`` int64 ``(V_d,)`` and ``t2d.npy`` bool ``(V,)``, ``--objective eagle3`` only: the
    draft vocabulary map (:mod:`dflash_prep.objectives.eagle3.vocab_map`), recorded in
    ``manifest.json``'s ``eagle3`` block with its fingerprint and the token counts'.

Every row of a step has the same ``world_size * grad_accum`` micro-batches, so row
``m`` is step ``m // (W*A)``, rank ``(m % (W*A)) // A``, accum ``m % A``.

The root holds ``root.json`` (format ``dflash-prep/manifest-root``): the ``run`` (plan
fingerprint and pack options, without the epoch) its epochs were packed under, and its
``run_fingerprint``, which every epoch header repeats. A root never mixes two runs: pack
refuses another run's epochs without ``--overwrite`` and :func:`open` refuses an epoch
whose ``run_fingerprint`` differs from its root's. ``data.path`` is recorded relative to
the epoch folder and resolved against it (:func:`data_path`), so a tree can move.

:func:`open` memory-maps the arrays and checks, before any batch is read: format and
version; the epoch fingerprint against the header (every field but ``summary``: an edited
``world_size`` or step count is refused); the folder name against ``epoch``; the root's
run; every array's dtype, shape and SHA-256 (``check_hashes``; its cost:
docs/reliability.md#integrity-on-read); and the header against the arrays (``num_microbatches = num_steps * W *
A``, segment and sample counts). :func:`dflash_prep.verify.verify_epoch` (``dflash-prep
verify``) also recomputes everything from the lengths with :mod:`dflash_prep.pack.metrics`,
the summary included, and names the summary fields it cannot recompute (analyze's
prediction, pack's split and dropped micro-batch counts).

World size is not elastic within a manifest: one packed for ``W x A`` is refused under any
other ``W' x A'`` (:meth:`Manifest.check_world`), because its steps were balanced for ``W``
ranks. ``pack --resume-from-step K --world-size W'`` writes a continuation
(:mod:`dflash_prep.pack.repack`, header ``resume``) holding the epoch's unconsumed rest for
``W' x A'``; ``verify`` checks coverage across the parent's first K steps and it.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from dflash_prep import objectives
from dflash_prep.errors import ConfigError, FingerprintMismatch, FormatError
from dflash_prep.formats.fileio import (atomic_dir, atomic_save_npy, atomic_write_json, fingerprint_array,
                                        fingerprint_json, holds_marker, load_npy, read_json)
from dflash_prep.formats.outputs import is_temp_name
from dflash_prep.formats.plan import SEED_MAX

MANIFEST_FORMAT = "dflash-prep/manifest"
MANIFEST_VERSION = 1
MANIFEST_FILE = "manifest.json"
ROOT_FORMAT = "dflash-prep/manifest-root"
ROOT_VERSION = 1
ROOT_FILE = "root.json"
COLUMNS = ("start", "count", "step", "rank", "accum", "bucket", "max_len", "real_tokens", "padded_tokens", "sum_sq_len")
COL = {name: i for i, name in enumerate(COLUMNS)}
ARRAYS = {"microbatches": np.int64, "sample_ids": np.int64, "sample_lens": np.int32,
          "cu_seqlens": np.int64, "dropped_ids": np.int64, "anchor_counts": np.int32, "anchors": np.int32,
          "d2t": np.int64, "t2d": np.bool_}


def required_arrays(header: dict) -> list[str]:
    """The arrays an epoch must hold: ``cu_seqlens`` in varlen, and its objective's (the
    dflash objective: ``anchor_counts``; ``anchors`` is optional, ``--store-anchors``)."""
    out = ["microbatches", "sample_ids", "sample_lens", "dropped_ids"]
    out += ["cu_seqlens"] if header.get("layout") == "varlen" else []
    return out + objectives.of_header(header).required_arrays(header)
LAYOUTS = ("padded", "varlen")


def epoch_dir(root: str | Path, epoch: int) -> Path:
    """``<root>/epoch-000N``: where epoch ``N`` of a manifest root lives."""
    if int(epoch) < 0:
        raise ConfigError(f"epoch must be >= 0, got {epoch}")
    if int(epoch) > SEED_MAX:  # the epoch keys the shuffles with its 64 bits (plan.check_seed)
        raise ConfigError(f"epoch {epoch} is outside 0..{SEED_MAX}: the shuffles are keyed by 64 bits, so it would "
                          f"repeat epoch {int(epoch) & SEED_MAX}")
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
    missing = [n for n in required_arrays(header) if n not in arrays]
    if missing:
        raise ValueError(f"manifest.write: missing arrays {missing}")
    header = dict(header, arrays=array_identity(arrays))
    header["fingerprint"] = epoch_fingerprint(header)
    path = Path(path)
    with atomic_dir(path, overwrite=overwrite, marker=(MANIFEST_FILE, MANIFEST_FORMAT)) as tmp:
        for name, a in arrays.items():
            atomic_save_npy(tmp / f"{name}.npy", a)
        atomic_write_json(tmp / MANIFEST_FILE, header, format=MANIFEST_FORMAT, version=MANIFEST_VERSION)
    return path


def rows_to_batches(table: np.ndarray, sample_ids: np.ndarray):
    """``(order, offsets)`` in manifest row order, the batching :mod:`dflash_prep.pack.metrics`
    takes: ``order[offsets[m]:offsets[m+1]]`` is row ``m``'s sample ids. One N-sized gather."""
    start, count = table[:, COL["start"]], table[:, COL["count"]]
    offsets = np.concatenate([[0], np.cumsum(count)]).astype(np.int64)
    idx = np.repeat(start - offsets[:-1], count) + np.arange(offsets[-1], dtype=np.int64)
    return np.asarray(sample_ids)[idx], offsets


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
            cu = self.arrays["cu_seqlens"][s:s + n + 1] - self.arrays["cu_seqlens"][s]
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
        """Real (unpadded) tokens of a whole optimizer step, all ranks and accumulation slots.

        This is the throughput numerator, not the loss normaliser: the loss divides by the
        step's target tokens under ``loss_mask`` (shifted), which only the shards know.
        """
        per_step = self.world_size * self.grad_accum
        return int(self.table[step * per_step:(step + 1) * per_step, COL["real_tokens"]].sum())


def read_header(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise FormatError(f"{path}: manifest folder not found; run `dflash-prep pack --epoch N --out ROOT` "
                          "(epochs live in ROOT/epoch-000N)")
    return read_json(path / MANIFEST_FILE, format=MANIFEST_FORMAT, versions=(MANIFEST_VERSION,))


def read_root(root: str | Path) -> dict | None:
    """``root.json`` of a manifest root, or None when there is none."""
    p = Path(root) / ROOT_FILE
    if not p.is_file():
        return None
    r = read_json(p, format=ROOT_FORMAT, versions=(ROOT_VERSION,))
    if not isinstance(r.get("run"), dict) or r.get("run_fingerprint") != fingerprint_json(r["run"]):
        raise FormatError(f"{p}: run and run_fingerprint disagree (edited or corrupt); re-pack the root with --overwrite")
    return r


def write_root(root: str | Path, run: dict) -> str:
    """Write ``root.json`` for ``run`` atomically; returns its run fingerprint."""
    fp = fingerprint_json(run)
    atomic_write_json(Path(root) / ROOT_FILE, {"run": run, "run_fingerprint": fp}, format=ROOT_FORMAT,
                      version=ROOT_VERSION)
    return fp


def prepare_root(root: str | Path, run: dict, *, overwrite: bool) -> str:
    """Check that ``root`` may become a root of ``run`` (under its lock); returns the run fingerprint.

    A new or empty folder may become a root. A folder that is not a root (no ``root.json``)
    and holds anything but epoch folders is refused, untouched. A root of another run is
    refused without ``overwrite``; with it, :func:`commit_root` rewrites ``root.json`` first and
    then removes that run's epochs (renamed away, then deleted), so no reader ever sees two runs:
    :func:`open` refuses an epoch whose run differs from ``root.json``.
    """
    root = Path(root)
    fp = fingerprint_json(run)
    cur = None
    if root.exists():
        try:
            cur = read_root(root)
        except FormatError:
            if not overwrite:
                raise
            cur = {"run_fingerprint": None}
        if cur is None:
            foreign = sorted(p.name for p in root.iterdir() if not is_temp_name(p.name)
                             and not (p.name.startswith("epoch-") and holds_marker(p, MANIFEST_FILE, MANIFEST_FORMAT)))
            if foreign:
                raise ConfigError(f"{root} exists and is not a manifest root (it holds {foreign[0]!r} and no "
                                  f"{ROOT_FILE}); it was left untouched. Choose another --out")
            if any(root.glob("epoch-*")) and not overwrite:
                raise ConfigError(f"{root} holds epochs packed without {ROOT_FILE} (an older dflash-prep); pass "
                                  "--overwrite to re-pack them, or choose another --out")
        elif cur["run_fingerprint"] != fp and not overwrite:
            raise ConfigError(f"{root} holds the epochs of another pack run (another plan or other options); pass "
                              "--overwrite to replace them, or choose another --out. A root never mixes two runs")
    return fp


def commit_root(root: str | Path, run: dict) -> None:
    """Record ``run`` in ``root.json`` (if it is not already) and drop other runs' epochs.

    Called by pack right before it writes its first epoch, so a pack that fails earlier
    leaves the root as it was."""
    root = Path(root)
    fp = fingerprint_json(run)
    try:
        cur = read_root(root)
    except FormatError:
        cur = None
    if cur is None or cur["run_fingerprint"] != fp:
        root.mkdir(parents=True, exist_ok=True)
        write_root(root, run)
        for p in sorted(root.glob("epoch-*")):
            if holds_marker(p, MANIFEST_FILE, MANIFEST_FORMAT):
                try:
                    other = read_header(p).get("run_fingerprint") != fp
                except FormatError:
                    other = True
                if other:
                    gone = p.with_name(f".{p.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
                    os.replace(p, gone)
                    shutil.rmtree(gone, ignore_errors=True)


def data_path(path: str | Path, header: dict) -> str:
    """The data (folder or lengths file) an epoch records, resolved against the epoch folder."""
    return str(Path(path) / header["data"]["path"])


def _fix(path: Path) -> str:
    return (f"the manifest is corrupt or was edited; re-pack it (`dflash-prep pack ... --epoch {path.name[6:] or 'N'} "
            "--overwrite`)")


def _check_header(path: Path, header: dict) -> None:
    """Epoch fingerprint, folder name and root run: before anything else of the header is trusted."""
    if "fingerprint" not in header:
        raise FormatError(f"{path / MANIFEST_FILE}: no fingerprint field; {_fix(path)}")
    if epoch_fingerprint(header) != header["fingerprint"]:
        raise FormatError(f"{path / MANIFEST_FILE}: header fields do not match the epoch fingerprint (edited by hand "
                          f"or corrupt); {_fix(path)}")
    for k in ("epoch", "layout", "world_size", "grad_accum", "num_steps", "num_microbatches", "arrays", "data",
              "plan_fingerprint"):
        if k not in header:
            raise FormatError(f"{path / MANIFEST_FILE}: field {k!r} is missing; {_fix(path)}")
    if path.name.startswith("epoch-") and path.name[6:].isdigit() and int(path.name[6:]) != int(header["epoch"]):
        raise FormatError(f"{path}: holds epoch {header['epoch']}, not {int(path.name[6:])} (folders swapped or "
                          f"renamed?); move it back or re-pack epoch {int(path.name[6:])}")
    root = read_root(path.parent)
    if root is not None and header.get("run_fingerprint") != root["run_fingerprint"]:
        raise FingerprintMismatch(f"{path}: packed by another run than its root {path.parent / ROOT_FILE} records "
                                  "(plan or pack options differ); a root never mixes runs. Re-pack the epoch into "
                                  "this root, or open it from its own root")


def _check_shapes(path: Path, m: "Manifest") -> None:
    """The header against the arrays: W, A, step and row counts, segment coverage."""
    W, A, S = m.world_size, m.grad_accum, m.num_steps
    if W < 1 or A < 1 or S < 0 or m.layout not in LAYOUTS:
        raise FormatError(f"{path / MANIFEST_FILE}: world_size {W}, grad_accum {A}, num_steps {S}, layout "
                          f"{m.layout!r} are not valid; {_fix(path)}")
    if m.num_microbatches != S * W * A:
        raise FormatError(f"{path / MANIFEST_FILE}: {m.num_microbatches} micro-batches are not {S} steps x {W} ranks "
                          f"x {A} accumulation; {_fix(path)}")
    n = m.sample_ids.shape[0]
    if m.sample_lens.shape[0] != n or ("num_samples_used" in m.header and int(m.header["num_samples_used"]) != n):
        raise FormatError(f"{path}: sample_ids.npy holds {n} ids, sample_lens.npy {m.sample_lens.shape[0]}, header "
                          f"{m.header.get('num_samples_used')}; {_fix(path)}")
    if m.layout == "varlen" and m.arrays["cu_seqlens"].shape[0] != n + 1:
        raise FormatError(f"{path / 'cu_seqlens.npy'}: {m.arrays['cu_seqlens'].shape[0]} entries for {n} samples; "
                          f"{_fix(path)}")
    if len(m.table):
        t = np.asarray(m.table)
        if int(t[:, COL["count"]].sum()) != n or int(t[-1, COL["step"]]) != S - 1 or (t[:, COL["count"]] < 1).any():
            raise FormatError(f"{path / 'microbatches.npy'}: rows do not cover sample_ids in {S} steps; {_fix(path)}")


def open(path: str | Path, *, plan_fingerprint: str | None = None, data_fingerprint: str | None = None,  # noqa: A001
         check_hashes: bool = True) -> Manifest:
    """Open an epoch folder memory-mapped, checked as the module docstring says.

    Each failure is a :class:`FormatError` / :class:`FingerprintMismatch` naming the file
    and the fix. ``check_hashes=False`` skips only the array re-hash (``inspect``).
    """
    path = Path(path)
    header = read_header(path)
    _check_header(path, header)
    arrays = {}
    for name, meta in header["arrays"].items():
        if name not in ARRAYS:
            raise FormatError(f"{path}: unknown array {name!r} in {MANIFEST_FILE}; re-pack with this dflash-prep")
        a = load_npy(path / f"{name}.npy", dtype=ARRAYS[name])
        if list(a.shape) != list(meta["shape"]):
            raise FormatError(f"{path / (name + '.npy')}: shape {list(a.shape)} but {MANIFEST_FILE} records "
                              f"{meta['shape']}; the manifest is corrupt, re-pack the epoch with --overwrite")
        if check_hashes and fingerprint_array(a) != meta["sha256"]:
            raise FormatError(f"{path / (name + '.npy')}: contents do not match the SHA-256 in {MANIFEST_FILE} "
                              f"(corrupt or edited); {_fix(path)}")
        arrays[name] = a
    for name in required_arrays(header):
        if name not in arrays:
            raise FormatError(f"{path}: {name}.npy is not listed in {MANIFEST_FILE}; the manifest is corrupt, re-pack it")
    m = Manifest(path, header, arrays)
    if m.table.ndim != 2 or m.table.shape != (m.num_microbatches, len(COLUMNS)):
        raise FormatError(f"{path}: microbatches.npy has shape {m.table.shape}, expected ({m.num_microbatches}, "
                          f"{len(COLUMNS)}); re-pack the epoch with --overwrite")
    _check_shapes(path, m)
    if plan_fingerprint is not None and plan_fingerprint != m.plan_fingerprint:
        raise FingerprintMismatch(f"{path}: packed from plan {m.plan_fingerprint}, not from plan {plan_fingerprint}; "
                                  "re-pack with the current plan (`dflash-prep pack --overwrite`)")
    if data_fingerprint is not None and data_fingerprint != m.data_fingerprint:
        raise FingerprintMismatch(f"{path}: packed for data {m.data_fingerprint}, not for data {data_fingerprint}; "
                                  "re-run analyze and pack for this dataset")
    return m


def find_epochs(path: str | Path, *, strict: bool = False) -> list[Path]:
    """``path`` itself if it is an epoch folder, else the ``epoch-*`` folders under it, in order.

    ``strict`` (``verify``): an epoch folder without its ``manifest.json``, and anything under
    a root named ``epoch-*`` that is not an ``epoch-000N`` folder holding one, is a
    :class:`FormatError` naming each, instead of being skipped."""
    path = Path(path)
    if (path / MANIFEST_FILE).is_file():
        return [path]
    if strict:
        _check_epoch_names(path)
    found = sorted(p for p in path.glob("epoch-*") if (p / MANIFEST_FILE).is_file()) if path.is_dir() else []
    if not found:
        raise FormatError(f"{path}: no manifest here (expected {MANIFEST_FILE} or epoch-000N/ folders); "
                          "run `dflash-prep pack --out ROOT` first")
    return found


def _check_epoch_names(path: Path) -> None:
    """Raise naming every entry that looks like an epoch (``epoch-*``) and is not a valid one."""
    if path.is_dir() and re.fullmatch(r"epoch-\d{4,}", path.name) and not any(path.glob("epoch-*")):
        raise FormatError(f"{path}: an epoch folder without its {MANIFEST_FILE}; it cannot be verified. Re-pack "
                          "the epoch (`dflash-prep pack --overwrite`) or remove the folder")
    bad = []
    for p in sorted(path.glob("epoch-*")) if path.is_dir() else []:
        if not p.is_dir():
            bad.append(f"{p.name} (not a folder)")
        elif not re.fullmatch(r"epoch-\d{4,}", p.name):
            bad.append(f"{p.name} (not named epoch-000N)")
        elif not (p / MANIFEST_FILE).is_file():
            bad.append(f"{p.name} (no {MANIFEST_FILE})")
    if bad:
        raise FormatError(f"{path}: {', '.join(bad)}: not valid epoch folders, so verify cannot check them. Re-pack "
                          "those epochs (`dflash-prep pack --overwrite`) or move them out of the root")
