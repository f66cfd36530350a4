"""Input corpora for ``tokenize``: find the files, load them through ``datasets``, validate records.

Inputs are paths or globs of ``.jsonl``/``.json``/``.parquet``/``.arrow`` files, folders of
such files, or ``datasets.save_to_disk`` folders (recognized by ``state.json``). Each file is
loaded on its own, so every record keeps its file and row (or JSON line) for messages.
Records are numbered globally in input order: files in the order given, globs sorted.

Schemas (``--format``, or ``auto`` from the columns, checked in this order):

- ``messages``: ``{"messages": [{"role": "system|user|assistant|tool", "content": str}]}``;
- ``sharegpt``: ``{"conversations": [{"from": "system|human|gpt|tool", "value": str}]}``;
- ``text``: ``{"text": str}`` (the field name is ``--text-field``).

A JSON file that ``datasets`` cannot load (a malformed line, or records whose types differ
so that no Arrow schema fits) is re-read line by line with :mod:`json`, which names the bad
line; with ``--on-error skip`` the bad lines are skipped and counted instead. Source
fingerprints hash each file's resolved path, size and mtime (like make), not its bytes, so
checking whether a dataset is up to date costs nothing even for large corpora.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigError, InputError
from .fileio import fingerprint_json

FORMATS = ("auto", "messages", "sharegpt", "text")
SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "tool": "tool"}


class RecordError(InputError):
    """One bad record: where it is and what is wrong (picklable across worker processes)."""

    def __init__(self, path: str, row: int, reason: str, line: int | None = None):
        super().__init__(path, row, reason, line)
        self.path, self.row, self.reason, self.line = path, row, reason, line

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line is not None else f"{self.path} row {self.row}"
        return (f"{where}: {self.reason}. Fix or remove the record, or pass --on-error skip "
                "to skip and count such records")


@dataclass
class Source:
    """One loaded input file or folder.

    ``rows`` is a ``datasets.Dataset`` restricted to the schema's column, or a list of
    dicts from the line-by-line fallback; ``lines`` maps a row to its 1-based JSON line
    where known. ``bad_lines`` counts malformed lines skipped under ``--on-error skip``.
    """

    path: str
    kind: str
    schema: str
    field: str
    rows: object
    lines: list[int] | None = None
    bad_lines: int = 0
    bad_examples: list[str] = field(default_factory=list)
    first_record: int = 0
    _line_map: list[int] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, start: int, stop: int) -> list:
        if isinstance(self.rows, list):
            return [r.get(self.field) if isinstance(r, dict) else r for r in self.rows[start:stop]]
        return self.rows[start:stop][self.field]

    def line_of(self, row: int) -> int | None:
        """The JSON line of ``row`` (JSON Lines only; computed on first use, for messages)."""
        if self.lines is not None:
            return self.lines[row]
        if self.kind != "json" or not self.path.endswith(".jsonl"):
            return None
        if self._line_map is None:
            with open(self.path, "rb") as f:
                self._line_map = [i for i, ln in enumerate(f, 1) if ln.strip()]
        return self._line_map[row] if row < len(self._line_map) else None


def expand(inputs: list[str]) -> list[tuple[str, str]]:
    """Paths and globs -> ``[(path, kind)]``; kind is json, parquet, arrow or disk."""
    if not inputs:
        raise ConfigError("give at least one input path or glob")
    out: list[tuple[str, str]] = []
    for spec in inputs:
        matches = sorted(glob.glob(os.path.expanduser(spec))) if glob.has_magic(spec) else [os.path.expanduser(spec)]
        if not matches or not os.path.exists(matches[0]):
            raise InputError(f"{spec}: no such file, folder or glob match; check the path")
        for m in matches:
            p = Path(m)
            if p.is_dir():
                if (p / "state.json").is_file() or (p / "dataset_dict.json").is_file():
                    out.append((str(p), "disk"))
                    continue
                files = sorted(str(f) for f in p.iterdir() if f.suffix in SUFFIXES and f.is_file() and not _is_ours(f))
                if not files:
                    raise InputError(f"{p}: folder holds no .jsonl/.json/.parquet/.arrow files and is not a "
                                     "datasets save_to_disk folder")
                out += [(f, SUFFIXES[Path(f).suffix]) for f in files]
            elif p.suffix in SUFFIXES:
                out.append((str(p), SUFFIXES[p.suffix]))
            else:
                raise InputError(f"{p}: unsupported file type {p.suffix!r}; use .jsonl, .json, .parquet, .arrow "
                                 "or a datasets save_to_disk folder")
    return out


def _is_ours(f: Path) -> bool:
    """A dflash-prep side file (e.g. ``synth.json``) in a corpus folder is not data."""
    if f.suffix != ".json":
        return False
    with open(f, "rb") as fh:
        head = fh.read(256).lstrip()
    return head.startswith(b'{') and b'"format": "dflash-prep/' in head


def fingerprint(files: list[tuple[str, str]]) -> str:
    """Resolved path, size and mtime of every input file (folders: every file inside)."""
    parts = []
    for path, kind in files:
        paths = sorted(Path(path).rglob("*")) if kind == "disk" else [Path(path)]
        for p in paths:
            if p.is_file():
                st = p.stat()
                parts.append([str(p.resolve()), st.st_size, st.st_mtime_ns])
    return fingerprint_json(parts)


def detect_schema(path: str, columns: list[str], fmt: str, text_field: str) -> tuple[str, str]:
    """Pick ``(schema, column)`` from ``--format`` and the columns found."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    wanted = {"messages": "messages", "sharegpt": "conversations", "text": text_field}
    if fmt == "auto":
        for schema in ("messages", "sharegpt", "text"):
            if wanted[schema] in columns:
                return schema, wanted[schema]
        raise InputError(f"{path}: cannot tell the schema; found fields {', '.join(sorted(columns)) or '(none)'} but need "
                         f"'messages', 'conversations' or '{text_field}'. Pass --format and/or --text-field")
    if wanted[fmt] not in columns:
        raise InputError(f"{path}: --format {fmt} needs a '{wanted[fmt]}' field; found fields "
                         f"{', '.join(sorted(columns)) or '(none)'}")
    return fmt, wanted[fmt]


