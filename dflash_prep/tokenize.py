"""``dflash-prep tokenize``: corpora -> Arrow shards + ``lengths.npy`` + ``meta.json``.

Algorithm: load every input through ``datasets`` (:mod:`dflash_prep.records`), cut the
records into chunks of ``chunk_rows`` within one file, and let ``num_proc`` forked workers
validate, render (:func:`dflash_prep.encoders.render_chat`), tokenize and cut each chunk.
Results come back in chunk order (``imap``), so the output is byte-identical for any
``num_proc``. The parent only appends them to shards. ``num_proc=1`` runs in-process on two
threads so that Python work overlaps Rust encoding (:func:`_overlapped`). Measured against a
bare ``tokenizers.encode_batch`` on the same rendered texts (``bench/tokenize_speed.py``,
README bench-tokenize): the byte-level path is several times faster, and with a BPE the
stage at ``--num-proc`` = core count matches or beats the bare call.

Semantics:

- sample id = position in ``lengths.npy`` = rank among the *kept* records in input order;
  ``record`` is the record's global input index (skipped and dropped records leave gaps
  there, never in ids);
- ``--max-len`` / ``--on-overflow``: a longer sample keeps its first ``max_len`` tokens
  (``truncate``) or is left out (``drop``); both are counted, with the tokens they lose;
- ``--on-error fail`` stops at the first bad record, naming file and line/row; ``skip``
  skips and counts it (with the first few messages kept in ``meta.json``);
- the output folder is built in a temp folder beside it and renamed only on success, so a
  failure leaves nothing; an existing folder built from the same inputs, tokenizer and
  options is reported up to date; ``--overwrite`` rebuilds it.

Folder layout (format ``dflash-prep/dataset`` v1)::

    meta.json         format, version, fingerprint, tokenizer, source, options, counts,
                      tokens, lengths fingerprint, shards [{file, first_id, rows, tokens, bytes}]
    lengths.npy       int32, one per sample id (analyze/pack read only this and meta.json)
    supervised.npy, anchor_candidates.npy
                      int32 per sample id: loss-mask tokens S and DFlash anchor candidates
                      C = sum lm[t]*lm[t+1] (pack --objective dflash budgets anchors from them)
    shard-00000.arrow Arrow IPC stream: id int64, record int64, input_ids list<int32>,
                      loss_mask list<uint8>, length int32; schema metadata carries
                      {"format": "dflash-prep/shard", "version": 1, "first_id": ...}
    state.json, dataset_info.json   what ``datasets.load_from_disk`` reads
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import __version__
from . import records as rec
from .errors import ConfigError, FormatError, InputError
from .fileio import atomic_dir, atomic_save_npy, atomic_write_bytes, atomic_write_json, fingerprint_array, fingerprint_json, read_json
from .lengths import DATASET_FORMAT, LENGTHS_FILE, META_FILE, chunk_mask_counts, write_mask_counts
from .encoders import load_tokenizer, render_chat

DATASET_VERSION = 1
SHARD_FORMAT = "dflash-prep/shard"
SHARD_VERSION = 1
MAX_EXAMPLES = 5


@dataclass(frozen=True)
class TokenizeConfig:
    """Options of ``dflash-prep tokenize``.

    Attributes:
        inputs: paths, globs or folders (see :mod:`dflash_prep.records`).
        out: the dataset folder to write.
        tokenizer: ``"byte"`` or a local tokenizer folder / ``tokenizer.json``.
        format: ``auto``, ``messages``, ``sharegpt`` or ``text``.
        text_field: the text column for ``--format text``.
        max_len: longest sample kept, in tokens.
        on_overflow: ``truncate`` (keep the first max_len tokens) or ``drop``.
        on_error: ``fail`` at the first bad record, or ``skip`` and count it.
        num_proc: worker processes (1 = in-process).
        shard_mb: upper bound of one shard's payload in MiB (a single longer sample is alone).
        chunk_rows: records per work unit.
        overwrite: replace an existing output folder.
    """

    inputs: tuple[str, ...]
    out: Path
    tokenizer: str = "byte"
    format: str = "auto"
    text_field: str = "text"
    max_len: int = 8192
    on_overflow: str = "truncate"
    on_error: str = "fail"
    num_proc: int = 1
    shard_mb: float = 256
    chunk_rows: int = 512
    overwrite: bool = False

    def __post_init__(self):
        if not self.inputs:
            raise ConfigError("give at least one input path or glob")
        if self.format not in rec.FORMATS:
            raise ConfigError(f"--format must be one of {', '.join(rec.FORMATS)}, got {self.format!r}")
        if self.max_len < 1:
            raise ConfigError(f"--max-len must be at least 1, got {self.max_len}")
        if self.on_overflow not in ("truncate", "drop"):
            raise ConfigError(f"--on-overflow must be 'truncate' or 'drop', got {self.on_overflow!r}")
        if self.on_error not in ("fail", "skip"):
            raise ConfigError(f"--on-error must be 'fail' or 'skip', got {self.on_error!r}")
        if self.num_proc < 1:
            raise ConfigError(f"--num-proc must be at least 1, got {self.num_proc}")
        if self.shard_mb <= 0 or self.chunk_rows < 1:
            raise ConfigError("--shard-mb and chunk_rows must be positive")

    def options(self) -> dict:
        """The fields that change the output (fingerprinted)."""
        return {k: getattr(self, k) for k in ("format", "text_field", "max_len", "on_overflow", "on_error")}


# ----------------------------------------------------------------------------- workers
_STATE: dict = {}


def _init_worker(state: dict | None) -> None:
    if state is not None:  # spawn start method: nothing inherited
        _STATE.update(state)
    # Processes are the parallelism here; a rayon pool inherited through fork is also a
    # known deadlock when the parent has used it (e.g. TOKENIZERS_PARALLELISM=true).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if "tok" not in _STATE:
        _STATE["tok"] = load_tokenizer(_STATE["tokenizer"])


def _process(task: tuple[int, int, int]) -> dict:
    """Validate, render, tokenize and cut one chunk of one source."""
    si, start, stop = task
    src: rec.Source = _STATE["sources"][si]
    cfg: TokenizeConfig = _STATE["cfg"]
    tok = _STATE["tok"]
    chat = src.schema != "text"
    stats = {"truncated": 0, "dropped": 0, "skipped": 0, "no_loss": 0, "cut_tokens": 0, "dropped_tokens": 0}
    examples: list[str] = []
    segs, rows = [], []

    def bad(row: int, reason: str) -> None:
        if cfg.on_error == "fail":
            raise rec.RecordError(src.path, row, reason, src.lines[row] if src.lines is not None else None)
        stats["skipped"] += 1
        if len(examples) < MAX_EXAMPLES:
            examples.append(str(rec.RecordError(src.path, row, reason, src.lines[row] if src.lines is not None else None)))

    for off, value in enumerate(src.get(start, stop)):
        row = start + off
        try:
            if chat:
                segs.append(render_chat(tok, rec.to_messages(value, src.schema)))
            else:
                segs.append([(rec.to_text(value, src.field), True)])
            rows.append(row)
        except (ValueError, InputError) as e:
            bad(row, str(e))
    ids_l, mask_l, lens, records = [], [], [], []
    for row, (ids, mask) in zip(rows, tok.encode_segments_batch(segs, chat=chat) if segs else []):
        n = ids.shape[0]
        if n == 0:
            bad(row, "the record produced no tokens")
            continue
        if n > cfg.max_len:
            if cfg.on_overflow == "drop":
                stats["dropped"] += 1
                stats["dropped_tokens"] += n
                continue
            stats["truncated"] += 1
            stats["cut_tokens"] += n - cfg.max_len
            ids, mask = ids[: cfg.max_len], mask[: cfg.max_len]
        if not mask.any():
            stats["no_loss"] += 1
        ids_l.append(ids)
        mask_l.append(mask)
        lens.append(ids.shape[0])
        records.append(src.first_record + row)
    return {
        "ids": np.concatenate(ids_l) if ids_l else np.zeros(0, np.int32),   # (sum L,) int32
        "mask": np.concatenate(mask_l) if mask_l else np.zeros(0, np.uint8),  # (sum L,) uint8
        "lengths": np.asarray(lens, np.int32),                              # (n,)
        "records": np.asarray(records, np.int64),                           # (n,)
        "rows": stop - start, "stats": stats, "examples": examples,
    }


# ----------------------------------------------------------------------------- shards
def _features_dict() -> dict:
    import datasets

    return datasets.Features({
        "id": datasets.Value("int64"), "record": datasets.Value("int64"),
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("uint8")),
        "length": datasets.Value("int32"),
    }).to_dict()


class _ShardWriter:
    """Appends chunks to ``shard-NNNNN.arrow`` files of at most ``max_bytes`` payload each."""

    def __init__(self, folder: Path, max_bytes: int, dataset_key: str):
        import pyarrow as pa

        self.pa, self.folder, self.max_bytes, self.key = pa, folder, max_bytes, dataset_key
        self.features = _features_dict()
        self.shards: list[dict] = []
        self.writer = None
        self.next_id = 0

    def _open(self):
        pa = self.pa
        name = f"shard-{len(self.shards):05d}.arrow"
        meta = {"format": SHARD_FORMAT, "version": SHARD_VERSION, "first_id": self.next_id, "inputs": self.key}
        schema = pa.schema(
            [("id", pa.int64()), ("record", pa.int64()), ("input_ids", pa.list_(pa.int32())),
             ("loss_mask", pa.list_(pa.uint8())), ("length", pa.int32())],
            metadata={"dflash-prep": json.dumps(meta), "huggingface": json.dumps({"info": {"features": self.features}})},
        )
        self.sink = pa.OSFile(str(self.folder / name), "wb")
        self.schema = schema
        self.writer = pa.ipc.new_stream(self.sink, schema)
        self.shards.append({"file": name, "first_id": self.next_id, "rows": 0, "tokens": 0, "bytes": 0})

    def _close(self):
        if self.writer is not None:
            self.writer.close()
            self.sink.close()
            self.writer = None

    def add(self, ids: np.ndarray, mask: np.ndarray, lengths: np.ndarray, records: np.ndarray) -> None:
        pa = self.pa
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
            ], schema=self.schema)
            self.writer.write_batch(batch)
            cur["rows"] += fit
            cur["tokens"] += b - a
            cur["bytes"] += int(row_bytes[lo:hi].sum())
            self.next_id += fit
            lo = hi

    def finish(self) -> list[dict]:
        self._close()
        return self.shards


# ----------------------------------------------------------------------------- the stage
def tokenize(cfg: TokenizeConfig, *, progress: bool = False) -> dict:
    """Run the stage; returns ``meta.json``'s content plus ``up_to_date`` and ``path``."""
    files = rec.expand(list(cfg.inputs))
    tok = load_tokenizer(cfg.tokenizer)
    source_fp = rec.fingerprint(files)
    key = fingerprint_json({"source": source_fp, "tokenizer": tok.info.fingerprint, "options": cfg.options(),
                            "version": DATASET_VERSION})
    out = Path(cfg.out)
    if out.exists():
        try:
            old = read_json(out / META_FILE, format=DATASET_FORMAT, versions=(DATASET_VERSION,))
        except FormatError:
            old = {}
        if not cfg.overwrite:
            if old.get("inputs_fingerprint") == key:
                return {**old, "up_to_date": True, "path": str(out)}
            what = "was built from other inputs, tokenizer or options" if old else "is not a dflash-prep dataset"
            raise ConfigError(f"{out} exists and {what}; pass --overwrite to replace it or choose another --out")
    sources, cleanup = rec.open_all(files, fmt=cfg.format, text_field=cfg.text_field, on_error=cfg.on_error)
    try:
        with atomic_dir(out, overwrite=cfg.overwrite) as tmp:
            meta = _run(cfg, tok, sources, tmp, key, progress)
            meta["source"] = {"fingerprint": source_fp, "files": [{"path": p, "kind": k} for p, k in files],
                              "schemas": sorted({s.schema for s in sources})}
            atomic_write_json(tmp / META_FILE, meta, format=DATASET_FORMAT, version=DATASET_VERSION)
    finally:
        cleanup()
    return {"format": DATASET_FORMAT, "version": DATASET_VERSION, **meta, "up_to_date": False, "path": str(out)}


