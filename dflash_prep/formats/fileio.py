"""Atomic, versioned, fingerprinted files.

Every file dflash-prep writes carries ``{"format": NAME, "version": N}``. It is written to
a temp path beside its destination and renamed into place, so a crash never leaves a
half-written file under the final name. Readers call :func:`read_json` /
:func:`check_header`, which reject a wrong format name or an unknown version with a
message that names the file and the fix.

Fingerprints are hex SHA-256 digests (first 16 bytes) of canonical bytes: JSON dumped
with sorted keys, or raw array bytes plus dtype and shape. SHA-256 is a small share of a
pack; its rate and its cost when a manifest is opened (``bench/hash_cost.py``):
docs/reliability.md#integrity-on-read.

Every JSON file is strict: NaN and Infinity are refused on write (:class:`FormatError`),
never written as the non-standard ``NaN`` token, and refused on read.

Temp names carry the writer's pid (``.NAME.PID.XXXX.tmp``, ``.NAME.old-PID``), so a later
run or ``dflash-prep clean`` can tell debris of a killed run (:mod:`dflash_prep.formats.outputs`)
from the work of a live one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import tokenize
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import numpy as np

from dflash_prep.errors import FormatError

FINGERPRINT_HEX = 32  # 128-bit digests: collision-safe, short enough to print


def fingerprint_bytes(*parts: bytes | memoryview | str) -> str:
    h = hashlib.sha256()
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()[:FINGERPRINT_HEX]


def canonical_json(obj: Any) -> str:
    return strict_dumps(obj, sort_keys=True, separators=(",", ":"))


def strict_dumps(obj: Any, **kw) -> str:
    """``json.dumps`` that refuses NaN/Infinity (a :class:`FormatError` naming the field)."""
    try:
        return json.dumps(obj, allow_nan=False, default=_json_default, **kw)
    except ValueError as e:
        raise FormatError(f"refusing to write non-standard JSON ({e}): {_nonfinite_path(obj) or '?'} is NaN or "
                          "infinite; every number dflash-prep writes must be finite") from None


def _nonfinite_path(obj: Any, prefix: str = "") -> str | None:
    """Dotted path of the first NaN/Infinity inside ``obj`` (for the error message)."""
    if isinstance(obj, (float, np.floating)) and not np.isfinite(float(obj)):
        return prefix or "(value)"
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for k, v in items:
        hit = _nonfinite_path(v, f"{prefix}.{k}" if prefix else str(k))
        if hit:
            return hit
    return None


def _reject_constant(name: str):
    raise ValueError(f"non-standard JSON constant {name}")


def strict_loads(text: str | bytes) -> Any:
    """``json.loads`` that refuses NaN/Infinity (raises ValueError, as a decode error does)."""
    return json.loads(text, parse_constant=_reject_constant)


def fingerprint_json(obj: Any) -> str:
    return fingerprint_bytes(canonical_json(obj))


def fingerprint_file(path: str | os.PathLike, chunk: int = 16 << 20) -> str:
    """Digest of a file's bytes, streamed in 16 MiB chunks (shard content hashes)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()[:FINGERPRINT_HEX]


def fingerprint_array(a: np.ndarray) -> str:
    """Digest of dtype, shape and raw bytes; hashes a memoryview, so no copy of the array."""
    a = np.ascontiguousarray(a)
    return fingerprint_bytes(str(a.dtype), repr(a.shape), memoryview(a).cast("B"))


def _json_default(o: Any) -> Any:
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


