"""Engine processes that never outlive their driver: the one way every engine process is started.

Every process a command starts for an engine (``evaluate``'s vLLM server, the states worker of
``extract`` and of the trainer's online target, ``--eval-every``'s background evaluation) goes
through :func:`spawn`, which gives it three guards:

1. **A process group of its own** (a new session). vLLM's own processes (API server, engine core,
   workers) join it, so the group is what we stop: :func:`stop_group` sends SIGTERM to the group,
   SIGKILL after a bounded wait, then checks through ``/proc`` that no live member is left.
2. **A watchdog in the group, for a driver that dies without a word** (SIGKILL, the OOM killer).
   The command runs through a launcher (:mod:`dflash_prep.engine.launcher`: ``python -I -S
   launcher.py ... -- CMD``, standard library only), which forks the watchdog and then ``exec``\\ s CMD: CMD keeps the
   launcher's pid, so the pid the driver holds is the engine's own. The watchdog waits on the read
   end of a pipe whose only write end the driver holds (end of file: the driver is gone, however
   it died and whichever of its threads started the engine) and on a pidfd of the engine (it
   exited). Either way it stops the rest of the group (SIGTERM, SIGKILL after ``grace_s``) and
   exits. It ignores SIGTERM, SIGINT and SIGHUP, so the group's own SIGTERM never ends it before
   that is done. Started from the driver's main thread, the launcher also sets Linux's
   ``PR_SET_PDEATHSIG`` (SIGKILL) before the ``exec``: the engine's first process dies with the
   driver even when the watchdog was killed too. The kernel sends it when the *thread* that
   forked exits, so an engine started from another thread is left to the watchdog alone.
3. **Handlers for SIGTERM and SIGINT in the driver** while at least one engine lives (installed
   from the main thread, the previous ones restored when the last engine stops): the signal stops
   every live engine's group as in 1., SIGKILL after ``GRACE_S`` at the top and ``GRACE_S / (1 +
   level)`` in a driver that is itself an engine (:func:`signal_grace_s`; not :meth:`Engine.stop`'s
   20 s: nested drivers, a trainer over its evaluation over a vLLM server, would otherwise each wait
   the full 20 s for a server that hangs in its shutdown, and an inner one must be done before the
   outer one's grace ends), then goes to the handler that was there before. SIGTERM's
   default then ends the driver with the signal (exit status 143 in a shell, -15 to a parent),
   SIGINT's raises ``KeyboardInterrupt`` (the CLI exits 130; the trainer keeps its checkpoint).
   A signal the driver ignores gets no handler (a shell starts a background job with SIGINT
   ignored): it ends nothing, so it stops no engine either, and the driver goes on with its
   engines. The engine itself starts with SIGTERM and SIGINT at their defaults (the launcher
   resets them), whatever its driver inherited, so the group's SIGTERM always reaches it.

Measured (docs/engines.md#process-lifetime): the launcher adds one interpreter start (about 40 ms);
a real vLLM server is gone within a few seconds of any of the three signals.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from dflash_prep.engine import launcher
from dflash_prep.engine.launcher import _stat, group_members  # noqa: F401 (re-exported: the driver's side reads groups too)
from dflash_prep.errors import EngineError

LAUNCHER = Path(launcher.__file__).resolve()
GRACE_S = 5.0
"""Seconds the watchdog gives the group after SIGTERM before SIGKILL, when the driver is gone (no
one waits for a clean shutdown then; the engine gets the time to release its device)."""
LEVEL_VAR = "DFLASH_PREP_ENGINE_LEVEL"
"""How deep in a chain of drivers this process is (unset: 0, the top; :func:`spawn` gives each engine
its driver's level + 1)."""


def _level() -> int:
    try:
        return max(0, int(os.environ.get(LEVEL_VAR, "0")))
    except ValueError:
        return 0


def signal_grace_s() -> float:
    """Seconds this driver's signal handler gives its engines before SIGKILL: ``GRACE_S`` at the top,
    ``GRACE_S / (1 + level)`` below, so that a driver that is itself an engine (a trainer's
    evaluation, driving a vLLM server) has stopped its own engines before its driver's grace ends."""
    return GRACE_S / (1 + _level())


SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""The driver's signals that stop its engines before they take effect."""


# ----------------------------------------------------------------------------- groups
def stop_group(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """SIGTERM to the group of ``proc`` (its leader), SIGKILL after ``timeout_s``, then wait until
    no live process of the group is left (:class:`~dflash_prep.errors.EngineError` if one survives
    SIGKILL 10 s)."""
    pgid = proc.pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        # an exited leader not reaped yet is a zombie, not a member: done without waiting on Popen's
        # lock (a signal handler may run while this thread holds it in Popen.wait)
        if not group_members(pgid):
            proc.poll()
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while (left := group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        raise EngineError(f"the engine's processes {left} (group {pgid}) survived SIGKILL; kill them by hand")


# ----------------------------------------------------------------------------- the driver's side
class Engine:
    """An engine process started by :func:`spawn`: ``proc`` (its ``Popen``; ``pid`` is the engine's
    and its group's id) and :meth:`stop`. A context manager that stops it on exit."""

    def __init__(self, cmd: list[str], *, grace_s: float, pass_fds: tuple[int, ...], popen: dict):
        read, self._lifeline = os.pipe()               # both ends close on exec: only the launcher gets `read`
        main = threading.current_thread() is threading.main_thread()
        argv = [sys.executable, "-I", "-S", str(LAUNCHER), "--lifeline", str(read), "--driver", str(os.getpid()),
                    "--pdeathsig", str(int(signal.SIGKILL) if main else 0), "--grace", str(grace_s),
                    "--", *map(str, cmd)]
        self.command = [str(c) for c in cmd]
        self._on_stop: list = []
        self._lock = threading.RLock()                 # reentrant: the signal handler may run inside stop()
        given = popen.pop("env", None)
        env = dict(os.environ if given is None else given)
        env[LEVEL_VAR] = str(_level() + 1)             # its own signal grace (signal_grace_s)
        try:
            self.proc = subprocess.Popen(argv, pass_fds=(read, *pass_fds), start_new_session=True, env=env, **popen)
        except Exception:
            os.close(self._lifeline)
            raise
        finally:
            os.close(read)
        self.pid, self.driver = self.proc.pid, os.getpid()
        _register(self)

    def poll(self) -> int | None:
        return self.proc.poll()

    def on_stop(self, fn) -> None:
        """Have :meth:`stop` call ``fn()`` once the group is gone (e.g. remove a temp folder the engine
        wrote in): also when a signal stopped it."""
        self._on_stop.append(fn)

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop the whole group (:func:`stop_group`); safe to call again, from any thread."""
        try:
            stop_group(self.proc, timeout_s)
            with self._lock:
                todo, self._on_stop = self._on_stop, []
            for fn in todo:
                fn()
        finally:
            with self._lock:
                fd, self._lifeline = self._lifeline, -1
            if fd >= 0:
                os.close(fd)                           # the watchdog sees the end and leaves
            _unregister(self)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def spawn(cmd: list, *, grace_s: float = GRACE_S, pass_fds: tuple[int, ...] = (), **popen) -> Engine:
    """Start ``cmd`` as an engine process that dies with this one (module docstring). ``popen`` goes
    to ``subprocess.Popen`` (stdin, stdout, stderr, env, cwd); ``pass_fds`` keep their numbers."""
    for k in ("start_new_session", "preexec_fn", "process_group", "close_fds"):
        if k in popen:
            raise ValueError(f"spawn sets {k} itself")
    return Engine(list(cmd), grace_s=grace_s, pass_fds=tuple(pass_fds), popen=popen)


_LIVE: list[Engine] = []
_PREVIOUS: dict[int, object] = {}
_STATE = threading.RLock()


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _register(engine: Engine) -> None:
    with _STATE:
        _LIVE.append(engine)
        if _PREVIOUS or not _main_thread():            # installed already, or cannot be from here
            return
        for s in SIGNALS:
            _PREVIOUS[s] = previous = signal.getsignal(s)
            if previous != signal.SIG_IGN:             # an ignored signal ends nothing: it stops no engine
                signal.signal(s, _on_signal)


def _unregister(engine: Engine) -> None:
    with _STATE:
        if engine in _LIVE:
            _LIVE.remove(engine)
        if not _LIVE and _main_thread():
            _restore()


def _restore() -> None:
    """The handlers that were there before the first engine, where ours is still the one installed."""
    for s, prev in _PREVIOUS.items():
        if signal.getsignal(s) is _on_signal:
            signal.signal(s, signal.SIG_DFL if prev is None else prev)
    _PREVIOUS.clear()


def _on_signal(signum: int, frame) -> None:
    """SIGTERM or SIGINT while engines live: stop their groups, then what would have happened."""
    with _STATE:   # a process forked from the driver inherits this handler, not the driver's engines
        live, prev = [e for e in _LIVE if e.driver == os.getpid()], _PREVIOUS.get(signum, signal.SIG_DFL)
    for e in live:                                      # all told at once, then each waited for
        with contextlib.suppress(ProcessLookupError):
            os.killpg(e.pid, signal.SIGTERM)
    for e in reversed(live):
        try:
            e.stop(timeout_s=signal_grace_s())   # a signal wants the driver gone: not stop()'s 20 s
        except Exception as err:  # noqa: BLE001 - one engine that will not die must not keep the others alive
            print(f"error: {err}", file=sys.stderr, flush=True)
    with _STATE:
        _restore()
    if prev is None:
        prev = signal.SIG_DFL
    if callable(prev):
        prev(signum, frame)                             # Python's SIGINT handler: KeyboardInterrupt
        return
    signal.signal(signum, signal.SIG_DFL)               # the default: end with the signal itself
    signal.raise_signal(signum)
    os._exit(128 + signum)
