"""``dflash-prep regenerate``: the target model writes the assistant turns of a chat corpus.

A drafter learns to predict what its target writes, so the first stage of a drafter
pipeline has the target answer the corpus's prompts itself (the DFlash recipe regenerated
its ~800K training prompts). Generation is left to the inference engines users already run
(:mod:`dflash_prep.regenerate.engines`): an OpenAI-compatible server (vLLM, SGLang, ``transformers
serve``) or an in-process transformers model for small jobs.

Semantics:

- Input: what ``tokenize`` reads (``records.expand``: files, globs, folders, save_to_disk
  folders; ``messages``, ``sharegpt`` or ``text`` schema; a ``text`` record is one user
  prompt). Assistant messages are optional: prompt-only records are the point.
- Modules: :mod:`.turns` (validation, slots, contexts, reasoning, records), :mod:`.store`
  (the output folder), :mod:`.engines` (who generates), :mod:`.servers` (several OpenAI-compatible
  servers as one engine); this one holds the config, the progress display and the two drivers
  below.
- Slots: every assistant message of a conversation, plus one at the end when it ends with a
  user or tool message. ``--turns all`` fills the slots in order, each request seeing the
  conversation up to that slot with the earlier slots already regenerated (or, with
  ``--keep-assistant``, with the original answers as context); ``--turns last`` fills only
  the last slot, keeping the earlier answers as they are.
- ``--reasoning keep`` keeps what the target writes; reasoning the server returns apart
  (``reasoning_content``) is put back as a leading ``<think>`` block. ``strip`` removes
  ``<think>...</think>`` blocks (and an unterminated one cut by ``--max-tokens``).
  ``disable`` sends the chat-template kwarg ``enable_thinking: false`` (honoured by
  vLLM, SGLang and ``transformers serve``) and strips any block the target writes anyway.
  Each turn records how many characters of reasoning were removed.
- Output: :mod:`dflash_prep.regenerate.store` (resumable, append-only, input order). Each record
  is ``{"messages": [...], "regenerate": {record, source, target, sampling, reasoning,
  turns_mode, keep_assistant, turns: [{message, finish_reason, truncated, prompt_tokens,
  completion_tokens, seed, reasoning_removed_chars, server}]}}``; nothing in it depends on timing, so a resumed
  run is byte-identical to an uninterrupted one whenever the engine is deterministic (temperature 0) and
  its servers name the same software and version.
- Failures: a bad record, a refused request, a timeout, a 5xx after retries, a non-UTF-8 or
  empty answer stop the run under ``--on-error fail`` (the record is not written, so a
  resume retries it) or are counted under ``skip`` (kept in ``failures.log``; a resume does
  not retry them). An unreachable server or an unknown model always stops the run.
- Several servers (``--base-url`` repeated, :mod:`.servers`): one that does not answer at start
  is skipped; servers that report another checkpoint or context length are refused; requests
  go to the least busy live server; one that dies midway (gone, 502/503/504 again and again,
  or silent on a stuck request) hands its requests to the others, and the run stops only when
  none is left. Records do not say which URL answered (a resume may use other servers), only
  the software and version of the server of each turn (``turns[i].server``; the last turn's
  also as ``target.server``); ``regenerate.json``'s ``stats.last_run.servers`` lists each
  server, the requests it answered and why it died.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from rich.progress import BarColumn, MofNCompleteColumn
from rich.progress import Progress as Bar
from rich.progress import TextColumn

from dflash_prep.errors import ConfigError
from dflash_prep.formats.fileio import fingerprint_json
from dflash_prep.regenerate.engines import HFEngine, RequestFailed, Sampling, target_revision
from dflash_prep.regenerate.servers import ServerPool
from dflash_prep.regenerate.store import Entry, Store
from dflash_prep.regenerate.turns import Conversation, failure_entry, to_conversation
from dflash_prep.tokenize import records as rec

ENGINES = ("openai", "hf")
TURNS = ("all", "last")
REASONING = ("keep", "strip", "disable")
CHUNK = 1024  # records read from a source at a time
LOG_EVERY_S = 10.0


@dataclass(frozen=True)
class RegenerateConfig:
    """What to regenerate, with which engine, and how."""

    inputs: tuple[str, ...]
    """Corpus files, globs or folders (as for ``tokenize``)."""
    out: Path
    """Output folder (chat.jsonl + regenerate.json + index)."""
    engine: str = "openai"
    """openai (an OpenAI-compatible server) or hf (in-process transformers)."""
    base_url: str | tuple[str, ...] | None = None
    """openai: the server, e.g. http://127.0.0.1:8000/v1, or several (balanced, with failover:
    :mod:`.servers`); not part of the run's fingerprint, so a resume may name other servers."""
    model: str | None = None
    """openai: the model name the server serves."""
    target: Path | None = None
    """hf: the local model folder."""
    revision: str | None = None
    """Recorded as the target's revision (default: hf computes one; openai records none)."""
    turns: str = "all"
    """all or last."""
    keep_assistant: bool = False
    """--turns all: original answers as context instead of the regenerated ones."""
    reasoning: str = "keep"
    """keep, strip or disable."""
    sampling: Sampling = field(default_factory=Sampling)
    concurrency: int = 8
    """openai: requests in flight, across all servers."""
    batch_size: int = 8
    """hf: prompts per generate call."""
    device: str = "auto"
    """hf: torch device."""
    timeout: float = 600.0
    """openai: seconds to wait for one answer."""
    retries: int = 5
    """openai: retries of a connection error, timeout, 429 or 5xx."""
    format: str = "auto"
    text_field: str = "text"
    on_error: str = "fail"
    """fail or skip (and count)."""
    overwrite: bool = False
    """Start over in an output written with other settings."""

    def __post_init__(self):
        def one_of(name, val, allowed):
            if val not in allowed:
                raise ConfigError(f"--{name} must be one of {', '.join(allowed)}, got {val!r}")

        one_of("engine", self.engine, ENGINES)
        one_of("turns", self.turns, TURNS)
        one_of("reasoning", self.reasoning, REASONING)
        one_of("on-error", self.on_error, ("fail", "skip"))
        one_of("format", self.format, rec.FORMATS)
        if self.engine == "openai" and not (self.base_urls and self.model):
            raise ConfigError("--engine openai needs --base-url (e.g. http://127.0.0.1:8000/v1) and --model")
        if len(set(self.base_urls)) < len(self.base_urls):
            raise ConfigError(f"--base-url names a server twice: {', '.join(self.base_urls)}")
        if self.engine == "hf" and self.target is None:
            raise ConfigError("--engine hf needs --target DIR (a local transformers model folder)")
        if self.keep_assistant and self.turns == "last":
            raise ConfigError("--keep-assistant applies to --turns all; --turns last always keeps the earlier answers")
        for name in ("concurrency", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.timeout <= 0 or self.retries < 0:
            raise ConfigError(f"--timeout must be > 0 and --retries >= 0, got {self.timeout}, {self.retries}")

    @property
    def base_urls(self) -> tuple[str, ...]:
        """``base_url`` as a tuple: () without one, one URL or several."""
        if self.base_url is None:
            return ()
        return (self.base_url,) if isinstance(self.base_url, str) else tuple(self.base_url)


# ----------------------------------------------------------------------------- progress
class Progress:
    """Records, requests/s, tokens/s and ETA: a rich bar on a terminal, else a log line every
    :data:`LOG_EVERY_S` seconds (and at start and end) on stderr; ``off`` prints nothing."""

    def __init__(self, mode: str, total: int, done: int):
        self.mode, self.total, self.start_done, self.done = mode, total, done, done
        self.requests = self.tokens = self.failed = 0
        self.t0 = self._last_log = time.monotonic()
        self._lock = threading.Lock()
        self._bar = None
        if mode == "bar":
            self._bar = Bar(TextColumn("regenerate"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"))
            self._task = self._bar.add_task("", total=total, completed=done, info="")
            self._bar.start()
        elif mode == "log":
            self._log(f"regenerate: {total:,} records" + (f", resuming after {done:,}" if done else ""))

    def reply(self, tokens: int | None) -> None:
        with self._lock:
            self.requests += 1
            self.tokens += tokens or 0

    def records(self, n: int, failed: int) -> None:
        self.done += n
        self.failed += failed

    def line(self) -> str:
        dt = max(time.monotonic() - self.t0, 1e-9)
        rate = (self.done - self.start_done) / dt
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta_s = "?" if eta == float("inf") else time.strftime("%H:%M:%S", time.gmtime(eta))
        return (f"{self.requests / dt:.2f} req/s, {self.tokens / dt:,.0f} tok/s, ETA {eta_s}"
                + (f", failed {self.failed:,}" if self.failed else ""))

    def _log(self, msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    def tick(self, force: bool = False) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, info=self.line())
        elif self.mode == "log" and (force or time.monotonic() - self._last_log >= LOG_EVERY_S):
            self._last_log = time.monotonic()
            pct = 100.0 * self.done / self.total if self.total else 100.0
            self._log(f"regenerate: {self.done:,}/{self.total:,} records ({pct:.1f}%), {self.line()}")

    def close(self) -> None:
        self.tick(force=True)
        if self._bar is not None:
            self._bar.stop()


# ----------------------------------------------------------------------------- the run
def _settings(cfg: RegenerateConfig) -> dict:
    name = cfg.model if cfg.engine == "openai" else str(cfg.target)
    revision = cfg.revision or (target_revision(cfg.target) if cfg.engine == "hf" else None)
    return {"engine": cfg.engine, "target": {"name": name, "revision": revision}, "turns": cfg.turns,
            "keep_assistant": cfg.keep_assistant, "reasoning": cfg.reasoning, "sampling": cfg.sampling.record(),
            "format": cfg.format, "text_field": cfg.text_field}


def _jobs(sources, start: int) -> Iterator[tuple[int, object, int, object]]:
    """(record index, source, row, raw value) from record ``start`` on, in input order."""
    for src in sources:
        n = len(src)
        for a in range(max(0, start - src.first_record), n, CHUNK):
            for j, v in enumerate(src.get(a, min(n, a + CHUNK))):
                yield src.first_record + a + j, src, a + j, v


def _prepare(cfg: RegenerateConfig, index: int, src, row: int, value) -> Conversation | Entry | rec.RecordError:
    """A conversation to answer; or, for a bad record, its failure entry (skip) or error (fail)."""
    line = src.line_of(row)
    source = {"file": src.path, "row": row, "line": line}
    where = f"{src.path}:{line}" if line is not None else f"{src.path} row {row}"
    try:
        return Conversation(cfg, index, source, where, to_conversation(value, src.schema, src.fields))
    except ValueError as e:
        if cfg.on_error == "fail":
            return rec.RecordError(src.path, row, str(e), line)
        return failure_entry(index, source, "bad_input", f"{where}: {e}")


def run(cfg: RegenerateConfig, *, progress: str = "off") -> dict:
    """Regenerate ``cfg.inputs`` into ``cfg.out``; resume an interrupted run; do nothing for a
    finished one. ``progress``: bar, log or off. Returns a summary (``up_to_date``, ``stats``,
    ``failures`` examples, this run's ``records``/``requests``/``tokens``/``elapsed_s``)."""
    files = rec.expand(list(cfg.inputs))
    settings = _settings(cfg)
    sources, cleanup = rec.open_all(files, fmt=cfg.format, text_field=cfg.text_field, on_error=cfg.on_error)
    try:
        total = sum(len(s) for s in sources)
        bad_lines = sum(s.bad_lines for s in sources)
        inputs = {"files": [p for p, _ in files], "fingerprint": rec.fingerprint(files), "records": total}
        header = {"fingerprint": fingerprint_json({"settings": settings, "inputs": inputs["fingerprint"]}),
                  "settings": settings, "inputs": inputs}
        store = Store.open(cfg.out, header, overwrite=cfg.overwrite)
        if store.complete:
            return {"up_to_date": True, "out": str(cfg.out), "stats": store.stats(), "failures": [], "records": 0}
        try:
            return _run(cfg, store, sources, total, bad_lines, settings["target"], progress)
        finally:
            store.close()
    finally:
        cleanup()


def _run(cfg, store: Store, sources, total: int, bad_lines: int, target: dict, progress: str) -> dict:
    target = {"engine": cfg.engine, **target}
    if store.done >= total:  # every record was written before a crash at the very end
        engine, drive = None, None
    elif cfg.engine == "openai":
        engine = ServerPool(base_urls=cfg.base_urls, model=cfg.model, sampling=cfg.sampling,
                            timeout=cfg.timeout, retries=cfg.retries)
        engine.check()
        target["server"] = engine.server
        drive = _drive_openai
    else:
        engine = HFEngine(target=cfg.target, sampling=cfg.sampling, batch_size=cfg.batch_size, device=cfg.device)
        drive = _drive_hf
    bar = Progress(progress, total, store.done)  # rates exclude start-up (model load, imports)
    t0, start = time.monotonic(), store.done
    try:
        if drive is not None:
            drive(cfg, engine, store, sources, target, bar)
    finally:
        bar.close()
    elapsed = time.monotonic() - t0
    this = {"records": store.done - start, "requests": bar.requests, "completion_tokens": bar.tokens,
            "elapsed_s": round(elapsed, 3), "requests_per_s": round(bar.requests / max(elapsed, 1e-9), 3),
            "tokens_per_s": round(bar.tokens / max(elapsed, 1e-9), 1)}
    if isinstance(engine, ServerPool):
        this["servers"] = engine.report()
    failures = store.failures()
    stats = store.finish({"malformed_lines_skipped": bad_lines, "last_run": this})
    return {"up_to_date": False, "out": str(cfg.out), "stats": stats, "failures": failures, **this}


def _drive_openai(cfg, engine: ServerPool, store: Store, sources, target: dict, bar: Progress) -> None:
    """N worker threads answer whole conversations; the main thread writes them in input
    order, at most ``window`` records ahead of the oldest unwritten one (bounded memory).
    Each turn names the server (software, version) that wrote it, the record's ``target`` the
    one that wrote its last turn."""

    def work(conv: Conversation) -> Entry:
        served = None
        try:
            while conv.pending:
                reply = engine.chat(conv.request(), conv.what())
                bar.reply(reply.completion_tokens)
                conv.accept(reply)
                served = reply.server
        except RequestFailed as e:
            if cfg.on_error == "fail":
                raise
            return failure_entry(conv.index, conv.source, e.kind, str(e))
        return conv.entry(target if served is None else {**target, "server": served})

    window = max(64, 4 * cfg.concurrency)
    jobs = _jobs(sources, store.done)
    pending: deque = deque()
    pool = ThreadPoolExecutor(cfg.concurrency, thread_name_prefix="regenerate")
    finished = False
    try:
        exhausted = False
        while True:
            while not exhausted and len(pending) < window:
                job = next(jobs, None)
                if job is None:
                    exhausted = True
                    break
                item = _prepare(cfg, *job)
                if isinstance(item, Conversation):
                    item = pool.submit(work, item)
                elif isinstance(item, rec.RecordError):
                    item, err = Future(), item
                    item.set_exception(err)  # raised when its turn to be written comes
                pending.append(item)
            if not pending:
                finished = True
                return
            if engine.fatal is not None:  # keep the finished prefix, then stop
                group = []
                while pending and (not isinstance(pending[0], Future)
                                   or (pending[0].done() and pending[0].exception() is None)):
                    x = pending.popleft()
                    group.append(x.result() if isinstance(x, Future) else x)
                store.commit(group)
                raise engine.fatal
            head = pending[0]
            if isinstance(head, Future) and not head.done():
                wait([head], timeout=0.5)
                bar.tick()
                continue
            group: list[Entry] = []
            try:
                while pending and (not isinstance(pending[0], Future) or pending[0].done()):
                    x = pending.popleft()
                    group.append(x.result() if isinstance(x, Future) else x)
            finally:
                store.commit(group)  # everything before a failure is kept
                bar.records(len(group), sum(e.status != 0 for e in group))
                bar.tick()
    finally:
        engine.stop.set()  # on an error: workers still retrying give up, queued records are dropped,
        pool.shutdown(wait=finished, cancel_futures=True)  # and the error surfaces without waiting
        engine.close()  # for the requests in flight (nothing of theirs is written)


def _drive_hf(cfg, engine: HFEngine, store: Store, sources, target: dict, bar: Progress) -> None:
    """Chunks of ``batch_size`` records; each round batches the next turn of every record of
    the chunk still pending (``--turns all`` needs turn k before turn k+1)."""
    jobs = _jobs(sources, store.done)
    while True:
        chunk = [_prepare(cfg, *j) for j in _take(jobs, cfg.batch_size)]
        if not chunk:
            return
        failed: dict[int, RequestFailed] = {}
        while True:
            live = [i for i, c in enumerate(chunk) if isinstance(c, Conversation) and c.pending and i not in failed]
            if not live:
                break
            for i, reply in zip(live, engine.chat_batch([chunk[i].request() for i in live])):
                bar.reply(reply.completion_tokens)
                try:
                    chunk[i].accept(reply)
                except RequestFailed as e:
                    failed[i] = e
        group = []
        for i, c in enumerate(chunk):
            if isinstance(c, rec.RecordError) or (i in failed and cfg.on_error == "fail"):
                store.commit(group)
                raise c if isinstance(c, rec.RecordError) else failed[i]
            group.append(c if isinstance(c, Entry) else
                         failure_entry(c.index, c.source, failed[i].kind, str(failed[i])) if i in failed else
                         c.entry(target))
        store.commit(group)
        bar.records(len(group), sum(e.status != 0 for e in group))
        bar.tick()


def _take(it: Iterator, n: int) -> list:
    out = []
    for x in it:
        out.append(x)
        if len(out) == n:
            break
    return out


def _fate(died: str | None) -> str:
    if died is None:
        return ""
    return " (down at start)" if died.startswith("down at start") else " (died)"


def summary_rows(s: dict) -> list[tuple[str, str]]:
    """Rows the CLI prints after a run."""
    st = s["stats"]
    rows = [("records", f"{st.get('records_written', 0):,} written of {st.get('records_done', 0):,} processed"),
            ("turns", f"{st.get('turns', 0):,} ({st.get('truncated_turns', 0):,} cut by --max-tokens)"),
            ("tokens", f"{st.get('prompt_tokens', 0):,} prompt, {st.get('completion_tokens', 0):,} completion")]
    if st.get("failed"):
        rows.append(("failed", ", ".join(f"{k} {v:,}" for k, v in st["failed"].items())))
    if len(s.get("servers", ())) > 1:
        rows.append(("servers", "; ".join(f"{v['url']} {v['requests']:,} requests" + _fate(v["died"])
                                          for v in s["servers"])))
    if not s["up_to_date"]:
        rows.append(("this run", f"{s['records']:,} records, {s['requests']:,} requests in {s['elapsed_s']:.1f} s: "
                                 f"{s['requests_per_s']:.2f} req/s, {s['tokens_per_s']:,.0f} tok/s"))
    return rows
