"""``dflash-prep tokenize``: corpora -> Arrow shards + ``lengths.npy`` + ``meta.json``.

Algorithm: load every input through ``datasets`` (:mod:`dflash_prep.tokenize.records`), cut the
records into chunks of ``chunk_rows`` within one file, and let ``num_proc`` forked workers
validate, render (:mod:`dflash_prep.tokenize.chat`), tokenize and cut each chunk
(:func:`dflash_prep.tokenize.chunk.process_records`, pure, the work unit of any engine).
Results come back in chunk order (``imap``), so the output is byte-identical for any
``num_proc``. The parent only appends them to shards; ``--engine ray`` runs the same
chunks as Ray tasks, results in the same order (:mod:`dflash_prep.tokenize.ray_engine`).
``num_proc=1`` runs in-process on two threads so that Python work overlaps Rust encoding
(:func:`_overlapped`). The whole stage against a bare ``tokenizers.encode_batch`` on the same
rendered texts (``bench/tokenize_speed.py``): the built-in byte path is faster than the bare
call, a BPE through transformers about on par with it; the figures are in
docs/benchmarks.md#tokenize-throughput.

Semantics:

- sample id = position in ``lengths.npy`` = rank among the *kept* rows in input order;
  ``record`` is the record's global input index (skipped and dropped records leave gaps
  there, never in ids; the rows of an expanded conversation share it);
- the ids and loss mask of a chat record: :mod:`dflash_prep.tokenize.chat` and
  :mod:`dflash_prep.tokenize.encoders` (transformers' own rendering, ids and assistant mask);
- ``--max-len`` / ``--on-overflow``: a longer sample keeps its first ``max_len`` tokens
  (``truncate``) or is left out (``drop``); both are counted, with the tokens they lose;
- ``--on-error fail`` stops at the first bad record, naming file and line/row; ``skip``
  skips and counts it (with the first few messages kept in ``meta.json``);
- the output folder is built in a temp folder beside it and renamed only on success, so a
  failure or a kill leaves nothing under ``--out``; an existing folder built from the same
  inputs, tokenizer and options is reported up to date (inputs by content, see
  :func:`dflash_prep.tokenize.records.fingerprint`); ``--overwrite`` rebuilds it, but
  only when it holds a dataset ``meta.json`` (never a user's folder, an input or the
  working directory: :func:`dflash_prep.formats.outputs.check_out`). The write holds the folder's
  advisory lock, and first clears the debris of killed runs (:mod:`dflash_prep.formats.outputs`).
- ``meta.json``'s ``serving_mode``: the thinking mode the data was made in, from regenerate's
  per-record ``--reasoning`` or ``--thinking on|off``, and the chat template's SHA-256
  (:mod:`dflash_prep.tokenize.thinking`); the trainer carries it into the drafter's export;
- inputs are checked before loading (:mod:`dflash_prep.tokenize.inputcheck`): regular files only
  (no FIFO or device), UTF-8, JSON nested at most 64 levels.

The folder layout, its writer (shards with content hashes, ``meta.json``) and its reader
live in :mod:`dflash_prep.formats.dataset`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_prep import __version__
from dflash_prep.errors import ConfigError, DflashError, FormatError, InputError
from dflash_prep.formats import outputs
from dflash_prep.formats.dataset import (DATASET_FORMAT, DATASET_VERSION, LENGTHS_FILE, META_FILE,  # noqa: F401
                                         SHARD_FORMAT, SHARD_VERSION, ShardWriter, read_meta, write_hf_files,
                                         write_meta)
from dflash_prep.formats.fileio import atomic_dir, atomic_save_npy, fingerprint_array, fingerprint_json, holds_marker
from dflash_prep.formats.lengths import write_mask_counts
from dflash_prep.objectives.anchors import chunk_mask_counts
from dflash_prep.progress import progress as progress_
from dflash_prep.tokenize import inputcheck
from dflash_prep.tokenize import records as rec
from dflash_prep.tokenize.chat import MaskOptions, read_template_arg
from dflash_prep.tokenize.chunk import MAX_EXAMPLES, BadRecord, process_records
from dflash_prep.tokenize.encoders import load_tokenizer
from dflash_prep.tokenize.identity import chat_template_sha256
from dflash_prep.tokenize.thinking import THINKING, describe, serving_mode, serving_mode_of, zero_counts
from dflash_prep.tokenize.ray_engine import ray_results

MAX_SHARD_MB = 1 << 20  # 1 TiB: beyond any file system's comfort, and finite


@dataclass(frozen=True)
class TokenizeConfig:
    """Options of ``dflash-prep tokenize``.

    Attributes:
        inputs: paths, globs or folders (see :mod:`dflash_prep.tokenize.records`).
        out: the dataset folder to write.
        tokenizer: ``"byte"`` or a local tokenizer folder / ``tokenizer.json`` (required).
        chat_template: ``--chat-template``: a Jinja file or ``chatml``; sets or overrides the tokenizer's.
        format: ``auto``, ``messages``, ``sharegpt``, ``alpaca``, ``prompt_completion`` or ``text``.
        text_field: the text column for ``--format text``.
        messages_field: the message-list column for ``--format messages``.
        role_map: ``--role-map`` ``NAME=ROLE,...`` added to the built-in role names.
        mask: what the loss mask covers (:class:`dflash_prep.tokenize.chat.MaskOptions`).
        max_len: longest sample kept, in tokens.
        on_overflow: ``truncate`` (keep the first max_len tokens) or ``drop``.
        on_error: ``fail`` at the first bad record, or ``skip`` and count it.
        num_proc: worker processes (1 = in-process).
        shard_mb: upper bound of one shard's payload in MiB (a single longer sample is alone).
        chunk_rows: records per work unit.
        overwrite: replace an existing output folder.
        engine: ``local`` (this machine's processes) or ``ray`` (:mod:`dflash_prep.tokenize.ray_engine`);
            the output is byte-identical, so it is not fingerprinted.
        address: ``--address`` of the Ray cluster (``auto``: the one ``ray start`` runs here;
            None: a Ray started for this run).
        thinking: ``--thinking``: ``auto`` records the serving mode the records say
            (:mod:`dflash_prep.tokenize.thinking`); ``on``/``off`` declares it for data that does not
            say (refused when records contradict it). Changes only ``meta.json``'s ``serving_mode``.
    """

    inputs: tuple[str, ...]
    out: Path
    tokenizer: str
    chat_template: str | None = None
    format: str = "auto"
    text_field: str = "text"
    messages_field: str = "messages"
    role_map: str = ""
    mask: MaskOptions = MaskOptions()
    max_len: int = 8192
    on_overflow: str = "truncate"
    on_error: str = "fail"
    num_proc: int = 1
    shard_mb: float = 256
    chunk_rows: int = 512
    overwrite: bool = False
    engine: str = "local"
    address: str | None = None
    thinking: str = "auto"

    def __post_init__(self):
        if not self.inputs:
            raise ConfigError("give at least one input path or glob")
        if not self.tokenizer:
            raise ConfigError("--tokenizer is required: 'byte' (built in) or a local tokenizer folder")
        rec.parse_role_map(self.role_map)
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
        if not (isinstance(self.shard_mb, (int, float)) and 0 < self.shard_mb <= MAX_SHARD_MB):
            raise ConfigError(f"--shard-mb must be a finite number in (0, {MAX_SHARD_MB}], got {self.shard_mb}")
        if self.engine not in ("local", "ray"):
            raise ConfigError(f"--engine must be 'local' or 'ray', got {self.engine!r}")
        if self.chunk_rows < 1:
            raise ConfigError("chunk_rows must be positive")
        if self.thinking not in THINKING:
            raise ConfigError(f"--thinking must be one of {', '.join(THINKING)}, got {self.thinking!r}")

    def options(self) -> dict:
        """The fields that change the output (fingerprinted; the template is in the tokenizer's fingerprint).

        ``thinking`` only when declared: ``auto`` is what every dataset was before the option
        existed, so their fingerprints (and the shards that carry them) stay what they were."""
        keys = ("format", "text_field", "messages_field", "role_map", "max_len", "on_overflow", "on_error")
        declared = {"thinking": self.thinking} if self.thinking != "auto" else {}
        return {**{k: getattr(self, k) for k in keys}, "mask": self.mask.to_dict(), **declared}


# ----------------------------------------------------------------------------- workers
_STATE: dict = {}


def _init_worker(state: dict | None) -> None:
    if state is not None:  # spawn start method: nothing inherited
        _STATE.update(state)
    # Processes are the parallelism here; a rayon pool inherited through fork is also a
    # known deadlock when the parent has used it (e.g. TOKENIZERS_PARALLELISM=true).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if "tok" not in _STATE:
        cfg: TokenizeConfig = _STATE["cfg"]
        template = read_template_arg(cfg.chat_template) if cfg.chat_template is not None else None
        _STATE["tok"] = load_tokenizer(cfg.tokenizer, chat_template=template)


def _process(task: tuple[int, int, int]) -> dict:
    """One chunk of one source: :func:`dflash_prep.tokenize.chunk.process_records` on it, errors placed."""
    si, start, stop = task
    src: rec.Source = _STATE["sources"][si]
    try:
        out = process_records(_STATE["tok"], _STATE["cfg"], src.get(start, stop), schema=src.schema,
                              fields=src.fields, first_record=src.first_record + start)
    except BadRecord as e:
        raise rec.place_error(src, start, e.index, e.reason) from None
    out["examples"] = [str(rec.place_error(src, start, k, reason)) for k, reason in out["examples"]]
    return out


# ----------------------------------------------------------------------------- the stage
def tokenize(cfg: TokenizeConfig, *, progress: bool = False) -> dict:
    """Run the stage; returns ``meta.json``'s content plus ``up_to_date`` and ``path``."""
    files = rec.expand(list(cfg.inputs))
    out = outputs.check_out(cfg.out, inputs=[p for p, _ in files])
    inputcheck.check_inputs(files)
    template = read_template_arg(cfg.chat_template) if cfg.chat_template is not None else None
    tok = load_tokenizer(cfg.tokenizer, chat_template=template)
    source_fp = rec.fingerprint(files)
    key = fingerprint_json({"source": source_fp, "tokenizer": tok.info.fingerprint, "options": cfg.options(),
                            "version": DATASET_VERSION})
    with outputs.lock(out):
        if out.exists():
            try:
                old = read_meta(out)
            except DflashError:
                old = {}
            ours = holds_marker(out, META_FILE, DATASET_FORMAT)
            if old.get("version") != DATASET_VERSION:
                old = {}
            if old.get("inputs_fingerprint") == key:
                return {**old, "up_to_date": True, "path": str(out)}
            if not ours:
                raise ConfigError(f"{out} exists and holds no dflash-prep dataset meta.json; it was left untouched. "
                                  "Choose another --out (--overwrite replaces only a dataset folder)")
            if not cfg.overwrite:
                what = "was built from other inputs, tokenizer or options" if old else "was built by an older dflash-prep"
                raise ConfigError(f"{out} exists and {what}; pass --overwrite to replace it or choose another --out")
        outputs.remove_stale_caches()
        sources, cleanup = rec.open_all(files, fmt=cfg.format, text_field=cfg.text_field, on_error=cfg.on_error,
                                        messages_field=cfg.messages_field)
        try:
            chat_src = next((s for s in sources if s.schema != "text"), None)
            if chat_src is not None and tok.chat_template is None:
                raise ConfigError(f"{chat_src.path}: chat records, but the tokenizer {cfg.tokenizer} has no chat "
                                  "template (tokenizer_config.json chat_template or chat_template.jinja); pass "
                                  "--chat-template FILE|chatml to set one")
            with atomic_dir(out, overwrite=cfg.overwrite, marker=(META_FILE, DATASET_FORMAT)) as tmp:
                meta = _run(cfg, tok, sources, tmp, key, progress)
                meta["source"] = {"fingerprint": source_fp, "files": [{"path": p, "kind": k} for p, k in files],
                                  "schemas": sorted({s.schema for s in sources})}
                meta = write_meta(tmp, meta)
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
    masks) overlaps the next chunk's Rust encoding: what lets ``--num-proc 1`` keep up with
    a bare ``encode_batch`` (docs/benchmarks.md#tokenize-throughput).
    """
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
    writer = ShardWriter(tmp, int(cfg.shard_mb * 2**20), key)
    stats = {"truncated": 0, "dropped": 0, "skipped": sum(s.bad_lines for s in sources), "no_loss": 0,
             "cut_tokens": 0, "dropped_tokens": 0, "expanded": 0, "expanded_rows": 0, "escaped": 0}
    examples: list[str] = [e for s in sources for e in s.bad_examples][:MAX_EXAMPLES]
    lengths, mask_counts, loss_tokens = [], [], 0
    thinking = zero_counts()   # records that produced samples, per serving mode
    _STATE.clear()
    _STATE.update(sources=sources, cfg=cfg, tokenizer=cfg.tokenizer, tok=tok)
    bar = _progress(progress, total_rows)
    pool = None
    try:
        if cfg.engine == "ray":  # same tasks, same order, on a Ray cluster
            results = ray_results(cfg, sources, _tasks(sources, cfg.chunk_rows))
        elif cfg.num_proc > 1:
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            state = None if ctx.get_start_method() == "fork" else {k: v for k, v in _STATE.items() if k != "tok"}
            pool = ctx.Pool(cfg.num_proc, initializer=_init_worker, initargs=(state,))
            results = pool.imap(_process, _tasks(sources, cfg.chunk_rows), chunksize=1)
        else:
            results = _overlapped(_process, _tasks(sources, cfg.chunk_rows))
        for r in results:
            writer.add(r["ids"], r["mask"], r["lengths"], r["records"], r["source_ids"])
            lengths.append(r["lengths"])
            mask_counts.append(chunk_mask_counts(r["mask"], r["lengths"]))
            loss_tokens += int(r["mask"].sum(dtype=np.int64))
            for k, v in r["stats"].items():
                stats[k] += v
            for k, v in r["thinking"].items():
                thinking[k] += v
            examples += r["examples"][: MAX_EXAMPLES - len(examples)]
            bar.advance(r["rows"])
    except rec.RecordError as e:
        src = next(s for s in sources if s.path == e.path)
        raise rec.RecordError(e.path, e.row, e.reason, e.line if e.line is not None else src.line_of(e.row)) from None
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
        _STATE.clear()
    template_sha256 = chat_template_sha256(tok.chat_template)
    serving = serving_mode(thinking, declared=cfg.thinking, template_sha256=template_sha256)  # before any file
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
        "tokenizer": {**tok.info.to_dict(), "files": tok.files,
                      "chat_template": {"sha256": template_sha256,
                                        "source": "--chat-template" if cfg.chat_template else
                                        ("built-in ChatML" if cfg.tokenizer == "byte" else "tokenizer"),
                                        "generation_blocks": bool(tok.has_generation)}},
        "options": cfg.options(),
        "mask": cfg.mask.to_dict(),
        "serving_mode": serving,
        "counts": {"samples": n, "records": total_rows + sum(s.bad_lines for s in sources),
                   "truncated": stats["truncated"], "dropped": stats["dropped"], "skipped": stats["skipped"],
                   "no_loss": stats["no_loss"], "expanded_conversations": stats["expanded"],
                   "rows_from_expansion": stats["expanded_rows"], "escaped_control_tokens": stats["escaped"]},
        "tokens": {"total": total, "loss": loss_tokens, "cut_by_truncation": stats["cut_tokens"],
                   "in_dropped": stats["dropped_tokens"], "max_len": int(lengths_arr.max())},
        "skipped_examples": examples,
        "lengths": {"file": LENGTHS_FILE, "dtype": "int32", "fingerprint": lengths_fp},
        **mask_meta,
        "shards": shards,
    }
    write_hf_files(tmp, shards, meta["fingerprint"])
    return meta


def _progress(on: bool, total: int):
    """The shared progress helper: a bar on a terminal, plain log lines elsewhere."""
    return progress_("tokenize", total=total, unit="records", enabled=on)



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
        ("expanded", f"{c['expanded_conversations']:,} conversations into {c['rows_from_expansion']:,} rows "
                     "(template rewrites earlier turns)"),
        ("escaped", f"{c['escaped_control_tokens']:,} records whose content spells a control token (kept as text)"),
        ("shards", f"{len(meta['shards'])}"),
        ("tokenizer", f"{meta['tokenizer']['name']} (vocab {meta['tokenizer']['vocab_size']:,})"),
        ("serving mode", describe(serving_mode_of(meta))),
        ("fingerprint", meta["fingerprint"]),
    ]