# ----------------------------------------------------------------------------- writing
def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def _publish_mode(path: Path, *, is_dir: bool) -> None:
    """mkstemp/mkdtemp create 0600/0700; give the final file the mode a plain open() would."""
    os.chmod(path, (0o777 if is_dir else 0o666) & ~_umask())


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """Yield a binary file beside ``path``; on success fsync it and rename it into place.

    If the body raises (or the process dies), ``path`` is untouched and the temp file is
    removed (or, after a crash, left as a hidden ``.name.*.tmp`` that no reader opens).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
    done = False
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        _publish_mode(Path(tmp), is_dir=False)
        os.replace(tmp, path)
        done = True
    finally:
        if not done:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_file(path) as f:
        f.write(data)


def atomic_write_json(path: str | os.PathLike, obj: dict, *, format: str, version: int) -> None:
    """Write ``obj`` with its format header first, atomically."""
    body = {"format": format, "version": version, **{k: v for k, v in obj.items() if k not in ("format", "version")}}
    atomic_write_bytes(path, (strict_dumps(body, indent=2) + "\n").encode())


def atomic_create_json(path: str | os.PathLike, obj: dict, *, format: str, version: int) -> bool:
    """Write ``obj`` as :func:`atomic_write_json` does, but only when ``path`` does not exist yet;
    True when this call created it. For a file several processes (on several machines, on shared
    storage) may write at once, which must never replace another's: the complete temp is hard-linked
    to the final name, which fails when the name exists (atomic on local disks and NFS). Where the
    file system has no hard links, it is renamed into place when absent (a writer racing there may
    replace an equal file: callers read it back and compare)."""
    path = Path(path)
    body = {"format": format, "version": version, **{k: v for k, v in obj.items() if k not in ("format", "version")}}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write((strict_dumps(body, indent=2) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())
        _publish_mode(Path(tmp), is_dir=False)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError:                          # no hard links here (some FUSE / object-store mounts)
            if path.exists():
                return False
            os.replace(tmp, path)
            return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def atomic_save_npy(path: str | os.PathLike, arr: np.ndarray) -> None:
    with atomic_file(path) as f:
        np.save(f, np.ascontiguousarray(arr), allow_pickle=False)


def holds_marker(folder: str | os.PathLike, marker: str, format: str) -> bool:
    """Whether ``folder/marker`` is a JSON file of ``format``, i.e. the folder is ours."""
    p = Path(folder) / marker
    if not p.is_file():
        return False
    try:
        with open(p, "rb") as f:
            obj = json.loads(f.read(1 << 26))
    except (OSError, ValueError):
        return False
    return isinstance(obj, dict) and obj.get("format") == format


def _may_replace(final: Path, overwrite: bool, marker: tuple[str, str] | None) -> None:
    if not final.is_dir():
        raise FormatError(f"{final} is a file, not a folder; it was left untouched, choose another --out")
    if not overwrite:
        raise FormatError(f"{final} already exists; pass --overwrite to replace it")
    if marker is not None and not holds_marker(final, *marker):
        raise FormatError(f"{final} holds no {marker[0]} of format {marker[1]!r}, so it is not a dflash-prep "
                          "output; it was left untouched. Remove it yourself or choose another --out")


def follow_link(path: str | os.PathLike) -> Path:
    """``path``, or the folder it points to when ``path`` is a symbolic link.

    Every command that writes a folder writes *through* a link: ``--out LINK`` replaces (or
    fills) the folder LINK points to, atomically as any other, and LINK stays a link. The
    link's target is resolved once, so the lock, the temps and the swap all live beside the
    real folder (two writers, one through the link and one by the real path, share a lock).
    A link to nothing is refused."""
    path = Path(path)
    if not path.is_symlink():
        return path
    target = Path(os.path.realpath(path))
    if not target.exists():
        raise FormatError(f"{path} is a symbolic link to {target}, which does not exist; create that folder, "
                          "remove the link, or choose another --out")
    return target


def _remove_old(old: Path, final: Path) -> None:
    """Delete the previous version after a swap; a failure is an error, never debris left silently."""
    try:
        shutil.rmtree(old)
    except OSError as e:
        raise FormatError(f"{final} was written, but its previous version, moved to {old}, could not be deleted "
                          f"({e}); delete {old} yourself") from e


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike, *, overwrite: bool = False,
               marker: tuple[str, str] | None = None) -> Iterator[Path]:
    """Yield a temp folder beside ``final``; on success rename it into place.

    On any exception the temp folder is removed and ``final`` is untouched, so nothing
    half-written is ever visible under the final name. With ``overwrite`` an existing
    ``final`` is replaced only after the new one is complete: build beside, swap, then
    delete the old one. With ``marker = (file, format)`` an existing ``final`` is replaced
    only when it holds that marker file (it is one of ours), never a user's folder; a
    regular file under the final name is never replaced. A ``final`` that is a symbolic link
    is written through (:func:`follow_link`): the folder it points to is replaced.
    """
    final = follow_link(final)
    if final.exists():  # fail before the work, and again at the swap (another writer may have been quicker)
        _may_replace(final, overwrite, marker)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.{os.getpid()}.", suffix=".tmp", dir=final.parent))
    done = False
    try:
        yield tmp
        _publish_mode(tmp, is_dir=True)
        if final.exists():
            _may_replace(final, overwrite, marker)
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
            try:
                os.replace(tmp, final)
            except OSError:
                os.replace(old, final)  # put the previous version back under its name
                raise
            done = True
            _remove_old(old, final)
        else:
            os.replace(tmp, final)
            done = True
    finally:
        if not done and tmp.exists():
            shutil.rmtree(tmp)  # a failure here is raised, chained to the one that brought us here


# ----------------------------------------------------------------------------- reading
def check_header(obj: dict, *, path: str | os.PathLike, format: str, versions: tuple[int, ...]) -> dict:
    got_fmt = obj.get("format") if isinstance(obj, dict) else None
    if got_fmt != format:
        raise FormatError(
            f"{path}: expected a '{format}' file but found format {got_fmt!r}. "
            "Point the command at the file dflash-prep wrote for this stage."
        )
    if obj.get("version") not in versions:
        raise FormatError(
            f"{path}: '{format}' version {obj.get('version')!r} is not supported by this "
            f"dflash-prep (supports {', '.join(map(str, versions))}). Re-create it with this version."
        )
    return obj


def read_json(path: str | os.PathLike, *, format: str, versions: tuple[int, ...] = (1,)) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FormatError(f"{path}: file not found")
    try:
        obj = strict_loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise FormatError(f"{path}: not valid JSON ({e}); the file is corrupt, re-create it") from e
    return check_header(obj, path=path, format=format, versions=versions)


def load_npy(path: str | os.PathLike, *, dtype: np.dtype | str | None = None, mmap: bool = True) -> np.ndarray:
    """Load an ``.npy`` memory-mapped, turning truncation and corruption into FormatError.

    Every reader of our arrays (datasets, lengths files, manifests) comes through here, so a
    corrupt header (numpy parses it with :mod:`tokenize` and :func:`ast.literal_eval`, which
    raise ``TokenError`` / ``SyntaxError``) is the same one-line error as a truncated body."""
    path = Path(path)
    if not path.is_file():
        raise FormatError(f"{path}: file not found")
    try:
        arr = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (ValueError, OSError, EOFError, SyntaxError, tokenize.TokenError) as e:  # numpy tokenizes the header
        raise FormatError(f"{path}: corrupt or truncated array ({e}); re-create it") from e
    if dtype is not None and arr.dtype != np.dtype(dtype):
        raise FormatError(f"{path}: expected dtype {np.dtype(dtype)}, found {arr.dtype}")
    return arr