def _tasks(sources, chunk: int):
    for si, s in enumerate(sources):
        for a in range(0, len(s), chunk):
            yield si, a, min(a + chunk, len(s))


def _overlapped(fn, tasks, threads: int = 2, window: int = 4):
    """``map(fn, tasks)`` in order on two threads, at most ``window`` chunks in flight.

    ``encode_batch`` releases the GIL, so one chunk's Python work (validation, rendering,
    masks) overlaps the next chunk's Rust encoding. On the 20k-sample BPE benchmark this
    took ``--num-proc 1`` from 0.58x to the figure in the README's bench-tokenize table.
    """
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads) as ex:
        inflight: deque = deque()
        for t in tasks:
            inflight.append(ex.submit(fn, t))
            if len(inflight) >= window:
                yield inflight.popleft().result()
        while inflight:
            yield inflight.popleft().result()


def _run(cfg: TokenizeConfig, tok, sources, tmp: Path, key: str, progress: bool) -> dict:
    total_rows = sum(len(s) for s in sources)
    writer = _ShardWriter(tmp, int(cfg.shard_mb * 2**20), key)
    stats = {"truncated": 0, "dropped": 0, "skipped": sum(s.bad_lines for s in sources), "no_loss": 0,
             "cut_tokens": 0, "dropped_tokens": 0}
    examples: list[str] = [e for s in sources for e in s.bad_examples][:MAX_EXAMPLES]
    lengths, mask_counts, loss_tokens = [], [], 0
    _STATE.clear()
    _STATE.update(sources=sources, cfg=cfg, tokenizer=cfg.tokenizer, tok=tok)
    bar = _progress(progress, total_rows)
    pool = None
    try:
        if cfg.num_proc > 1:
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            state = None if ctx.get_start_method() == "fork" else {k: v for k, v in _STATE.items() if k != "tok"}
            pool = ctx.Pool(cfg.num_proc, initializer=_init_worker, initargs=(state,))
            results = pool.imap(_process, _tasks(sources, cfg.chunk_rows), chunksize=1)
        else:
            results = _overlapped(_process, _tasks(sources, cfg.chunk_rows))
        for r in results:
            writer.add(r["ids"], r["mask"], r["lengths"], r["records"])
            lengths.append(r["lengths"])
            mask_counts.append(chunk_mask_counts(r["mask"], r["lengths"]))
            loss_tokens += int(r["mask"].sum(dtype=np.int64))
            for k, v in r["stats"].items():
                stats[k] += v
            examples += r["examples"][: MAX_EXAMPLES - len(examples)]
            bar.advance(r["rows"])
    except rec.RecordError as e:
        src = next(s for s in sources if s.path == e.path)
        raise rec.RecordError(e.path, e.row, e.reason, e.line if e.line is not None else src.line_of(e.row)) from None
    finally:
        bar.stop()
        if pool is not None:
            pool.terminate()
            pool.join()
        _STATE.clear()
    shards = writer.finish()
    lengths_arr = np.concatenate(lengths) if lengths else np.zeros(0, np.int32)  # (N,) int32
    if lengths_arr.shape[0] == 0:
        raise InputError(f"no samples left out of {total_rows} records (skipped {stats['skipped']}, dropped "
                         f"{stats['dropped']}); check --format, --on-error and --max-len")
    atomic_save_npy(tmp / LENGTHS_FILE, lengths_arr)
    lengths_fp = fingerprint_array(lengths_arr)
    mask_meta = write_mask_counts(tmp, mask_counts)   # supervised.npy + anchor_candidates.npy
    n = int(lengths_arr.shape[0])
    total = int(lengths_arr.sum(dtype=np.int64))
    meta = {
        "fingerprint": fingerprint_json({"inputs": key, "lengths": lengths_fp}),
        "inputs_fingerprint": key,
        "created_by": f"dflash-prep {__version__}",
        "tokenizer": {**tok.info.to_dict(), "chat_template": "own" if tok.chat_template else "built-in ChatML"},
        "options": cfg.options(),
        "counts": {"samples": n, "records": total_rows + sum(s.bad_lines for s in sources),
                   "truncated": stats["truncated"], "dropped": stats["dropped"], "skipped": stats["skipped"],
                   "no_loss": stats["no_loss"]},
        "tokens": {"total": total, "loss": loss_tokens, "cut_by_truncation": stats["cut_tokens"],
                   "in_dropped": stats["dropped_tokens"], "max_len": int(lengths_arr.max())},
        "skipped_examples": examples,
        "lengths": {"file": LENGTHS_FILE, "dtype": "int32", "fingerprint": lengths_fp},
        **mask_meta,
        "shards": shards,
    }
    _write_hf_files(tmp, shards, meta["fingerprint"])
    return meta


