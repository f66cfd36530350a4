"""The tokenized dataset format: constants, writer and reader in one module.

Folder layout (format ``dflash-prep/dataset`` v2; written by ``dflash-prep tokenize``)::

    meta.json         format, version, fingerprint, tokenizer, source, options, counts,
                      tokens, lengths fingerprint, shards [{file, first_id, rows, tokens,
                      bytes, file_bytes, sha256, batches}], meta_fingerprint
    lengths.npy       int32, one per sample id (analyze/pack read only this and meta.json)
    shard-00000.arrow Arrow IPC stream: id int64, record int64, input_ids list<int32>,
                      loss_mask list<uint8>, length int32; schema metadata carries
                      {"format": "dflash-prep/shard", "version": 1, "first_id": ..., "inputs": ...}
    state.json, dataset_info.json   what ``datasets.load_from_disk`` reads

``meta.json`` is the folder's ownership marker. ``meta_fingerprint`` covers every other
field of ``meta.json`` (so an edited or deleted field is refused); ``sha256`` is each
shard file's content hash (``dflash-prep verify DATA`` re-hashes them; v1 folders have
none); ``batches`` holds one digest per Arrow record batch (:func:`batch_digest`: its
token ids, loss mask and lengths), which :meth:`Dataset.sample` checks the first time it
touches a batch, so a flipped token byte is refused before anything trains on it. That
costs one SHA-256 pass over the token data per process and epoch, against hours of
training on the same bytes (its rate: docs/reliability.md#integrity-on-read).

Reading::

    from dflash_prep.formats.dataset import open_dataset
    ds = open_dataset(folder)
    ids, mask = ds.sample(i)   # np.int32 input_ids, np.uint8 loss_mask: views into mmap'd Arrow

Opening checks, cheaply and before any sample is read: ``meta.json``'s format, version
and ``meta_fingerprint``; ``lengths.npy``'s fingerprint against ``meta.json``; every shard's
file size against ``file_bytes``, its format/version header (Arrow schema metadata), its
first id and row count against ``meta.json``, its ``length`` column against
``lengths.npy``, and its list offsets against those lengths. Shards are memory-mapped
(``pa.memory_map``), so opening costs O(N) integer compares and no read of token data;
``sample(i)`` is a binary search over record batches plus two slices. Content hashes and
token-id ranges are checked by :func:`dflash_prep.verify.verify_dataset` (one read of every
shard) and, per sample, by the trainer's loader.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dflash_prep.errors import FingerprintMismatch, FormatError, InputError
from dflash_prep.formats.fileio import (atomic_write_bytes, atomic_write_json, fingerprint_array, fingerprint_bytes,
                                        fingerprint_file, fingerprint_json, load_npy, read_json)

DATASET_FORMAT = "dflash-prep/dataset"
DATASET_VERSION = 2
DATASET_VERSIONS = (1, 2)   # lengths-only readers (analyze, pack) accept v1; open_dataset needs v2
LENGTHS_FILE = "lengths.npy"
META_FILE = "meta.json"
SHARD_FORMAT = "dflash-prep/shard"
SHARD_VERSION = 2      # v2: the source_id column (the record's own id)
SHARD_VERSIONS = (1, 2)
FIX = "the folder is corrupt or was edited; re-run `dflash-prep tokenize --overwrite`"


def batch_digest(ids: np.ndarray, mask: np.ndarray, lengths: np.ndarray) -> str:
    """Digest of one record batch's payload: int32 ids, uint8 mask, int32 lengths."""
    return fingerprint_bytes(memoryview(np.ascontiguousarray(ids, np.int32)).cast("B"),
                             memoryview(np.ascontiguousarray(mask, np.uint8)).cast("B"),
                             memoryview(np.ascontiguousarray(lengths, np.int32)).cast("B"))


class SampleOutOfRange(InputError, IndexError):
    """A sample id beyond the dataset (also an IndexError, as sequence indexing raises)."""


# ----------------------------------------------------------------------------- meta.json
def meta_fingerprint(meta: dict) -> str:
    """Fingerprint of every field of ``meta.json`` except itself and the format header."""
    return fingerprint_json({k: v for k, v in meta.items() if k not in ("format", "version", "meta_fingerprint")})


