"""The file machinery every shipped prompt set shares: evaluation sets (:mod:`dflash_prep.evalsets`) and
training prompts (:mod:`dflash_prep.trainsets`).

A shipped set is ``data/<name>.jsonl.gz``: one ``{"id": str, "turns": [str, ...]}`` object a line,
gzip-compressed at level 9 with mtime 0, no file name and Python's fixed header (OS byte 255), so
the same records give the same bytes on any machine with the same zlib. Its manifest entry records
the file's sha256, the sha256 of its JSON lines (``content_sha256``, which another zlib leaves
unchanged) and the record count; :func:`read_set` checks all three before it returns a record.
Upstream files are read with :func:`json_lines` and :func:`field`, which refuse anything that is not
the upstream layout in one line.

Both packages also share the rest of their plumbing from here: the manifest check
(:func:`read_manifest`), the sampling rule (:func:`sample_key`, :func:`smallest`, :func:`sample`),
and the rebuild script's reading of its inputs (:func:`read_input`, :func:`json_objects`,
:func:`read_inputs`), its manifest's upstream identity (:func:`upstream_identity`) and its command
line (:func:`build_parser`, :func:`parsed_inputs`).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

from dflash_prep.errors import ConfigError, FormatError, InputError
from dflash_prep.formats.fileio import atomic_write_bytes, read_json, strict_dumps

T = TypeVar("T")


class UpstreamSource(Protocol):
    """What the rebuild machinery reads of a set's source (``SetSource``, ``TrainSource``)."""

    name: str
    repo: str
    path: str
    commit: str


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


def read_manifest(root: Path, *, format: str, version: int, entry_keys: Sequence[str], rebuild: str) -> dict:
    """``root/manifest.json`` of ``format`` ``version``, checked to list ``sets`` entries that each hold
    ``entry_keys`` (a FormatError in one line, ending in ``rebuild``, if it lacks what readers use)."""
    path = root / "manifest.json"
    manifest = read_json(path, format=format, versions=(version,))
    sets = manifest.get("sets")
    if not isinstance(sets, list) or not all(isinstance(e, dict) and all(k in e for k in entry_keys) for e in sets):
        raise FormatError(f"{path}: 'sets' must list entries with {', '.join(entry_keys)}; {rebuild}")
    return manifest


def sample_key(name: str, id: str, seed: int) -> str:
    """A record's rank in every sample of ``name`` under ``seed`` (smaller is taken first)."""
    return hashlib.sha256(f"{seed}:{name}:{id}".encode()).hexdigest()


def smallest(name: str, recs: list[T], n: int, seed: int, id_of: Callable[[T], str]) -> list[T]:
    """The ``n`` of ``recs`` with the smallest :func:`sample_key` under ``seed``, in their order in ``recs``.

    A record's rank depends only on its own key, so the ``n`` chosen lie inside the ``n + 1``."""
    ranked = sorted(range(len(recs)), key=lambda i: (sample_key(name, id_of(recs[i]), seed), i))
    return [recs[i] for i in sorted(ranked[:n])]


def sample(name: str, n: int, seed: int, load: Callable[[], list[T]], id_of: Callable[[T], str]) -> list[T]:
    """``n`` of the records ``load()`` returns (all when ``n`` is 0 or at least the count): :func:`smallest`.

    ``n`` and ``seed`` are checked before anything is read (ConfigError, one line)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"sample size must be a whole number >= 0 (0 takes every record), got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"sample seed must be a whole number, got {seed!r}")
    recs = load()
    if n == 0 or n >= len(recs):
        return recs
    return smallest(name, recs, n, seed, id_of)


# ----------------------------------------------------------------------------- rebuilding from upstream
def read_input(src: UpstreamSource, path: str | Path) -> tuple[Path, bytes]:
    """``path`` and its bytes: the upstream file of ``src`` (InputError, naming the option, when missing)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: file not found (--{src.name} names the upstream {src.repo}:{src.path})")
    return path, path.read_bytes()


def json_objects(path: Path, data: bytes, upstream: str) -> list[dict]:
    """An upstream JSON list of objects (the file ``upstream``, named in the refusal) in one InputError."""
    try:
        rows = json.loads(data)
    except ValueError as e:
        raise InputError(f"{path}: not JSON ({e}); pass the upstream {upstream} as is") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise InputError(f"{path}: expected a JSON list of objects ({upstream})")
    return rows


def read_inputs(sources: Sequence[T], inputs: dict[str, str | Path],
                read: Callable[[T, str | Path], tuple[bytes, list[dict]]]) -> list[tuple[T, bytes, list[dict]]]:
    """``(source, upstream bytes, records)`` for every source, all read (and so checked) before a write."""
    missing = [s.name for s in sources if s.name not in inputs]
    if missing:
        raise InputError(f"no upstream file for {', '.join(missing)}; every set is rebuilt together")
    return [(src, *read(src, inputs[src.name])) for src in sources]


def upstream_identity(src: UpstreamSource, upstream: bytes, commits: dict[str, str]) -> dict:
    """The manifest's ``source`` fields: repo, path, commit (``commits`` overrides ``src``'s), the
    upstream file's git blob id and sha256."""
    return {"repo": src.repo, "path": src.path, "commit": commits.get(src.name, src.commit),
            "git_blob": git_blob_id(upstream), "sha256": hashlib.sha256(upstream).hexdigest()}


def build_parser(prog: str, doc: str, sources: Sequence[UpstreamSource], root: Path) -> argparse.ArgumentParser:
    """A rebuild script's options: ``--<set> FILE`` and ``--<set>-commit SHA`` per source, and ``--out``."""
    ap = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    for src in sources:
        ap.add_argument(f"--{src.name}", required=True, type=Path, metavar="FILE", dest=f"file:{src.name}",
                        help=f"{src.repo}:{src.path} at --{src.name}-commit")
        ap.add_argument(f"--{src.name}-commit", default=src.commit, metavar="SHA", dest=f"commit:{src.name}",
                        help=f"the upstream commit to record (default {src.commit})")
    ap.add_argument("--out", type=Path, default=root, help=f"where to write manifest.json and data/ (default {root})")
    return ap


def parsed_inputs(args: dict, sources: Sequence[UpstreamSource]) -> tuple[dict[str, Path], dict[str, str]]:
    """The upstream file and the commit to record per set, from :func:`build_parser`'s parsed options."""
    return {s.name: args[f"file:{s.name}"] for s in sources}, {s.name: args[f"commit:{s.name}"] for s in sources}
