"""The engine side of :mod:`dflash_prep.engine.lifetime`: the launcher every engine process starts
through, and the process-group helpers both sides use.

``python -I -S launcher.py --lifeline FD --driver PID --pdeathsig SIG --grace S -- CMD...`` sets
Linux's parent-death signal (when asked), forks the watchdog into the engine's process group, then
``exec``\\ s CMD in this very process, so the pid the driver holds is the engine's own. The watchdog
waits for the driver's end of the lifeline pipe to close (the driver is gone, however it died) or
for the engine to exit, then stops what is left of the group (SIGTERM, SIGKILL after ``--grace``).
The whole contract is in :mod:`dflash_prep.engine.lifetime`'s docstring.

Standard library only, with no import of the project: the launcher runs as a file of its own
(``-I -S``: no site packages, no checkout on ``sys.path``), in whatever interpreter the driver runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1


# ----------------------------------------------------------------------------- groups
def _stat(pid: int) -> list[str] | None:
    """``state ppid pgrp ...`` of ``/proc/PID/stat`` (None when the process is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()   # comm may hold spaces and parentheses


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid`` (Linux ``/proc``; elsewhere a probe
    with signal 0 says only whether any is left: ``[pgid]`` or ``[]``)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except ProcessLookupError:
            return []
    out = []
    for d in proc.iterdir():
        if d.name.isdigit():
            fields = _stat(int(d.name))
            if fields and len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                out.append(int(d.name))
    return out


# ----------------------------------------------------------------------------- the launcher (engine side)
def _set_pdeathsig(sig: int) -> None:
    with contextlib.suppress(OSError, AttributeError):   # not Linux: the watchdog still stops the group
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)


def _gone(pid: int) -> bool:
    fields = _stat(pid)
    return fields is None or fields[0] in ("Z", "X")


def _watch(leader: int, pidfd: int | None, lifeline: int, grace_s: float) -> None:
    """The watchdog (module docstring, 2.); never returns."""
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    keep = {0, 1, 2, lifeline} | ({pidfd} if pidfd is not None else set())
    try:
        fds = [int(f) for f in os.listdir("/proc/self/fd")]
    except OSError:
        fds = list(range(3, 1024))
    for fd in fds:                  # the engine's pipes (commands, events) must see their end when it dies
        if fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)
    waits = [lifeline] + ([pidfd] if pidfd is not None else [])
    while True:
        ready = select.select(waits, [], [], None if pidfd is not None else 0.5)[0]
        if lifeline in ready and os.read(lifeline, 1) == b"":
            why = "its driver is gone"
            break
        if (pidfd is not None and pidfd in ready) or (pidfd is None and _gone(leader)):
            why = "it exited"
            break
    me = os.getpid()
    left = [p for p in group_members(os.getpgrp()) if p != me]
    if left:
        print(f"dflash-prep engine watchdog: engine {leader}: {why}; stopping the rest of its group {left}",
              file=sys.stderr, flush=True)
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            for p in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(p, sig)
            deadline = time.monotonic() + wait_s
            while (left := [p for p in group_members(os.getpgrp()) if p != me]) and time.monotonic() < deadline:
                time.sleep(0.1)
            if not left:
                break
    os._exit(0)


def _launch(argv: list[str]) -> int:
    """``launcher.py --lifeline FD --driver PID --pdeathsig SIG --grace S -- CMD...``: the watchdog
    forked off (twice, so it is nobody's child to reap), then ``exec CMD`` in this very process."""
    split = argv.index("--")
    opts, cmd = dict(zip(argv[0:split:2], argv[1:split:2])), argv[split + 1:]
    lifeline, driver = int(opts["--lifeline"]), int(opts["--driver"])
    if int(opts["--pdeathsig"]):
        _set_pdeathsig(int(opts["--pdeathsig"]))
    if os.getppid() != driver:                          # the driver died before the line above
        return 1
    leader = os.getpid()
    try:
        pidfd = os.pidfd_open(leader)                   # the engine, across the exec below
    except (AttributeError, OSError):
        pidfd = None                                    # no pidfds: the watchdog polls /proc
    mid = os.fork()
    if mid == 0:
        try:
            if os.fork() == 0:
                _watch(leader, pidfd, lifeline, float(opts["--grace"]))
        finally:
            os._exit(0)
    os.waitpid(mid, 0)
    os.close(lifeline)
    if pidfd is not None:
        os.close(pidfd)
    for s in (signal.SIGTERM, signal.SIGINT):           # not an ignored one inherited from the driver
        signal.signal(s, signal.SIG_DFL)
    try:
        os.execvp(cmd[0], cmd)
    except OSError as e:
        print(f"dflash-prep: cannot run {cmd[0]}: {e.strerror}", file=sys.stderr, flush=True)
        return 127


if __name__ == "__main__":
    sys.exit(_launch(sys.argv[1:]))
