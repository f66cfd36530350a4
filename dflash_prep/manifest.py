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
    an N-sized gather: 5 s and 1.2 GB at 100M samples).
``sample_lens.npy`` int32 ``(N_used,)``: their lengths, so a trainer needs no shard to
    build masks or positions.
``cu_seqlens.npy``  int64 ``(N_used + 1,)``, varlen only: prefix sums of ``sample_lens``;
    a micro-batch's ``cu_seqlens`` is ``cu[start:start + count + 1] - cu[start]``.
``dropped_ids.npy`` int64, sorted: samples left out by ``--drop-last`` (empty otherwise).
``anchor_counts.npy`` int32 ``(N_used,)``, ``--objective dflash`` only: anchors of each
    ``sample_ids`` entry; ``manifest.json``'s ``dflash`` block records B, max_anchors, the
    policy, the anchor seed, the budgets, the cost model and the anchor digest
    (:mod:`dflash_prep.pack_dflash`). ``anchors.npy`` int32 (``--store-anchors``): every
    anchor position within its sample, concatenated in ``sample_ids`` order.

Every row of a step has the same ``world_size * grad_accum`` micro-batches, so row
``m`` is step ``m // (W*A)``, rank ``(m % (W*A)) // A``, accum ``m % A``.
:func:`open` memory-maps the arrays and checks format, version, shapes and (optionally)
fingerprints; :func:`verify` (``dflash-prep verify``) re-hashes every array and
recomputes everything from the lengths with :mod:`dflash_prep.metrics`.

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

from . import lengths as lengths_mod
from . import metrics
from .errors import ConfigError, FingerprintMismatch, FormatError
from .fileio import atomic_dir, atomic_save_npy, atomic_write_json, fingerprint_array, fingerprint_json, load_npy, read_json

MANIFEST_FORMAT = "dflash-prep/manifest"
MANIFEST_VERSION = 1
MANIFEST_FILE = "manifest.json"
COLUMNS = ("start", "count", "step", "rank", "accum", "bucket", "max_len", "real_tokens", "padded_tokens", "sum_sq_len")
COL = {name: i for i, name in enumerate(COLUMNS)}
ARRAYS = {"microbatches": np.int64, "sample_ids": np.int64, "sample_lens": np.int32,
          "cu_seqlens": np.int64, "dropped_ids": np.int64, "anchor_counts": np.int32, "anchors": np.int32}


def required_arrays(header: dict) -> list[str]:
    """The arrays an epoch must hold: ``cu_seqlens`` in varlen, ``anchor_counts`` under the
    dflash objective; ``anchors`` is optional (``--store-anchors``)."""
    out = ["microbatches", "sample_ids", "sample_lens", "dropped_ids"]
    out += ["cu_seqlens"] if header.get("layout") == "varlen" else []
    return out + (["anchor_counts"] if "dflash" in header else [])
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
    missing = [n for n in required_arrays(header) if n not in arrays]
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