def load(path: str, kind: str, *, fmt: str, text_field: str, on_error: str, cache_dir: str) -> Source:
    """Load one input through ``datasets`` (JSON falls back to a line reader, see module doc)."""
    import datasets

    datasets.disable_progress_bars()
    level = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its load errors are ours to report
    try:
        if kind == "disk":
            ds = datasets.load_from_disk(path)
            if isinstance(ds, datasets.DatasetDict):
                if "train" not in ds:
                    raise InputError(f"{path}: a DatasetDict without a 'train' split (has {', '.join(ds)}); "
                                     "pass the split's folder instead")
                ds = ds["train"]
        elif kind == "arrow":
            ds = _load_arrow(path)
        else:
            ds = datasets.load_dataset(kind, data_files=path, split="train", cache_dir=cache_dir)
    except InputError:
        raise
    except Exception as e:  # datasets/pyarrow raise many types for unreadable files
        if kind != "json":
            raise InputError(f"{path}: cannot read this {kind} input ({type(e).__name__}: {_short(e)}); "
                             "the file is corrupt or not in that format, re-export it") from e
        return _load_json_lines(path, fmt=fmt, text_field=text_field, on_error=on_error)
    finally:
        datasets.logging.set_verbosity(level)
    schema, col = detect_schema(path, list(ds.column_names), fmt, text_field)
    return Source(path, kind, schema, col, ds.select_columns([col]).with_format(None))


def _load_arrow(path: str):
    import datasets
    import pyarrow as pa

    try:
        return datasets.Dataset.from_file(path)  # IPC stream (what datasets writes)
    except Exception:
        with pa.memory_map(path) as src:
            table = pa.ipc.open_file(src).read_all()  # IPC file ("feather v2")
        return datasets.Dataset(datasets.table.InMemoryTable(table))