def _write_hf_files(folder: Path, shards: list[dict], fp: str) -> None:
    """``state.json`` + ``dataset_info.json``: the files ``datasets.load_from_disk`` reads (its formats)."""
    state = {"_data_files": [{"filename": s["file"]} for s in shards], "_fingerprint": fp[:16],
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
             "_output_all_columns": False, "_split": None}
    info = {"citation": "", "description": "dflash-prep tokenized dataset", "features": _features_dict(),
            "homepage": "", "license": ""}
    atomic_write_bytes(folder / "state.json", json.dumps(state, indent=2).encode())
    atomic_write_bytes(folder / "dataset_info.json", json.dumps(info, indent=2).encode())


class _NoBar:
    def advance(self, n):
        pass

    def stop(self):
        pass


class _RichBar:
    def __init__(self, total: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

        self.p = Progress("tokenize", BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), transient=True)
        self.t = self.p.add_task("tokenize", total=total)
        self.p.start()

    def advance(self, n):
        self.p.advance(self.t, n)

    def stop(self):
        self.p.stop()


def _progress(on: bool, total: int):
    return _RichBar(total) if on else _NoBar()


def summary_rows(meta: dict) -> list[tuple[str, str]]:
    """Human-readable lines for the CLI report."""
    c, t = meta["counts"], meta["tokens"]
    return [
        ("samples", f"{c['samples']:,} of {c['records']:,} records"),
        ("tokens", f"{t['total']:,} ({t['loss']:,} trained on, longest {t['max_len']:,})"),
        ("truncated", f"{c['truncated']:,} samples, {t['cut_by_truncation']:,} tokens cut"),
        ("dropped", f"{c['dropped']:,} samples, {t['in_dropped']:,} tokens"),
        ("skipped", f"{c['skipped']:,} bad records"),
        ("no loss tokens", f"{c['no_loss']:,} samples"),
        ("shards", f"{len(meta['shards'])}"),
        ("tokenizer", f"{meta['tokenizer']['name']} (vocab {meta['tokenizer']['vocab_size']:,})"),
        ("fingerprint", meta["fingerprint"]),
    ]
