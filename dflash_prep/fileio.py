"""Atomic, versioned, fingerprinted files.

Every file dflash-prep writes carries ``{"format": NAME, "version": N}``. It is written to
a temp path beside its destination and renamed into place, so a crash never leaves a
half-written file under the final name. Readers call :func:`read_json` /
:func:`check_header`, which reject a wrong format name or an unknown version with a
message that names the file and the fix.

Fingerprints are hex SHA-256 digests (first 16 bytes) of canonical bytes: JSON dumped
with sorted keys, or raw array bytes plus dtype and shape.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import numpy as np

from .errors import FormatError

FINGERPRINT_HEX = 32  # 128-bit digests: collision-safe, short enough to print


def fingerprint_bytes(*parts: bytes | memoryview | str) -> str:
    h = hashlib.sha256()
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()[:FINGERPRINT_HEX]


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=_json_default)


def fingerprint_json(obj: Any) -> str:
    return fingerprint_bytes(canonical_json(obj))


def fingerprint_array(a: np.ndarray) -> str:
    """Digest of dtype, shape and raw bytes; hashes a memoryview, so no copy (1.2 GB at 100M)."""
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
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
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
    atomic_write_bytes(path, (json.dumps(body, indent=2, default=_json_default) + "\n").encode())


def atomic_save_npy(path: str | os.PathLike, arr: np.ndarray) -> None:
    with atomic_file(path) as f:
        np.save(f, np.ascontiguousarray(arr), allow_pickle=False)


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temp folder beside ``final``; on success rename it into place.

    On any exception the temp folder is removed and ``final`` is untouched, so nothing
    half-written is ever visible under the final name. With ``overwrite`` an existing
    ``final`` is replaced only after the new one is complete.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    done = False
    try:
        yield tmp
        _publish_mode(tmp, is_dir=True)
        if final.exists():
            if not overwrite:
                raise FormatError(f"{final} already exists; pass --overwrite to replace it")
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
            try:
                os.replace(tmp, final)
            except OSError:
                os.replace(old, final)  # put the previous version back under its name
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        done = True
    finally:
        if not done:
            shutil.rmtree(tmp, ignore_errors=True)


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
        obj = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FormatError(f"{path}: not valid JSON ({e}); the file is corrupt, re-create it") from e
    return check_header(obj, path=path, format=format, versions=versions)


def load_npy(path: str | os.PathLike, *, dtype: np.dtype | str | None = None, mmap: bool = True) -> np.ndarray:
    """Load an ``.npy`` memory-mapped, turning truncation and corruption into FormatError."""
    path = Path(path)
    if not path.is_file():
        raise FormatError(f"{path}: file not found")
    try:
        arr = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise FormatError(f"{path}: corrupt or truncated array ({e}); re-create it") from e
    if dtype is not None and arr.dtype != np.dtype(dtype):
        raise FormatError(f"{path}: expected dtype {np.dtype(dtype)}, found {arr.dtype}")
    return arr