def _load_json_lines(path: str, *, fmt: str, text_field: str, on_error: str) -> Source:
    rows, lines, bad, examples = [], [], 0, []
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            text = f.read()
        except UnicodeDecodeError as e:
            raise InputError(f"{path}: not UTF-8 text ({e}); re-encode the file as UTF-8") from e
    stripped = text.lstrip()
    if stripped.startswith("["):  # one JSON array
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{e.lineno}: malformed JSON ({e.msg}, column {e.colno}); fix the file") from e
        rows, lines = data, None
    else:
        for i, ln in enumerate(text.splitlines(), 1):
            if not ln.strip():
                continue
            try:
                obj = json.loads(ln)
            except json.JSONDecodeError as e:
                if on_error == "skip":
                    bad += 1
                    if len(examples) < 5:
                        examples.append(str(RecordError(path, len(rows), f"malformed JSON ({e.msg}, column {e.colno})", i)))
                    continue
                raise RecordError(path, len(rows), f"malformed JSON ({e.msg}, column {e.colno})", line=i) from e
            rows.append(obj)
            lines.append(i)
    columns = sorted({k for r in rows if isinstance(r, dict) for k in r})
    schema, col = detect_schema(path, columns, fmt, text_field)
    return Source(path, "json", schema, col, rows, lines=lines, bad_lines=bad, bad_examples=examples)


def _short(e: Exception) -> str:
    s = str(e).strip().splitlines()
    return s[0][:200] if s else type(e).__name__


def open_all(files: list[tuple[str, str]], *, fmt: str, text_field: str, on_error: str):
    """Load every input; returns ``(sources, cleanup)``; call ``cleanup()`` when done."""
    from .outputs import cache_dir

    cache = cache_dir()  # pid-tagged, so a later run can reclaim it after a kill
    ok = False
    try:
        sources, first = [], 0
        for path, kind in files:
            s = load(path, kind, fmt=fmt, text_field=text_field, on_error=on_error, cache_dir=cache)
            s.first_record = first
            first += len(s)
            sources.append(s)
        ok = True
    finally:
        if not ok:  # a bad input: nothing of ours stays behind
            shutil.rmtree(cache, ignore_errors=True)
    return sources, lambda: shutil.rmtree(cache, ignore_errors=True)


# ----------------------------------------------------------------------------- validation
def to_messages(value, schema: str) -> list[dict]:
    """Validate one record's conversation; returns ``[{"role", "content"}]`` or raises ValueError."""
    if value is None:
        raise ValueError(f"the '{'messages' if schema == 'messages' else 'conversations'}' field is missing (null)")
    if not isinstance(value, list):
        raise ValueError(f"the conversation is a {type(value).__name__}, not a list of messages")
    if not value:
        raise ValueError("empty conversation (no messages)")
    rk, ck = ("role", "content") if schema == "messages" else ("from", "value")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise ValueError(f"message {i} is a {type(m).__name__}, not an object with '{rk}' and '{ck}'")
        role, content = m.get(rk), m.get(ck)
        present = ", ".join(k for k, v in m.items() if v is not None) or "(none)"
        if role is None or content is None:  # datasets fills an absent key with None
            raise ValueError(f"message {i} has no '{rk if role is None else ck}' field (found fields: {present})")
        if not isinstance(content, str):
            raise ValueError(f"message {i}: '{ck}' is a {type(content).__name__}, not a string")
        if schema == "messages":
            if role not in ROLES:
                raise ValueError(f"message {i}: unknown role {role!r}; expected one of {', '.join(ROLES)}")
        else:
            if role not in SHAREGPT_ROLES:
                raise ValueError(f"message {i}: unknown 'from' {role!r}; expected one of {', '.join(SHAREGPT_ROLES)}")
            role = SHAREGPT_ROLES[role]
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" and m["content"] for m in out):
        raise ValueError("the conversation has no non-empty assistant message, so nothing to train on")
    return out


def to_text(value, field_name: str) -> str:
    """Validate one plain-text record."""
    if value is None:
        raise ValueError(f"the '{field_name}' field is missing (null)")
    if not isinstance(value, str):
        raise ValueError(f"'{field_name}' is a {type(value).__name__}, not a string")
    if not value:
        raise ValueError(f"empty '{field_name}'")
    return value