def write_meta(folder: Path, meta: dict) -> dict:
    """Write ``meta.json`` (with its ``meta_fingerprint``) atomically; returns what was written."""
    meta = dict(meta)
    meta["meta_fingerprint"] = meta_fingerprint(meta)
    atomic_write_json(Path(folder) / META_FILE, meta, format=DATASET_FORMAT, version=DATASET_VERSION)
    return meta


def _need(obj: dict, path: Path, *keys: str):
    """``obj[k1][k2]...`` or a FormatError naming the missing field and the file."""
    cur = obj
    for i, k in enumerate(keys):
        if not isinstance(cur, dict) or k not in cur:
            raise FormatError(f"{path}: field {'.'.join(keys[:i + 1])!r} is missing; {FIX}")
        cur = cur[k]
    return cur


def read_meta(folder: str | Path, *, versions: tuple[int, ...] = DATASET_VERSIONS) -> dict:
    """Read and check ``meta.json``: format, version, ``meta_fingerprint`` when present."""
    path = Path(folder) / META_FILE
    meta = read_json(path, format=DATASET_FORMAT, versions=versions)
    want = meta.get("meta_fingerprint")
    if (want is not None or meta.get("version") == DATASET_VERSION) and want != meta_fingerprint(meta):
        raise FingerprintMismatch(f"{path}: fields do not match meta_fingerprint (edited by hand or corrupt); {FIX}")
    _need(meta, path, "fingerprint")
    return meta


# ----------------------------------------------------------------------------- shards (writer)
def features_dict() -> dict:
    """The ``datasets`` Features of a shard (also stored in its schema metadata)."""
    import datasets

    return datasets.Features({
        "id": datasets.Value("int64"), "record": datasets.Value("int64"),
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("uint8")),
        "length": datasets.Value("int32"), "source_id": datasets.Value("string"),
    }).to_dict()


class ShardWriter:
    """Appends chunks to ``shard-NNNNN.arrow`` files of at most ``max_bytes`` payload each.

    :meth:`finish` closes the last shard and adds each shard's ``file_bytes`` and content
    ``sha256`` (one streamed read per shard, from the page cache just written).
    """

    def __init__(self, folder: Path, max_bytes: int, dataset_key: str):
        import pyarrow as pa

        self.pa, self.folder, self.max_bytes, self.key = pa, folder, max_bytes, dataset_key
        self.features = features_dict()
        self.shards: list[dict] = []
        self.writer = None
        self.next_id = 0

    def _open(self):
        pa = self.pa
        name = f"shard-{len(self.shards):05d}.arrow"
        meta = {"format": SHARD_FORMAT, "version": SHARD_VERSION, "first_id": self.next_id, "inputs": self.key}
        schema = pa.schema(
            [("id", pa.int64()), ("record", pa.int64()), ("input_ids", pa.list_(pa.int32())),
             ("loss_mask", pa.list_(pa.uint8())), ("length", pa.int32()), ("source_id", pa.string())],
            metadata={"dflash-prep": json.dumps(meta), "huggingface": json.dumps({"info": {"features": self.features}})},
        )
        self.sink = pa.OSFile(str(self.folder / name), "wb")
        self.schema = schema
        self.writer = pa.ipc.new_stream(self.sink, schema)
        self.shards.append({"file": name, "first_id": self.next_id, "rows": 0, "tokens": 0, "bytes": 0,
                            "batches": []})

    def _close(self):
        if self.writer is not None:
            self.writer.close()
            self.sink.close()
            self.writer = None

    def add(self, ids: np.ndarray, mask: np.ndarray, lengths: np.ndarray, records: np.ndarray,
            source_ids: list | None = None) -> None:
        pa = self.pa
        if source_ids is None:
            source_ids = [None] * len(lengths)
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        row_bytes = 5 * lengths.astype(np.int64) + 28  # ids + mask + id + record + length + 2 offsets
        lo = 0
        while lo < len(lengths):
            if self.writer is None:
                self._open()
            cur = self.shards[-1]
            room = self.max_bytes - cur["bytes"]
            fit = int(np.searchsorted(np.cumsum(row_bytes[lo:]), room, side="right"))
            if fit == 0:
                if cur["rows"]:
                    self._close()
                    continue
                fit = 1  # one sample larger than a shard gets a shard of its own
            hi = lo + fit
            a, b = int(offsets[lo]), int(offsets[hi])
            rel = (offsets[lo:hi + 1] - a).astype(np.int32)  # per-batch list offsets, < 2**31
            batch = pa.record_batch([
                pa.array(np.arange(self.next_id, self.next_id + fit, dtype=np.int64)),
                pa.array(records[lo:hi]),
                pa.ListArray.from_arrays(pa.array(rel), pa.array(ids[a:b])),
                pa.ListArray.from_arrays(pa.array(rel), pa.array(mask[a:b])),
                pa.array(lengths[lo:hi]),
                pa.array(source_ids[lo:hi], pa.string()),
            ], schema=self.schema)
            self.writer.write_batch(batch)
            cur["batches"].append(batch_digest(ids[a:b], mask[a:b], lengths[lo:hi]))
            cur["rows"] += fit
            cur["tokens"] += b - a
            cur["bytes"] += int(row_bytes[lo:hi].sum())
            self.next_id += fit
            lo = hi

    def finish(self) -> list[dict]:
        self._close()
        for sh in self.shards:
            path = self.folder / sh["file"]
            sh["file_bytes"] = path.stat().st_size
            sh["sha256"] = fingerprint_file(path)
        return self.shards


