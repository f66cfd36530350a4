"""Input corpora for ``tokenize``: find the files, load them through ``datasets``, validate records.

Inputs are paths or globs of ``.jsonl``/``.json``/``.parquet``/``.arrow`` files, folders of
such files, or ``datasets.save_to_disk`` folders (recognized by ``state.json``). Each file is
loaded on its own, so every record keeps its file and row (or JSON line) for messages.
Records are numbered globally in input order: files in the order given, globs sorted.

Schemas (``--format``, or ``auto`` from the fields, checked in this order):

- ``messages``: ``{"messages": [{"role", "content"}, ...]}`` (the field is ``--messages-field``);
- ``sharegpt``: ``{"conversations": [{"from", "value"}, ...]}``;
- ``alpaca``: ``{"instruction", "input"?, "output", "system"?}`` -> system?, user
  (instruction, then a blank line and input when non-empty), assistant (output);
- ``prompt_completion``: ``{"prompt", "completion"}``, each a string (-> user, assistant) or
  a message list (TRL's conversational form);
- ``text``: ``{"text": str}`` (the field name is ``--text-field``).

In every message list a message is ``{"role", "content"}`` or ``{"from", "value"}``; roles
go through the built-in map (human/gpt/... -> user/assistant) and ``--role-map``. Content is
a string or OpenAI content parts (``[{"type": "text", "text": ...}]``, joined without a
separator; any other part type is an error). Every other key of a message
(``reasoning_content``, ``tool_calls``, ``name``, ...) is passed to the template unchanged. A record's own ``id`` field, when present, is kept (as a string).

A JSON file that ``datasets`` cannot load (a malformed line, or records whose types differ
so that no Arrow schema fits) is re-read line by line with :mod:`json`, which names the bad
line; with ``--on-error skip`` the bad lines are skipped and counted instead. Source
fingerprints hash each file's bytes (BLAKE2b, read in 4 MiB blocks) and its name relative to the input
it was found under, never its absolute path or mtime: a rebuilt identical corpus, or a
moved or copied one, is the same input.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from dflash_prep.errors import ConfigError, InputError
from dflash_prep.formats.fileio import fingerprint_json
from dflash_prep.formats.outputs import cache_dir

FORMATS = ("auto", "messages", "sharegpt", "alpaca", "prompt_completion", "text")
SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "bot": "assistant",
                  "model": "assistant", "assistant": "assistant", "tool": "tool", "function": "tool",
                  "observation": "tool", "developer": "system"}
ALPACA_FIELDS = ("instruction", "input", "output", "system")


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

    ``rows`` is a ``datasets.Dataset`` restricted to the schema's columns (``fields``, plus
    ``id`` and ``regenerate`` when present), or a list of dicts from the line-by-line fallback; ``lines`` maps a row to its 1-based JSON line
    where known. ``bad_lines`` counts malformed lines skipped under ``--on-error skip``.
    """

    path: str
    kind: str
    schema: str
    fields: tuple[str, ...]
    rows: object
    lines: list[int] | None = None
    bad_lines: int = 0
    bad_examples: list[str] = field(default_factory=list)
    first_record: int = 0
    _line_map: list[int] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, start: int, stop: int) -> list[dict]:
        """Records ``start:stop`` as dicts of the schema's fields (a non-object JSON line: ``{}``)."""
        if isinstance(self.rows, list):
            return [{k: r.get(k) for k in self.fields} if isinstance(r, dict) else {} for r in self.rows[start:stop]]
        cols = self.rows[start:stop]
        return [dict(zip(self.fields, vals)) for vals in zip(*(cols[k] for k in self.fields))]

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


