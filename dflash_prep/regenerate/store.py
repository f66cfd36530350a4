"""The output folder of ``regenerate`` (format ``dflash-prep/regenerate`` v2): append-only, resumable.

Versions: v2 records name the server of each turn (``turns[i].server``); v1 records named only
the server of the last turn. A finished v1 folder still reads as finished; an unfinished one is
not resumed (its records and the new ones would differ in form): ``--overwrite`` starts over.

Layout::

    regenerate.json  header: format, version, fingerprint, settings, inputs, target,
                     complete, stats (rewritten atomically when the run completes)
    chat.jsonl       one record per written conversation, in input order: what tokenize reads
    failures.log     one JSON object per failed input record (record, source, kind, message);
                     not named .jsonl, so tokenize, pointed at the folder, does not read it
    regenerate.idx   32-byte header (magic ``DFREGIDX``, u32 version, u32 entry bytes, the run
                     fingerprint's 16 bytes), then one 40-byte entry per input record processed

An index entry (little-endian) holds the ends of ``chat.jsonl`` and ``failures.log`` after
the record, its prompt and completion tokens, its status (0 written, else 1 + the index of
its kind in :data:`engines.FAILURE_KINDS`), its generated turns and how many were truncated.

Commit protocol (one group per call to :meth:`Store.commit`): append the lines to
``chat.jsonl`` and ``failures.log`` and fsync both, then append the entries to the index
and fsync it. A crash at any point leaves an index that names only fully written records.
On resume a torn index tail is cut, and both logs are cut back to the offsets of the last
entry, dropping any line that was written but not indexed. Every input record is thus in
the output exactly once, whatever the moment of the crash: no duplicate, no gap.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_prep.errors import FingerprintMismatch, FormatError
from dflash_prep.formats.fileio import atomic_dir, atomic_write_json, follow_link, read_json
from dflash_prep.regenerate.engines import FAILURE_KINDS

FORMAT = "dflash-prep/regenerate"
VERSION = 2
READ_VERSIONS = (1, 2)
HEADER_FILE, CHAT_FILE, FAIL_FILE, INDEX_FILE = "regenerate.json", "chat.jsonl", "failures.log", "regenerate.idx"
INDEX_MAGIC = b"DFREGIDX"
INDEX_VERSION = 1
INDEX_HEADER = struct.Struct("<8sII16s")  # 32 bytes
ENTRY = np.dtype([("chat_end", "<i8"), ("fail_end", "<i8"), ("prompt_tokens", "<i8"), ("completion_tokens", "<i8"),
                  ("status", "<i2"), ("turns", "<i2"), ("truncated", "<i2"), ("_pad", "<i2")])
if ENTRY.itemsize != 40:  # the on-disk layout the docstring states
    raise RuntimeError(f"index entry is {ENTRY.itemsize} bytes, expected 40")


@dataclass
class Entry:
    """One processed input record: its output line, or its failure line."""

    line: bytes | None
    failure: bytes | None
    status: int
    turns: int = 0
    truncated: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


def _index_header(fingerprint: str) -> bytes:
    return INDEX_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, ENTRY.itemsize, bytes.fromhex(fingerprint)[:16])


def entries_on_disk(out: Path | str) -> int:
    """Whole entries in a run folder's index as it is now (0 before the first commit): what a watcher
    of a running ``regenerate`` counts; a half-written trailing entry does not count."""
    p = Path(out) / INDEX_FILE
    return max(0, (p.stat().st_size - INDEX_HEADER.size) // ENTRY.itemsize) if p.exists() else 0


def _diff(old: dict, new: dict) -> str:
    keys = sorted(set(old) | set(new))
    d = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]
    return "; ".join(d) or "(same settings, other format details)"


class Store:
    """An open output folder; ``done`` records are already in it."""

    def __init__(self, out: Path, header: dict, done: int, complete: bool):
        self.out, self.header, self.done, self.complete = out, header, done, complete
        self._chat = self._fail = self._idx = None
        self._chat_end = self._fail_end = 0

    # -- opening ----------------------------------------------------------------------
    @classmethod
    def open(cls, out: Path | str, header: dict, *, overwrite: bool = False) -> "Store":
        """Create ``out``, or reopen it to resume (same fingerprint), or report it complete.

        ``header`` holds at least ``fingerprint``, ``settings`` and ``inputs``; a folder
        written under another fingerprint is refused unless ``overwrite``."""
        out = follow_link(out)  # --out LINK writes the folder it points to, as every command does
        hdr = out / HEADER_FILE
        if out.exists() and not out.is_dir():
            raise FormatError(f"{out}: exists and is not a folder; pass a new --out")
        if hdr.is_file():
            old = read_json(hdr, format=FORMAT, versions=READ_VERSIONS)
            if overwrite:
                shutil.rmtree(out)
            elif old.get("version") != VERSION and not old.get("complete"):
                raise FormatError(f"{out}: an unfinished regenerate output of format v{old.get('version')}, whose "
                                  f"records this version (v{VERSION}: the server of every turn) cannot continue; pass "
                                  "--overwrite to start over, or a new --out")
            elif old.get("fingerprint") != header["fingerprint"]:
                what = _diff(old.get("settings", {}), header["settings"])
                if old.get("inputs", {}).get("fingerprint") != header["inputs"]["fingerprint"]:
                    what = "the input files changed (path, size or mtime); " + what
                raise FingerprintMismatch(f"{out} was written by another regenerate run ({what}). Pass the same "
                                          "options to resume it, --overwrite to start over, or a new --out")
            elif old.get("complete"):
                return cls(out, old, int(old.get("stats", {}).get("records_done", 0)), True)
            else:
                return cls._resume(out, old)
        elif out.exists() and any(out.iterdir()):
            raise FormatError(f"{out}: exists and is not a regenerate output (no {HEADER_FILE}); pass a new --out")
        with atomic_dir(out, overwrite=out.exists()) as tmp:
            atomic_write_json(tmp / HEADER_FILE, {**header, "complete": False}, format=FORMAT, version=VERSION)
            for name in (CHAT_FILE, FAIL_FILE):
                (tmp / name).write_bytes(b"")
            (tmp / INDEX_FILE).write_bytes(_index_header(header["fingerprint"]))
        return cls._resume(out, read_json(out / HEADER_FILE, format=FORMAT, versions=(VERSION,)))

    @classmethod
    def _resume(cls, out: Path, header: dict) -> "Store":
        idx_path = out / INDEX_FILE
        try:
            idx = open(idx_path, "r+b")
        except FileNotFoundError:
            raise FormatError(f"{idx_path}: missing; the folder is damaged, pass --overwrite to start over") from None
        head = idx.read(INDEX_HEADER.size)
        want = _index_header(header["fingerprint"])
        if len(head) < INDEX_HEADER.size or head[:8] != INDEX_MAGIC:
            idx.close()
            raise FormatError(f"{idx_path}: not a regenerate index; pass --overwrite to start over")
        if head != want:
            idx.close()
            raise FormatError(f"{idx_path}: index version or fingerprint does not match {HEADER_FILE} (index "
                              f"v{INDEX_HEADER.unpack(head)[1]}); pass --overwrite to start over")
        size = os.fstat(idx.fileno()).st_size
        done = (size - INDEX_HEADER.size) // ENTRY.itemsize
        idx.truncate(INDEX_HEADER.size + done * ENTRY.itemsize)  # a torn tail entry
        chat_end = fail_end = 0
        if done:
            idx.seek(INDEX_HEADER.size + (done - 1) * ENTRY.itemsize)
            last = np.frombuffer(idx.read(ENTRY.itemsize), dtype=ENTRY)[0]
            chat_end, fail_end = int(last["chat_end"]), int(last["fail_end"])
        idx.seek(0, os.SEEK_END)
        s = cls(out, header, int(done), False)
        s._idx = idx
        s._chat, s._chat_end = s._open_log(CHAT_FILE, chat_end), chat_end
        s._fail, s._fail_end = s._open_log(FAIL_FILE, fail_end), fail_end
        return s

    def _open_log(self, name: str, end: int):
        p = self.out / name
        if not p.is_file() or p.stat().st_size < end:
            raise FormatError(f"{p}: shorter than its index says ({end} bytes); the folder is damaged, pass "
                              "--overwrite to start over")
        f = open(p, "r+b")
        f.truncate(end)  # lines written after the last index entry
        f.seek(end)
        return f

    # -- writing ----------------------------------------------------------------------
    def commit(self, entries: list[Entry]) -> None:
        """Append ``entries`` (the next records in input order) durably, as one group."""
        if not entries:
            return
        rows = np.zeros(len(entries), dtype=ENTRY)
        chat, fail = [], []
        for i, e in enumerate(entries):
            if e.line is not None:
                chat.append(e.line)
                self._chat_end += len(e.line)
            if e.failure is not None:
                fail.append(e.failure)
                self._fail_end += len(e.failure)
            rows[i] = (self._chat_end, self._fail_end, e.prompt_tokens, e.completion_tokens, e.status, e.turns,
                       e.truncated, 0)
        for f, lines in ((self._chat, chat), (self._fail, fail)):
            if lines:
                f.write(b"".join(lines))
                f.flush()
                os.fsync(f.fileno())
        self._idx.write(rows.tobytes())
        self._idx.flush()
        os.fsync(self._idx.fileno())
        self.done += len(entries)

    def stats(self) -> dict:
        """Counts and token sums over every record in the index (all runs of this output)."""
        if self.complete:
            return dict(self.header.get("stats", {}))
        self._idx.flush()
        rows = np.fromfile(self.out / INDEX_FILE, dtype=ENTRY, offset=INDEX_HEADER.size)
        st = rows["status"]
        return {"records_done": int(len(rows)), "records_written": int((st == 0).sum()),
                "failed": {k: int((st == i + 1).sum()) for i, k in enumerate(FAILURE_KINDS) if (st == i + 1).any()},
                "turns": int(rows["turns"].sum()), "truncated_turns": int(rows["truncated"].sum()),
                "prompt_tokens": int(rows["prompt_tokens"].sum()),
                "completion_tokens": int(rows["completion_tokens"].sum())}

    def failures(self, limit: int = 5) -> list[str]:
        """The first ``limit`` failure messages."""
        out = []
        with open(self.out / FAIL_FILE, "rb") as f:
            for ln in f:
                if len(out) >= limit:
                    break
                out.append(json.loads(ln)["message"])
        return out

    def finish(self, extra: dict) -> dict:
        """Mark the output complete: rewrite the header with the final stats."""
        stats = {**self.stats(), **extra}
        self.close()
        hdr = {k: v for k, v in self.header.items() if k not in ("format", "version")}
        hdr.update(complete=True, stats=stats)
        atomic_write_json(self.out / HEADER_FILE, hdr, format=FORMAT, version=VERSION)
        self.header, self.complete = hdr, True
        return stats

    def close(self) -> None:
        for f in (self._chat, self._fail, self._idx):
            if f is not None:
                f.close()
        self._chat = self._fail = self._idx = None