def rows_to_batches(table: np.ndarray, sample_ids: np.ndarray):
    """``(order, offsets)`` in manifest row order, the batching :mod:`dflash_prep.metrics`
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
    for name in required_arrays(header):
        if name not in arrays:
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


# ----------------------------------------------------------------------------- verify
def _summary_metrics(m: Manifest, lens: np.ndarray, order: np.ndarray, offsets: np.ndarray, seg: np.ndarray,
                     supervised: np.ndarray | None = None) -> dict:
    """Every summary metric, recomputed from scratch with :mod:`dflash_prep.metrics`.

    ``order``/``offsets`` are the segments in file order; ``seg`` maps them to table rows.
    ``supervised`` (per sample id, dflash only) prices rank imbalance on the drafter cost."""
    t = np.asarray(m.table)[seg]
    varlen = m.layout == "varlen"
    b = m.header["budget"]
    if supervised is not None:                     # dflash: ranks were balanced on the drafter step cost
        from . import pack_dflash
        cost = pack_dflash.microbatch_cost(m.header, lens[order], supervised[order],
                                           np.asarray(m.arrays["anchor_counts"]), offsets)
    else:
        cost = metrics.batch_cost(lens, order, offsets, float(b["cost_alpha"]), varlen=varlen)
    eff = 1.0 if varlen else metrics.efficiency(lens, order, offsets)
    return {"efficiency": eff, "fill": metrics.fill(lens, order, offsets, float(b["value"]), varlen=varlen,
                                                      alpha=float(b["packing_alpha"])),
            "microbatches": int(len(t)), "steps": int(len(t) // (m.world_size * m.grad_accum)),
            "samples": int(len(order)), "dropped_samples": int(len(m.dropped_ids)),
            "step_mix": metrics.step_mix(lens, order, offsets, t[:, COL["step"]]),
            "rank_imbalance": metrics.rank_imbalance(cost, t[:, COL["step"]], t[:, COL["rank"]], m.world_size)}


def verify(path: str | Path, *, data: str | Path | None = None, lengths: str | Path | None = None,
           plan_fingerprint: str | None = None) -> dict:
    """Recompute an epoch from its arrays and the lengths; raise on any violation.

    Checks, in order: format and version; every array's SHA-256 and the epoch fingerprint
    (corrupt or truncated files); the data fingerprint (the lengths are found by the path
    the manifest records, or ``data`` / ``lengths``); exactly-once coverage of every
    sample id apart from the listed drops; stored lengths, maxima and token counts; the
    budget and ``max_batch_size``; the step/rank/accum layout with equal counts per rank;
    ``cu_seqlens``; and every summary metric against :mod:`dflash_prep.metrics` (and the
    repeat-pair rate when the previous epoch is beside this one). Returns the recomputed
    metrics; raises :class:`FormatError` / :class:`FingerprintMismatch` listing problems.
    """
    path = Path(path)
    m = open(path, plan_fingerprint=plan_fingerprint)
    bad = [f"{name}.npy: contents do not match the SHA-256 in {MANIFEST_FILE}"
           for name, a in m.arrays.items() if fingerprint_array(a) != m.header["arrays"][name]["sha256"]]
    if epoch_fingerprint(m.header) != m.fingerprint:
        bad.append(f"{MANIFEST_FILE}: header fields do not match the epoch fingerprint (edited by hand?)")
    if bad:
        raise FormatError(f"{path}: corrupt manifest: " + "; ".join(bad) + ". Re-pack the epoch with --overwrite")
    if data is None and lengths is None:
        d = m.header["data"]
        data, lengths = (d["path"], None) if d.get("kind") == "dataset" else (None, d["path"])
    src = lengths_mod.load(data=data, lengths_file=lengths)
    if src.fingerprint != m.data_fingerprint:
        raise FingerprintMismatch(f"{path}: packed for data {m.data_fingerprint}, but {src.path} has fingerprint "
                                  f"{src.fingerprint}; pass the right --data/--lengths or re-pack for this data")
    lens = np.asarray(src.lengths, np.int64)
    t = np.asarray(m.table)
    ids = np.asarray(m.sample_ids)
    # metrics run over the segments in file order: ``seg`` sorts the rows by start
    seg = np.argsort(t[:, COL["start"]], kind="stable")
    count = t[seg, COL["count"]]
    offsets = np.concatenate([[0], np.cumsum(count)]).astype(np.int64)
    problems = []
    if (count < 1).any() or not np.array_equal(t[seg, COL["start"]], offsets[:-1]) or offsets[-1] != len(ids):
        raise FormatError(f"{path}: micro-batch start/count columns do not tile sample_ids; re-pack the epoch")
    if len(ids) and (ids.min() < 0 or ids.max() >= len(lens)):
        raise FormatError(f"{path}: sample ids outside 0..{len(lens) - 1}; the manifest belongs to other data")
    seen = np.bincount(np.concatenate([ids, m.dropped_ids]), minlength=len(lens))
    if (seen != 1).any():
        miss, dup = np.flatnonzero(seen == 0), np.flatnonzero(seen > 1)
        problems.append(f"{len(miss)} samples missing (e.g. {miss[:5].tolist()}) and {len(dup)} appear more than once "
                        f"(e.g. {dup[:5].tolist()})")
    if not np.array_equal(np.asarray(m.sample_lens, np.int64), lens[ids]):
        problems.append("sample_lens.npy does not match the dataset's lengths")
    counts, real, mx = metrics.batch_stats(lens, ids, offsets)
    varlen = m.layout == "varlen"
    padded = real if varlen else counts * mx
    sq = np.add.reduceat(lens[ids] ** 2, offsets[:-1]) if len(ids) else np.zeros(0, np.int64)
    for col, want in (("max_len", mx), ("real_tokens", real), ("padded_tokens", padded), ("sum_sq_len", sq)):
        if not np.array_equal(t[seg, COL[col]], want):
            problems.append(f"column {col} disagrees with the lengths in {int((t[seg, COL[col]] != want).sum())} micro-batches")
    b = m.header["budget"]
    used = metrics.batch_cost(lens, ids, offsets, float(b["packing_alpha"]), varlen=varlen)
    over = np.flatnonzero(used > float(b["value"]) * (1 + 1e-12))
    if len(over):
        problems.append(f"{len(over)} micro-batches exceed the budget {b['value']} {b['unit']} (e.g. row {over[0]}: "
                        f"{used[over[0]]:.1f})")
    if b.get("max_batch_size") and (count > int(b["max_batch_size"])).any():
        problems.append(f"micro-batches exceed max_batch_size {b['max_batch_size']}")
    s = m.world_size * m.grad_accum
    pos = np.arange(len(t), dtype=np.int64)
    if len(t) % s or len(t) // s != m.num_steps:
        problems.append(f"{len(t)} micro-batches do not make {m.num_steps} whole steps of {s}")
    elif not (np.array_equal(t[:, COL["step"]], pos // s) and np.array_equal(t[:, COL["rank"]], pos % s // m.grad_accum)
              and np.array_equal(t[:, COL["accum"]], pos % m.grad_accum)):
        problems.append("step/rank/accum columns break the layout (step, then rank, then accum): ranks get unequal counts")
    if varlen and not np.array_equal(np.asarray(m.arrays["cu_seqlens"]), np.concatenate([[0], np.cumsum(lens[ids])])):
        problems.append("cu_seqlens.npy is not the prefix sum of the sample lengths")
    extra, sup = {}, None
    if "dflash" in m.header and not problems:       # anchors: regenerated from the seed and the masks
        problems, extra, sup = _verify_drafter(m, lens, ids, offsets, src)
    if problems:
        raise FormatError(f"{path}: verify failed: " + "; ".join(problems))
    got = _summary_metrics(m, lens, ids, offsets, seg, supervised=sup) | extra
    summ = m.summary
    prev = epoch_dir(path.parent, m.epoch - 1) if m.epoch > 0 else None
    if summ.get("repeat_pair_rate") is not None and prev is not None and (prev / MANIFEST_FILE).is_file():
        p = open(prev, data_fingerprint=m.data_fingerprint)
        p_seg = np.argsort(p.table[:, COL["start"]], kind="stable")
        p_off = np.concatenate([[0], np.cumsum(p.table[p_seg, COL["count"]])]).astype(np.int64)
        got["repeat_pair_rate"] = metrics.repeat_pair_rate(np.asarray(p.sample_ids), p_off, ids, offsets, len(lens))
    wrong = [f"{k}: summary {summ.get(k)!r} vs recomputed {v!r}" for k, v in got.items()
             if summ.get(k) is None or abs(float(summ[k]) - float(v)) > 1e-9]
    if wrong:
        raise FormatError(f"{path}: summary disagrees with the arrays: " + "; ".join(wrong) + ". Re-pack the epoch")
    return got


def _verify_drafter(m: Manifest, lens, ids, offsets, src):
    """(problems, metrics, supervised) of :func:`pack_dflash.verify_epoch` against the dataset's masks."""
    from . import pack_dflash
    from .dataset import open_dataset
    from .lengths import read_mask_counts

    if src.kind != "dataset":
        return [f"{src.path}: a dflash manifest is verified against its dataset folder (the loss masks); pass --data"], {}, None
    mc = read_mask_counts(src.path)
    problems, got = pack_dflash.verify_epoch(m.header, m.arrays, lens, ids, offsets,
                                             pack_dflash.dataset_masks(open_dataset(src.path)), mc, m.epoch)
    return problems, got, mc.supervised


def find_epochs(path: str | Path) -> list[Path]:
    """``path`` itself if it is an epoch folder, else the ``epoch-*`` folders under it, in order."""
    path = Path(path)
    if (path / MANIFEST_FILE).is_file():
        return [path]
    found = sorted(p for p in path.glob("epoch-*") if (p / MANIFEST_FILE).is_file()) if path.is_dir() else []
    if not found:
        raise FormatError(f"{path}: no manifest here (expected {MANIFEST_FILE} or epoch-000N/ folders); "
                          "run `dflash-prep pack --out ROOT` first")
    return found