def place_error(src: Source, start: int, k: int, reason: str) -> RecordError:
    """Record ``k`` of the chunk starting at row ``start`` of ``src``, as a :class:`RecordError`."""
    row = start + k
    return RecordError(src.path, row, reason, src.lines[row] if src.lines is not None else None)


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
    """Content digest of the inputs: per file its bytes and its name (a folder's files by relative path)."""
    parts = []
    for path, kind in files:
        root = Path(path)
        paths = sorted(p for p in root.rglob("*") if p.is_file()) if kind == "disk" else [root]
        for p in paths:
            h = hashlib.blake2b(digest_size=32)
            with open(p, "rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
            parts.append([kind, p.relative_to(root).as_posix() if kind == "disk" else p.name, h.hexdigest()])
    return fingerprint_json(parts)


SCHEMA_FIELDS = {"messages": ("messages",), "sharegpt": ("conversations",), "alpaca": ("instruction", "output"),
                 "prompt_completion": ("prompt", "completion"), "text": ("text",)}


def detect_schema(path: str, columns: list[str], fmt: str, text_field: str,
                  messages_field: str = "messages") -> tuple[str, tuple[str, ...]]:
    """Pick ``(schema, fields to read)`` from ``--format`` and the columns found."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    need = dict(SCHEMA_FIELDS, messages=(messages_field,), text=(text_field,))
    optional = {"alpaca": ("input", "system")}

    def fields(schema: str) -> tuple[str, ...]:
        # the record's own id, and regenerate's record of how its answers were made (the thinking mode)
        extra = [c for c in optional.get(schema, ()) + ("id", "regenerate") if c in columns]
        return need[schema] + tuple(extra)

    if fmt == "auto":
        for schema in ("messages", "sharegpt", "alpaca", "prompt_completion", "text"):
            if all(c in columns for c in need[schema]):
                return schema, fields(schema)
        raise InputError(f"{path}: cannot tell the schema; found fields {', '.join(sorted(columns)) or '(none)'} but need "
                         f"'{messages_field}', 'conversations', instruction+output (alpaca), prompt+completion or "
                         f"'{text_field}'. Pass --format, --messages-field and/or --text-field")
    missing = [c for c in need[fmt] if c not in columns]
    if missing:
        raise InputError(f"{path}: --format {fmt} needs field(s) {', '.join(repr(c) for c in missing)}; found fields "
                         f"{', '.join(sorted(columns)) or '(none)'}")
    return fmt, fields(fmt)


def load(path: str, kind: str, *, fmt: str, text_field: str, on_error: str, cache_dir: str,
         messages_field: str = "messages") -> Source:
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
        return _load_json_lines(path, fmt=fmt, text_field=text_field, on_error=on_error, messages_field=messages_field)
    finally:
        datasets.logging.set_verbosity(level)
    schema, cols = detect_schema(path, list(ds.column_names), fmt, text_field, messages_field)
    return Source(path, kind, schema, cols, ds.select_columns(list(cols)).with_format(None))


def _load_arrow(path: str):
    import datasets
    import pyarrow as pa

    try:
        return datasets.Dataset.from_file(path)  # IPC stream (what datasets writes)
    except Exception:
        with pa.memory_map(path) as src:
            table = pa.ipc.open_file(src).read_all()  # IPC file ("feather v2")
        return datasets.Dataset(datasets.table.InMemoryTable(table))


def _load_json_lines(path: str, *, fmt: str, text_field: str, on_error: str, messages_field: str) -> Source:
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
    schema, cols = detect_schema(path, columns, fmt, text_field, messages_field)
    return Source(path, "json", schema, cols, rows, lines=lines, bad_lines=bad, bad_examples=examples)


def _short(e: Exception) -> str:
    s = str(e).strip().splitlines()
    return s[0][:200] if s else type(e).__name__


def open_all(files: list[tuple[str, str]], *, fmt: str, text_field: str, on_error: str, messages_field: str = "messages"):
    """Load every input; returns ``(sources, cleanup)``; call ``cleanup()`` when done."""
    cache = cache_dir()  # pid-tagged, so a later run can reclaim it after a kill
    ok = False
    try:
        sources, first = [], 0
        for path, kind in files:
            s = load(path, kind, fmt=fmt, text_field=text_field, on_error=on_error, cache_dir=cache,
                     messages_field=messages_field)
            s.first_record = first
            first += len(s)
            sources.append(s)
        ok = True
    finally:
        if not ok:  # a bad input: nothing of ours stays behind
            shutil.rmtree(cache, ignore_errors=True)
    return sources, lambda: shutil.rmtree(cache, ignore_errors=True)


# ----------------------------------------------------------------------------- validation
def record_id(record: dict) -> str | None:
    """The record's own ``id`` as a string, or None."""
    v = record.get("id")
    return None if v is None else str(v)


def to_messages(record: dict, schema: str, fields: tuple[str, ...], role_map: dict[str, str] | None = None) -> list[dict]:
    """Validate one record's conversation; returns ``[{"role", "content", ...}]`` or raises ValueError."""
    roles = {**SHAREGPT_ROLES, **(role_map or {})}
    if schema == "alpaca":
        ins, inp, outp, sys_ = (record.get(k) for k in ALPACA_FIELDS)
        for name, v in (("instruction", ins), ("output", outp), ("input", inp), ("system", sys_)):
            if v is not None and not isinstance(v, str):
                raise ValueError(f"'{name}' is a {type(v).__name__}, not a string")
        if ins is None or outp is None:
            raise ValueError(f"the '{'instruction' if ins is None else 'output'}' field is missing (null)")
        msgs = [{"role": "system", "content": sys_}] if sys_ else []
        return msgs + [{"role": "user", "content": ins + ("\n\n" + inp if inp else "")},
                       {"role": "assistant", "content": outp}]
    if schema == "prompt_completion":
        out = []
        for name, role in (("prompt", "user"), ("completion", "assistant")):
            v = record.get(name)
            if isinstance(v, str):
                out.append({"role": role, "content": v})
            elif isinstance(v, list):
                out += _messages(v, name, roles)
            else:
                raise ValueError(f"'{name}' is {'missing (null)' if v is None else 'a ' + type(v).__name__}, "
                                 "not a string or a message list")
        return out
    return _messages(record.get(fields[0]), fields[0], roles)


def _messages(value, name: str, roles: dict[str, str]) -> list[dict]:
    if value is None:
        raise ValueError(f"the '{name}' field is missing (null)")
    if not isinstance(value, list):
        raise ValueError(f"the conversation is a {type(value).__name__}, not a list of messages")
    if not value:
        raise ValueError("empty conversation (no messages)")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise ValueError(f"message {i} is a {type(m).__name__}, not an object with 'role' and 'content'")
        rk, ck = ("role", "content") if m.get("role") is not None or m.get("from") is None else ("from", "value")
        role, content = m.get(rk), m.get(ck)
        present = ", ".join(k for k, v in m.items() if v is not None) or "(none)"
        if role is None or content is None:  # datasets fills an absent key with None
            raise ValueError(f"message {i} has no '{rk if role is None else ck}' field (found fields: {present})")
        content = _content(content, i, ck)
        if role not in roles and role not in ROLES:
            raise ValueError(f"message {i}: unknown role {role!r}; expected one of {', '.join(ROLES)} or a name in "
                             "the role map (pass --role-map NAME=ROLE)")
        # other keys (reasoning_content, tool_calls, name, ...) reach the template as they are;
        # None values are dropped, as apply_chat_template drops them (datasets fills absent keys with None)
        msg = {k: v for k, v in m.items() if k not in (rk, ck, "role", "content") and v is not None}
        msg.update(role=roles.get(role, role), content=content)
        out.append(msg)
    return out


def _content(content, i: int, ck: str) -> str:
    """A string, or OpenAI text parts joined; anything else is an error."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"message {i}: content part {j} is {kind!r}, not {{'type': 'text', 'text': str}}; "
                                 "only text parts can be tokenized")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(f"message {i}: '{ck}' is a {type(content).__name__}, not a string")


def parse_role_map(spec: str | None) -> dict[str, str]:
    """``"human=user,gpt=assistant"`` -> dict; targets must be system, user, assistant or tool."""
    out: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in (spec or "").split(","))):
        src, eq, dst = item.partition("=")
        if not eq or not src or dst not in ROLES:
            raise ConfigError(f"--role-map item {item!r}: write NAME=ROLE with ROLE one of {', '.join(ROLES)}")
        out[src] = dst
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
