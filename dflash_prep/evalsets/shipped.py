"""The file machinery every shipped prompt set shares: evaluation sets (:mod:`dflash_prep.evalsets`) and
training prompts (:mod:`dflash_prep.trainsets`).

A shipped set is ``data/<name>.jsonl.gz``: one ``{"id": str, "turns": [str, ...]}`` object a line,
gzip-compressed at level 9 with mtime 0, no file name and Python's fixed header (OS byte 255), so
the same records give the same bytes on any machine with the same zlib. Its manifest entry records
the file's sha256, the sha256 of its JSON lines (``content_sha256``, which another zlib leaves
unchanged) and the record count; :func:`read_set` checks all three before it returns a record.
Upstream files are read with :func:`json_lines` and :func:`field`, which refuse anything that is not
the upstream layout in one line.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import zlib
from pathlib import Path

from dflash_prep.errors import FormatError, InputError
from dflash_prep.formats.fileio import atomic_write_bytes, strict_dumps


def git_blob_id(data: bytes) -> str:
    """The id git gives a file of these bytes (``git hash-object``), to match the upstream tree."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def deterministic_gzip(data: bytes) -> bytes:
    """gzip at level 9 with mtime 0 and no file name: the bytes depend only on ``data`` (and zlib)."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=buf, mtime=0) as f:
        f.write(data)
    return buf.getvalue()


def json_lines(path: Path, data: bytes) -> list[dict]:
    """Upstream JSON lines, each an object; a blank or malformed line is refused (ids are line indices)."""
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text ({e}); pass the upstream file as is") from None
    out = []
    for i, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise InputError(f"{path}:{i}: not a JSON object ({e}); pass the upstream file as is") from None
        if not isinstance(rec, dict):
            raise InputError(f"{path}:{i}: not a JSON object; pass the upstream file as is")
        out.append(rec)
    return out


def field(path: Path, where: int | str, rec: dict, key: str, kind: type) -> object:
    """``rec[key]`` when it is a ``kind`` (never a bool), else a one-line InputError naming the record."""
    value = rec.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise InputError(f"{path}: record {where} has no {kind.__name__} field {key!r}; is this the "
                         "upstream file the option names?")
    return value


def write_set(out: Path, name: str, recs: list[dict]) -> dict:
    """Write ``out/data/<name>.jsonl.gz``; return its manifest fields: file, count, sha256, content_sha256."""
    lines = "".join(strict_dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n" for r in recs).encode()
    shipped = deterministic_gzip(lines)
    rel = f"data/{name}.jsonl.gz"
    atomic_write_bytes(out / rel, shipped)
    return {"file": rel, "count": len(recs), "sha256": hashlib.sha256(shipped).hexdigest(),
            "content_sha256": hashlib.sha256(lines).hexdigest()}


def _decode(path: Path, data: bytes, rebuild: str) -> tuple[bytes, list]:
    """The JSON lines inside the gzip bytes ``data`` (and those lines' bytes, for their hash)."""
    try:
        raw = gzip.decompress(data)
        return raw, [json.loads(line) for line in raw.decode("utf-8").splitlines()]
    except (OSError, EOFError, zlib.error, UnicodeDecodeError, ValueError) as e:
        raise FormatError(f"{path}: not gzip-compressed JSON lines ({e}); {rebuild}") from None


def read_set(root: Path, entry: dict, rebuild: str) -> list[dict]:
    """The records of the manifest ``entry``'s file under ``root``, each ``{"id": str, "turns": [str]}``.

    Raises FormatError (one line, ending in ``rebuild``: how to get a good copy) when the file is
    missing, its bytes or content differ from the entry's sha256, it holds another number of
    records, or a record has another shape or number of turns than ``entry["turns"]``."""
    path = root / entry["file"]
    if not path.is_file():
        raise FormatError(f"{path}: file not found; {rebuild}")
    data = path.read_bytes()
    got = hashlib.sha256(data).hexdigest()
    if got != entry["sha256"]:
        raise FormatError(f"{path}: sha256 {got[:16]}... differs from the manifest's {entry['sha256'][:16]}..., "
                          f"so the file was changed or is corrupt; {rebuild}")
    raw, records = _decode(path, data, rebuild)
    content = hashlib.sha256(raw).hexdigest()
    if content != entry["content_sha256"] or len(records) != entry["count"]:
        raise FormatError(f"{path}: {len(records)} records with content sha256 {content[:16]}..., the manifest "
                          f"says {entry['count']} with {entry['content_sha256'][:16]}...; {rebuild}")
    for i, rec in enumerate(records):
        ok = isinstance(rec, dict) and isinstance(rec.get("id"), str) and isinstance(rec.get("turns"), list)
        if not ok or len(rec["turns"]) != entry["turns"] or not all(isinstance(t, str) for t in rec["turns"]):
            raise FormatError(f"{path}: record {i} is not {{'id': str, 'turns': [{entry['turns']} str]}}; {rebuild}")
    return records