def write_hf_files(folder: Path, shards: list[dict], fp: str) -> None:
    """``state.json`` + ``dataset_info.json``: the files ``datasets.load_from_disk`` reads (its formats)."""
    state = {"_data_files": [{"filename": s["file"]} for s in shards], "_fingerprint": fp[:16],
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
             "_output_all_columns": False, "_split": None}
    info = {"citation": "", "description": "dflash-prep tokenized dataset", "features": features_dict(),
            "homepage": "", "license": ""}
    atomic_write_bytes(folder / "state.json", json.dumps(state, indent=2).encode())
    atomic_write_bytes(folder / "dataset_info.json", json.dumps(info, indent=2).encode())


# ----------------------------------------------------------------------------- reader
class Dataset:
    """A tokenized dataset: ``len``, ``fingerprint``, ``meta``, ``lengths``, ``sample(i)``."""

    def __init__(self, folder: str | Path):
        import pyarrow as pa

        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise InputError(f"{self.folder}: dataset folder not found; run `dflash-prep tokenize` first")
        meta_path = self.folder / META_FILE
        self.meta = read_meta(self.folder, versions=(DATASET_VERSION,))
        self.fingerprint: str = str(self.meta["fingerprint"])
        self.lengths = load_npy(self.folder / LENGTHS_FILE, dtype=np.int32)  # (N,) int32 memmap
        fix = FIX
        if _need(self.meta, meta_path, "lengths", "fingerprint") != fingerprint_array(self.lengths):
            raise FingerprintMismatch(f"{self.folder / LENGTHS_FILE}: does not match the fingerprint in meta.json; {fix}")
        n_meta = int(_need(self.meta, meta_path, "counts", "samples"))
        if n_meta != self.lengths.shape[0]:
            raise FormatError(f"{self.folder}: meta.json counts {n_meta} samples but "
                              f"lengths.npy holds {self.lengths.shape[0]}; {fix}")
        _need(self.meta, meta_path, "tokenizer", "vocab_size")
        self._batches_ids: list[np.ndarray] = []    # per record batch: flat int32 values
        self._batches_mask: list[np.ndarray] = []   # per record batch: flat uint8 values
        self._batches_off: list[np.ndarray] = []    # per record batch: (rows + 1,) int32 offsets
        starts, shard_of_batch, digests = [], [], []
        self._maps = []
        expect_first = 0
        for si, sh in enumerate(_need(self.meta, meta_path, "shards")):
            for key in ("file", "first_id", "rows", "file_bytes", "sha256", "batches"):
                _need(sh, meta_path, key)
            path = self.folder / sh["file"]
            if not path.is_file():
                raise FormatError(f"{path}: shard listed in meta.json is missing; {fix}")
            if path.stat().st_size != int(sh["file_bytes"]):
                raise FormatError(f"{path}: {path.stat().st_size} bytes, meta.json records {sh['file_bytes']} "
                                  f"(truncated or replaced); {fix}")
            if int(sh["first_id"]) != expect_first:
                raise FormatError(f"{meta_path}: shard {sh['file']} starts at id {sh['first_id']}, "
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
            batches = [b for b in batches if b.num_rows]
            if len(batches) != len(sh["batches"]):
                raise FormatError(f"{path}: {len(batches)} record batches, meta.json records {len(sh['batches'])}; {fix}")
            digests += sh["batches"]
            for b in batches:
                n = b.num_rows
                try:
                    ids_col, mask_col = b.column("input_ids"), b.column("loss_mask")
                    off = ids_col.offsets.to_numpy()                           # (n + 1,) int32
                    mask_off = mask_col.offsets.to_numpy()
                    lens = b.column("length").to_numpy()
                except (KeyError, AttributeError, pa.ArrowException) as e:
                    raise FormatError(f"{path}: unexpected shard columns ({e}); {fix}") from None
                if not np.array_equal(off, mask_off):
                    raise FormatError(f"{path}: input_ids and loss_mask rows differ in length; {fix}")
                if not np.array_equal(lens, self.lengths[first:first + n]) or not np.array_equal(np.diff(off), lens):
                    raise FormatError(f"{path}: rows {first}..{first + n - 1} disagree with lengths.npy; {fix}")
                self._batches_ids.append(ids_col.values.to_numpy(zero_copy_only=True))
                self._batches_mask.append(mask_col.values.to_numpy(zero_copy_only=True))
                self._batches_off.append(off)
                starts.append(first)
                shard_of_batch.append(si)
                first += n
            if first - expect_first != int(sh["rows"]):
                raise FormatError(f"{path}: holds {first - expect_first} rows, meta.json says {sh['rows']}; {fix}")
            expect_first = first
        if expect_first != self.lengths.shape[0]:
            raise FormatError(f"{self.folder}: shards hold {expect_first} samples, lengths.npy {self.lengths.shape[0]}; {fix}")
        self._starts = np.asarray(starts, np.int64)
        self._shard_of_batch = np.asarray(shard_of_batch, np.int64)
        self._digests = digests
        self._checked = np.zeros(len(starts), bool)   # batches whose digest was verified

    def _check_batch(self, b: int) -> None:
        """Verify record batch ``b`` against its digest (once per process; see the module docstring)."""
        off = self._batches_off[b]
        if batch_digest(self._batches_ids[b], self._batches_mask[b], np.diff(off)) != self._digests[b]:
            first = int(self._starts[b])
            raise FormatError(f"{self.shard_of(first)}: token data of samples {first}..{first + len(off) - 2} do not "
                              f"match their digest in meta.json (corrupt or edited); {FIX}")
        self._checked[b] = True

    def _check_schema(self, schema, path: Path, first_id: int, fix: str) -> None:
        raw = (schema.metadata or {}).get(b"dflash-prep")
        try:
            head = json.loads(raw) if raw else {}
        except (json.JSONDecodeError, UnicodeDecodeError):
            head = {}
        if not isinstance(head, dict):
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

    def record_batches(self, check: bool = False):
        """``(first_id, ids, mask, offsets)`` per record batch, in id order (zero-copy views);
        ``check`` verifies each batch's digest first (as :meth:`sample` does)."""
        for b in range(len(self._starts)):
            if check and not self._checked[b]:
                self._check_batch(b)
            yield int(self._starts[b]), self._batches_ids[b], self._batches_mask[b], self._batches_off[b]

    def shard_of(self, i: int) -> Path:
        """The shard file that holds sample id ``i`` (for error messages)."""
        b = int(np.searchsorted(self._starts, int(i), side="right")) - 1
        return self.folder / self.meta["shards"][int(self._shard_of_batch[max(b, 0)])]["file"]

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids int32, loss_mask uint8)`` of sample id ``i``, zero-copy (read-only views)."""
        i = int(i)
        if not 0 <= i < len(self):
            raise SampleOutOfRange(f"{self.folder}: sample id {i} is out of range for a dataset of {len(self)} "
                                   "samples; the manifest belongs to other data, re-run `dflash-prep pack`")
        b = int(np.searchsorted(self._starts, i, side="right")) - 1
        if not self._checked[b]:
            self._check_batch(b)
        r = i - int(self._starts[b])
        off = self._batches_off[b]
        lo, hi = int(off[r]), int(off[r + 1])
        return self._batches_ids[b][lo:hi], self._batches_mask[b][lo:hi]


def open_dataset(folder: str | Path) -> Dataset:
    """Open and check a tokenized folder; errors name the file and the fix."""
    return Dataset(folder)
