"""Output folders under faults: who owns one, who may write it now, what a killed run left.

Ownership. Every output folder of ours carries its format file as a marker (a dataset
``meta.json``, a manifest root ``root.json``, an epoch ``manifest.json``, a plan
``plan.json``). :func:`check_out` refuses, before any work, an ``--out`` that is a regular
file, that holds the working directory, or that is or holds one of the inputs; stages then
replace only a folder that holds their marker (:func:`dflash_prep.formats.fileio.atomic_dir` with
``marker=``), build the new one beside it, swap, and only then delete the old one.

Concurrency. :func:`lock` takes an advisory ``flock`` on ``.NAME.lock`` beside the output
for the whole write. A second writer waits up to ``DFLASH_PREP_LOCK_WAIT`` seconds
(default 0) and then fails with a message naming the holder's pid; the kernel drops the
lock when its holder dies, so a killed run never blocks the next one.

Symbolic links. An ``--out`` that is a link to a folder is written through
(:func:`dflash_prep.formats.fileio.follow_link`): the folder it points to is replaced or filled, its
lock and temps live beside that folder, and the link stays as it was.

Debris. Temp names carry the writer's pid (``.NAME.PID.XXXXXXXX.tmp``, ``.NAME.old-PID``,
and ``dflash-prep-datasets-PID-*`` caches in TMPDIR). While holding the lock of NAME, the
next writer deletes every such temp of NAME left by another pid (no live writer can own
one: it would hold the lock). :func:`find_stale` lists, for ``dflash-prep clean``, the
temps whose pid is no longer alive on this host.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Iterable, Iterator

from dflash_prep.errors import ConfigError
from dflash_prep.formats.fileio import follow_link

LOCK_WAIT_ENV = "DFLASH_PREP_LOCK_WAIT"
CACHE_PREFIX = "dflash-prep-datasets-"
_TMP = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.[A-Za-z0-9_]{8}\.tmp$")
_OLD = re.compile(r"^\.(?P<name>.+)\.old-(?P<pid>\d+)$")
_LOCK = re.compile(r"^\.(?P<name>.+)\.lock$")
_CACHE = re.compile(rf"^{CACHE_PREFIX}(?P<pid>\d+)-.+$")


# ----------------------------------------------------------------------------- ownership
def _inside(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def check_out(out: str | os.PathLike, *, inputs: Iterable[str | os.PathLike] = (), flag: str = "--out") -> Path:
    """Refuse an output path that would destroy something that is not ours.

    Raises :class:`ConfigError` (nothing touched) when ``out`` is a regular file (or
    another non-folder), when it is or holds the working directory, or when it is or
    holds one of ``inputs``.
    """
    out = Path(out)
    if out.is_symlink() and not out.exists():
        follow_link(out)  # a link to nothing: refused, naming where it points
    if (out.exists() or out.is_symlink()) and not out.is_dir():
        raise ConfigError(f"{flag} {out} is a file, not a folder; it was left untouched. Choose another {flag}")
    r = out.resolve()
    cwd = Path.cwd().resolve()
    if _inside(cwd, r):
        raise ConfigError(f"{flag} {out} is or holds the working directory; it was left untouched. Choose a "
                          f"dedicated folder for {flag}")
    for p in inputs:
        ip = Path(p).resolve()
        if _inside(ip, r):
            raise ConfigError(f"{flag} {out} is or holds the input {p}; writing there could delete it. Choose "
                              f"another {flag}")
    return out


# ----------------------------------------------------------------------------- locks
def lock_path(target: str | os.PathLike) -> Path:
    target = Path(target)
    return target.parent / f".{target.name}.lock"


@contextlib.contextmanager
def lock(target: str | os.PathLike, *, wait: float | None = None, inside: bool = False) -> Iterator[None]:
    """Hold the advisory write lock of ``target`` (a folder or file) for the ``with`` body.

    On entry, removes the temps of ``target`` left beside it by other pids (and, with
    ``inside``, every stale temp directly inside the ``target`` folder), since holding the
    lock proves that no live writer owns them.
    """
    target = follow_link(target)  # the lock of the real folder, wherever the path comes from
    target.parent.mkdir(parents=True, exist_ok=True)
    if wait is None:
        try:
            wait = float(os.environ.get(LOCK_WAIT_ENV, "0") or 0)
        except ValueError:
            raise ConfigError(f"{LOCK_WAIT_ENV}={os.environ[LOCK_WAIT_ENV]!r} is not a number of seconds") from None
    lp = lock_path(target)
    deadline = time.monotonic() + max(0.0, wait)
    fd = _acquire(lp, target, deadline)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        stale = stale_of(target, inside=inside)
        for p in stale:  # a kill between the two renames of a swap: put the previous version back
            m = _OLD.match(p.name)
            if m and not (p.parent / m["name"]).exists():
                os.replace(p, p.parent / m["name"])
        remove(p for p in stale if p.exists())   # best effort: `dflash-prep clean` reports what stays
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lp)  # while still holding it; a waiter that locked this inode sees it gone and retries
        os.close(fd)  # closing the descriptor releases the flock


def _acquire(lp: Path, target: Path, deadline: float) -> int:
    """Open and flock ``lp``; retry when the file was unlinked or replaced meanwhile."""
    while True:
        fd = os.open(lp, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"{target} is being written by another dflash-prep process ({holder}); wait for it to finish, "
                    f"or set {LOCK_WAIT_ENV}=SECONDS to wait for it") from None
            time.sleep(0.1)
            continue
        try:
            same = os.fstat(fd).st_ino == os.stat(lp).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


# ----------------------------------------------------------------------------- debris
def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (this process counts; another user's counts too)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _temp_pid(name: str) -> tuple[str, int] | None:
    """``(target name, pid)`` of one of our temp names, else None."""
    for rx in (_TMP, _OLD):
        m = rx.match(name)
        if m:
            return m["name"], int(m["pid"])
    return None


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is one of our temp or lock names (not data)."""
    return _temp_pid(name) is not None or bool(_LOCK.match(name))


