"""The public reader of a tokenized dataset folder (written by ``dflash-prep tokenize``).

    from dflash_prep.dataset import open_dataset
    ds = open_dataset(folder)
    ids, mask = ds.sample(i)   # np.int32 input_ids, np.uint8 loss_mask: views into mmap'd Arrow

Opening checks, cheaply and before any sample is read: ``meta.json``'s format and version;
``lengths.npy``'s fingerprint against ``meta.json``; every shard's format/version header
(Arrow schema metadata), its first id and row count against ``meta.json``, its ``length``
column against ``lengths.npy``, and its list offsets against those lengths. Shards are
memory-mapped (``pa.memory_map``), so opening costs O(N) integer compares and no copy of
token data; ``sample(i)`` is a binary search over record batches plus two slices.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .errors import FingerprintMismatch, FormatError, InputError
from .fileio import fingerprint_array, load_npy, read_json
from .lengths import DATASET_FORMAT, DATASET_VERSIONS, LENGTHS_FILE, META_FILE

SHARD_FORMAT = "dflash-prep/shard"
SHARD_VERSIONS = (1, 2)


class Dataset:
    """A tokenized dataset: ``len``, ``fingerprint``, ``meta``, ``lengths``, ``sample(i)``."""

    def __init__(self, folder: str | Path):
        import pyarrow as pa

        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise InputError(f"{self.folder}: dataset folder not found; run `dflash-prep tokenize` first")
        self.meta = read_json(self.folder / META_FILE, format=DATASET_FORMAT, versions=DATASET_VERSIONS)
        self.fingerprint: str = str(self.meta["fingerprint"])
        self.lengths = load_npy(self.folder / LENGTHS_FILE, dtype=np.int32)  # (N,) int32 memmap
        fix = "the folder is corrupt or was edited; re-run `dflash-prep tokenize --overwrite`"
        want = self.meta.get("lengths", {}).get("fingerprint")
        if want != fingerprint_array(self.lengths):
            raise FingerprintMismatch(f"{self.folder / LENGTHS_FILE}: does not match the fingerprint in meta.json; {fix}")
        if int(self.meta["counts"]["samples"]) != self.lengths.shape[0]:
            raise FormatError(f"{self.folder}: meta.json counts {self.meta['counts']['samples']} samples but "
                              f"lengths.npy holds {self.lengths.shape[0]}; {fix}")
        self._batches_ids: list[np.ndarray] = []    # per record batch: flat int32 values
        self._batches_mask: list[np.ndarray] = []   # per record batch: flat uint8 values
        self._batches_off: list[np.ndarray] = []    # per record batch: (rows + 1,) int32 offsets
        starts = []
        self._maps = []
        expect_first = 0
        for sh in self.meta["shards"]:
            path = self.folder / sh["file"]
            if not path.is_file():
                raise FormatError(f"{path}: shard listed in meta.json is missing; {fix}")
            if int(sh["first_id"]) != expect_first:
                raise FormatError(f"{self.folder / META_FILE}: shard {sh['file']} starts at id {sh['first_id']}, "
                                  f"expected {expect_first}; {fix}")
            try:
                mm = pa.memory_map(str(path))
                reader = pa.ipc.open_stream(mm)
                self._check_schema(reader.schema, path, expect_first, fix)
                batches = list(reader)
            except (pa.ArrowInvalid, OSError) as e:
                raise FormatError(f"{path}: corrupt or truncated Arrow shard ({e}); {fix}") from None
            self._maps.append(mm)
            first = expect_first
            for b in batches:
                n = b.num_rows
                if n == 0:
                    continue
                ids_col, mask_col = b.column("input_ids"), b.column("loss_mask")
                off = ids_col.offsets.to_numpy()                           # (n + 1,) int32
                if not np.array_equal(off, mask_col.offsets.to_numpy()):
                    raise FormatError(f"{path}: input_ids and loss_mask rows differ in length; {fix}")
                lens = b.column("length").to_numpy()
                if not np.array_equal(lens, self.lengths[first:first + n]) or not np.array_equal(np.diff(off), lens):
                    raise FormatError(f"{path}: rows {first}..{first + n - 1} disagree with lengths.npy; {fix}")
                self._batches_ids.append(ids_col.values.to_numpy(zero_copy_only=True))
                self._batches_mask.append(mask_col.values.to_numpy(zero_copy_only=True))
                self._batches_off.append(off)
                starts.append(first)
                first += n
            if first - expect_first != int(sh["rows"]):
                raise FormatError(f"{path}: holds {first - expect_first} rows, meta.json says {sh['rows']}; {fix}")
            expect_first = first
        if expect_first != self.lengths.shape[0]:
            raise FormatError(f"{self.folder}: shards hold {expect_first} samples, lengths.npy {self.lengths.shape[0]}; {fix}")
        self._starts = np.asarray(starts, np.int64)

    def _check_schema(self, schema, path: Path, first_id: int, fix: str) -> None:
        raw = (schema.metadata or {}).get(b"dflash-prep")
        try:
            head = json.loads(raw) if raw else {}
        except json.JSONDecodeError:
            head = {}
        if head.get("format") != SHARD_FORMAT or head.get("version") not in SHARD_VERSIONS:
            raise FormatError(f"{path}: not a {SHARD_FORMAT} v{SHARD_VERSIONS[-1]} shard "
                              f"(found {head.get('format')!r} v{head.get('version')!r}); {fix}")
        if head.get("first_id") != first_id or head.get("inputs") != self.meta.get("inputs_fingerprint"):
            raise FingerprintMismatch(f"{path}: belongs to another tokenize run than meta.json; {fix}")

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def tokenizer_info(self) -> dict:
        """vocab_size, pad_id, eos_id, bos_id (or None), name, fingerprint of the tokenizer used."""
        t = self.meta["tokenizer"]
        return {k: t.get(k) for k in ("vocab_size", "pad_id", "eos_id", "bos_id", "name", "fingerprint")}

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids int32, loss_mask uint8)`` of sample id ``i``, zero-copy (read-only views)."""
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"sample id {i} is out of range for a dataset of {len(self)} samples")
        b = int(np.searchsorted(self._starts, i, side="right")) - 1
        r = i - int(self._starts[b])
        off = self._batches_off[b]
        lo, hi = int(off[r]), int(off[r + 1])
        return self._batches_ids[b][lo:hi], self._batches_mask[b][lo:hi]


def open_dataset(folder: str | Path) -> Dataset:
    """Open and check a tokenized folder; errors name the file and the fix."""
    return Dataset(folder)
