"""Where analyze and pack get sample lengths from.

Two sources, one result:

- a tokenized dataset folder (``meta.json`` + ``lengths.npy``, written by ``tokenize``):
  only the lengths array is read, memory-mapped; the shards are never touched;
- a what-if lengths file: ``.npy`` (any integer dtype) or text with one integer per line.

Sample ids are positions in the returned array. The returned :class:`LengthSource` carries
a fingerprint that plans and manifests record, so a plan can never be applied to other data.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_prep.errors import FormatError, InputError
from dflash_prep.formats.dataset import (DATASET_FORMAT, DATASET_VERSIONS, LENGTHS_FILE,  # noqa: F401 (re-exported)
                                         META_FILE, read_meta)
from dflash_prep.formats.fileio import atomic_save_npy, fingerprint_array, load_npy, read_json


@dataclass(frozen=True)
class LengthSource:
    """Lengths plus where they came from.

    Attributes:
        lengths: int32 array, one entry per sample id (may be a read-only memmap).
        kind: ``"dataset"`` (a tokenized folder) or ``"lengths"`` (a what-if file).
        path: the folder or file, as given.
        fingerprint: the dataset fingerprint from ``meta.json``, or the lengths array's own.
    """

    lengths: np.ndarray
    kind: str
    path: str
    fingerprint: str

    @property
    def num_samples(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def total_tokens(self) -> int:
        return int(self.lengths.sum(dtype=np.int64))

    def describe(self) -> dict:
        return {"kind": self.kind, "path": self.path, "fingerprint": self.fingerprint,
                "num_samples": self.num_samples, "total_tokens": self.total_tokens}


def read_dataset_lengths(folder: str | Path) -> LengthSource:
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(f"{folder}: dataset folder not found; run `dflash-prep tokenize` first or pass --lengths FILE")
    meta = read_meta(folder)
    lengths = load_npy(folder / LENGTHS_FILE)
    want = (meta.get("lengths") or {}).get("fingerprint") if isinstance(meta.get("lengths"), dict) else None
    if want is not None and fingerprint_array(lengths) != want:
        raise FormatError(f"{folder / LENGTHS_FILE}: contents do not match the fingerprint in meta.json "
                          "(edited or corrupt); re-run `dflash-prep tokenize --overwrite`")
    n = meta["counts"].get("samples") if isinstance(meta.get("counts"), dict) else None
    if n is not None and int(n) != lengths.shape[0]:
        raise FormatError(f"{folder / LENGTHS_FILE}: holds {lengths.shape[0]} lengths but meta.json says {n} samples; "
                          "the folder is corrupt, re-run `dflash-prep tokenize --overwrite`")
    return LengthSource(_check(lengths, folder / LENGTHS_FILE), "dataset", str(folder), str(meta["fingerprint"]))


def read_lengths_file(path: str | Path) -> LengthSource:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: lengths file not found; pass a .npy array or a text file with one integer per line")
    if path.suffix == ".npy":
        arr = load_npy(path, mmap=False)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise InputError(f"{path}: expected a 1-D integer array, found shape {arr.shape} dtype {arr.dtype}")
    else:
        vals = []
        with open(path) as f:
            for i, line in enumerate(f, 1):
                s = line.strip()
                if not s:
                    continue
                try:
                    vals.append(int(s))
                except ValueError:
                    raise InputError(f"{path}:{i}: {s[:40]!r} is not an integer; the file needs one length per line") from None
        arr = np.asarray(vals, dtype=np.int64)
    arr = _check(arr, path)
    return LengthSource(arr, "lengths", str(path), fingerprint_array(arr))


def _check(arr: np.ndarray, where) -> np.ndarray:
    if arr.shape[0] == 0:
        raise InputError(f"{where}: no samples; nothing to analyze or pack")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 1:
        raise InputError(f"{where}: found a length of {lo}; every sample needs at least one token")
    if hi > np.iinfo(np.int32).max:
        raise InputError(f"{where}: found a length of {hi}, beyond int32")
    return arr.astype(np.int32, copy=False)


def load(data: str | Path | None = None, lengths_file: str | Path | None = None) -> LengthSource:
    """Load lengths from exactly one of a dataset folder or a lengths file."""
    if (data is None) == (lengths_file is None):
        raise InputError("give exactly one of a dataset folder or --lengths FILE")
    return read_dataset_lengths(data) if data is not None else read_lengths_file(lengths_file)


# ----------------------------------------------------------------------------- mask counts
#: Per-sample loss-mask counts beside lengths.npy (int32, one per sample id), listed in
#: meta.json under these keys with their fingerprints: supervised tokens S = sum lm[t] and
#: anchor candidates C = sum lm[t] * lm[t+1] (:mod:`dflash_prep.objectives.anchors`).
MASK_COUNT_FILES = {"supervised": "supervised.npy", "anchor_candidates": "anchor_candidates.npy"}


@dataclass(frozen=True)
class MaskCounts:
    """``supervised`` and ``anchor_candidates`` (int32, one per sample id) of a dataset."""

    supervised: np.ndarray
    anchor_candidates: np.ndarray


def write_mask_counts(folder: Path, parts: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    """Write the two arrays from per-chunk ``(S, C)`` parts; returns their meta.json entries."""
    meta = {}
    for j, (key, name) in enumerate(MASK_COUNT_FILES.items()):
        arr = np.concatenate([p[j] for p in parts]).astype(np.int32) if parts else np.zeros(0, np.int32)
        atomic_save_npy(Path(folder) / name, arr)
        meta[key] = {"file": name, "dtype": "int32", "fingerprint": fingerprint_array(arr)}
    return meta


def read_mask_counts(folder: str | Path) -> MaskCounts:
    """Read and check a dataset's mask counts (fingerprints, sample count, ``C < S <= L``).

    A dataset tokenized before these arrays existed has none: the error says to re-tokenize.
    """
    folder = Path(folder)
    src = read_dataset_lengths(folder)
    meta = read_json(folder / META_FILE, format=DATASET_FORMAT, versions=DATASET_VERSIONS)
    fix = f"re-run `dflash-prep tokenize ... --out {folder} --overwrite` with this dflash-prep"
    out = {}
    for key, name in MASK_COUNT_FILES.items():
        entry = meta.get(key)
        if not entry:
            raise FormatError(f"{folder}: meta.json lists no {name} (tokenized before drafter support); {fix}")
        arr = load_npy(folder / entry["file"], dtype=np.int32)
        if fingerprint_array(arr) != entry.get("fingerprint") or arr.shape != src.lengths.shape:
            raise FormatError(f"{folder / entry['file']}: does not match meta.json (fingerprint or sample count); {fix}")
        out[key] = arr
    s, c = out["supervised"], out["anchor_candidates"]
    if (s < 0).any() or (s > src.lengths).any() or (c < 0).any() or (c >= np.maximum(s, 1)).any():
        raise FormatError(f"{folder}: supervised/anchor_candidates break 0 <= C < S <= L; {fix}")
    return MaskCounts(supervised=s, anchor_candidates=c)