def stale_of(target: Path, *, inside: bool = False) -> list[Path]:
    """Temps of ``target`` beside it (and inside it) written by any pid but ours."""
    found = []
    if target.parent.is_dir():
        for p in target.parent.iterdir():
            t = _temp_pid(p.name)
            if t and t[0] == target.name and t[1] != os.getpid():
                found.append(p)
    if inside and target.is_dir():
        for p in target.iterdir():
            t = _temp_pid(p.name)
            if t and t[1] != os.getpid():
                found.append(p)
    return found


def _caches() -> list[Path]:
    tmp = Path(tempfile.gettempdir())
    out = []
    with contextlib.suppress(OSError):
        for p in tmp.iterdir():
            m = _CACHE.match(p.name)
            if m and not pid_alive(int(m["pid"])):
                out.append(p)
    return out


def find_stale(paths: Iterable[str | os.PathLike], *, depth: int = 3, caches: bool = True) -> list[Path]:
    """Debris of killed runs under ``paths`` (walked ``depth`` levels) and in TMPDIR.

    A temp counts as stale when the pid in its name is not alive on this host; an
    unheld ``.NAME.lock`` file counts too. Nothing that a live process owns is listed.
    """
    found: list[Path] = []

    def walk(d: Path, level: int) -> None:
        try:
            entries = list(d.iterdir())
        except OSError:
            return
        for p in entries:
            t = _temp_pid(p.name)
            if t is not None:
                if not pid_alive(t[1]):
                    found.append(p)
                continue
            if _LOCK.match(p.name) and p.is_file() and not _held(p):
                found.append(p)
                continue
            if level < depth and p.is_dir() and not p.is_symlink():
                walk(p, level + 1)

    for root in paths:
        walk(Path(root), 1)
    if caches:
        found += _caches()
    return sorted(set(found))


def _held(lock_file: Path) -> bool:
    try:
        fd = os.open(lock_file, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def remove(paths: Iterable[Path]) -> tuple[int, list[tuple[Path, str]]]:
    """Delete each path (folder or file), going on past a path it cannot delete.

    Returns ``(bytes freed, failures)``: the bytes that are gone (a folder removed in part
    counts what went), and one ``(path, reason)`` per path still there afterwards, the reason
    being the first error met under it as ``"FILE: strerror"``. A path already gone is no failure.
    """
    freed, failed = 0, []
    for p in paths:
        before, errors = size_of(p), []
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, onerror=lambda _fn, path, exc: errors.append(f"{path}: {exc[1].strerror or exc[1]}"))
            else:
                p.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            errors.append(f"{p}: {e.strerror or e}")
        left = size_of(p) if os.path.lexists(p) else 0
        freed += before - left
        if os.path.lexists(p):
            failed.append((p, str(errors[0]) if errors else "still present after the delete"))
    return freed, failed


def remove_stale_caches() -> None:
    """Drop dataset caches in TMPDIR left by killed tokenize runs (called by tokenize); best
    effort: a cache it cannot delete stays for `dflash-prep clean` to report."""
    remove(_caches())


def size_of(p: Path) -> int:
    if p.is_file() or p.is_symlink():
        with contextlib.suppress(OSError):
            return p.lstat().st_size
        return 0
    total = 0
    for dirpath, _, files in os.walk(p):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


def cache_dir() -> str:
    """A fresh pid-tagged cache folder in TMPDIR (for ``datasets``' loaders)."""
    return tempfile.mkdtemp(prefix=f"{CACHE_PREFIX}{os.getpid()}-")
