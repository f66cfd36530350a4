"""The engine processes' lifetime (dflash_prep/engine/lifetime.py) without an engine: a driver
starts a stand-in engine tree (a leader, a child that ignores SIGTERM, a grandchild) through
``spawn`` and is then killed each way; nothing of the tree may be left. The same with the real
vLLM is tests/engine/test_engine_lifetime.py (``engine`` marker)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from dflash_prep.engine import lifetime
from dflash_prep.engine.lifetime import group_members, spawn

# leader -> child (ignores SIGTERM) -> grandchild; each makes a file named by its pid in the folder
# argv[1] (not a line in one shared file: forks share its offset, and a loaded CI machine once ran two
# lines together); all sleep
TREE = ("import os, signal, sys, time\n"
        "def here(): open(os.path.join(sys.argv[1], str(os.getpid())), 'w').close()\n"
        "if os.fork() == 0:\n"
        "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "    if os.fork() == 0:\n"
        "        here(); time.sleep(600)\n"
        "    here(); time.sleep(600)\n"
        "here(); time.sleep(600)\n")

# the driver's SIGINT as argv[3] says, not as this suite was started with (a shell's background job
# starts with SIGINT ignored, and a driver inherits that)
DRIVER = ("import json, os, signal, sys, threading, time\n"
          "from dflash_prep.engine.lifetime import spawn\n"
          "out = sys.argv[1]; where = sys.argv[2]\n"
          "signal.signal(signal.SIGINT, signal.SIG_IGN if sys.argv[3] == 'ignored' else signal.default_int_handler)\n"
          "code = {tree!r}\n"
          "box = {{}}\n"
          "def start():\n"
          "    box['e'] = spawn([sys.executable, '-c', code, out], grace_s=2.0)\n"
          "if where == 'thread':\n"
          "    t = threading.Thread(target=start); t.start(); t.join()   # the starting thread ends here\n"
          "else:\n"
          "    start()\n"
          "print(json.dumps({{'pid': box['e'].pid}}), flush=True)\n"
          "time.sleep(600)\n").format(tree=TREE)


def _alive(pids) -> list[int]:
    return [p for p in pids if (f := lifetime._stat(p)) is not None and f[0] not in ("Z", "X")]


@contextlib.contextmanager
def _driver(tmp_path, where: str = "main", sigint: str = "default"):
    """``(driver, engine group, its members)`` of a stand-in driver whose SIGINT is ``default``
    (Python's, as in a terminal) or ``ignored``; whatever is left is killed after."""
    err = open(tmp_path / "driver.err", "w")
    here = tmp_path / "tree"
    here.mkdir()
    p = subprocess.Popen([sys.executable, "-c", DRIVER, str(here), where, sigint], stdout=subprocess.PIPE,
                         stderr=err, text=True, start_new_session=True)
    err.close()
    pgid = json.loads(p.stdout.readline())["pid"]
    deadline = time.monotonic() + 60
    while len(os.listdir(here)) < 3:
        assert time.monotonic() < deadline, (      # what there is to see if it ever fails (once in a loaded suite)
            f"the stand-in engine did not start in 60 s: tree {sorted(os.listdir(here))}, group "
            f"{group_members(pgid)}, driver {'alive' if p.poll() is None else p.returncode}, its stderr: "
            f"{(tmp_path / 'driver.err').read_text()[-1500:]}")
        time.sleep(0.05)
    tree = [int(x) for x in os.listdir(here)]
    members = group_members(pgid)
    assert set(tree) <= set(members) and len(members) == 4, (tree, members)   # + the watchdog
    try:
        yield p, pgid, members
    finally:
        if p.poll() is None:
            p.kill()
        for q in _alive(members):
            os.kill(q, signal.SIGKILL)


def _ignores(pid: int, sig: int) -> bool:
    """Whether process ``pid`` ignores ``sig`` (the SigIgn mask of /proc/PID/status)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    raise AssertionError(f"no SigIgn line for {pid}")


@contextlib.contextmanager
def _sigint(handler):
    """This process's SIGINT set to ``handler`` for the block, whatever this suite was started with."""
    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def _gone_within(pgid: int, pids: list[int], seconds: float) -> float:
    t0 = time.monotonic()
    while (group_members(pgid) or _alive(pids)) and time.monotonic() - t0 < seconds:
        time.sleep(0.05)
    assert not group_members(pgid) and not _alive(pids), (group_members(pgid), _alive(pids))
    return time.monotonic() - t0


@pytest.mark.parametrize("sig, rc", [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, -signal.SIGINT),
                                     (signal.SIGKILL, -signal.SIGKILL)], ids=["SIGTERM", "SIGINT", "SIGKILL"])
def test_a_killed_driver_leaves_no_engine_process(tmp_path, sig, rc):
    """SIGTERM, SIGINT: the driver stops the group (the child ignoring SIGTERM is killed after the
    grace) before it ends with the signal's own status; SIGKILL: the watchdog does it."""
    with _driver(tmp_path) as (p, pgid, members):
        os.kill(p.pid, sig)
        assert p.wait(timeout=30) == rc
        if sig != signal.SIGKILL:
            assert not _alive(members), "the driver ended before its engine was gone"
        _gone_within(pgid, members, 20)


def test_a_driver_that_ignores_sigint_keeps_its_engine_through_it(tmp_path):
    """A shell starts a background job with SIGINT ignored: SIGINT ends neither that driver nor its
    engine (it had stopped the engine and left the driver running without it); SIGTERM still stops
    both. The engine does not inherit the ignored SIGINT."""
    with _driver(tmp_path, sigint="ignored") as (p, pgid, members):
        assert _ignores(p.pid, signal.SIGINT) and not _ignores(pgid, signal.SIGINT)
        os.kill(p.pid, signal.SIGINT)
        time.sleep(1.0)
        assert p.poll() is None, "SIGINT ended a driver that ignores it"
        assert len(_alive(members)) == 4, "SIGINT, which the driver ignores, stopped its engine"
        os.kill(p.pid, signal.SIGTERM)
        assert p.wait(timeout=30) == -signal.SIGTERM
        assert not _alive(members), "the driver ended before its engine was gone"
        _gone_within(pgid, members, 20)


def test_an_engine_started_from_a_thread_outlives_that_thread_not_the_driver(tmp_path):
    """Linux's parent-death signal fires when the forking *thread* ends: from another thread it is
    not set, the engine lives on after that thread, and the watchdog still stops it with the driver."""
    with _driver(tmp_path, where="thread") as (p, pgid, members):
        time.sleep(1.0)
        assert len(_alive(members)) == 4, "the engine died with the thread that started it"
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        _gone_within(pgid, members, 20)


@pytest.mark.parametrize("sigint", [signal.default_int_handler, signal.SIG_IGN], ids=["sigint", "sigint-ignored"])
def test_the_handlers_live_as_long_as_the_engine(tmp_path, sigint):
    """Ours for each signal while the engine lives, but for one this process ignores; then the ones
    that were there before."""
    with _sigint(sigint):
        before = {s: signal.getsignal(s) for s in lifetime.SIGNALS}
        with spawn([sys.executable, "-c", "import time; time.sleep(60)"]) as e:
            assert signal.getsignal(signal.SIGTERM) is lifetime._on_signal
            assert signal.getsignal(signal.SIGINT) is (lifetime._on_signal if sigint is not signal.SIG_IGN else sigint)
            assert group_members(e.pid)
        assert {s: signal.getsignal(s) for s in lifetime.SIGNALS} == before
        assert not group_members(e.pid) and e.poll() == -signal.SIGTERM


def test_an_engine_that_ends_takes_its_orphans_with_it(tmp_path):
    """The leader exits on its own and leaves a child behind: the watchdog stops that child."""
    code = "import os, time\nif os.fork() == 0:\n    time.sleep(600)\nprint(os.getpid())\n"
    e = spawn([sys.executable, "-c", code], grace_s=1.0, stdout=subprocess.DEVNULL)
    try:
        assert e.proc.wait(timeout=30) == 0
        _gone_within(e.pid, [], 20)
    finally:
        e.stop()


def test_a_stopped_engine_runs_its_cleanup_once(tmp_path):
    calls = []
    e = spawn([sys.executable, "-c", "import time; time.sleep(60)"])
    e.on_stop(lambda: calls.append(1))
    e.stop(timeout_s=5)
    e.stop(timeout_s=5)
    assert calls == [1] and not group_members(e.pid)


def test_spawn_from_a_thread_installs_no_handler():
    before = signal.getsignal(signal.SIGTERM)
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("e", spawn([sys.executable, "-c", "import time; time.sleep(60)"])))
    t.start()
    t.join()
    try:
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        box["e"].stop(timeout_s=5)


def test_a_process_forked_from_the_driver_does_not_stop_the_drivers_engine():
    """A fork of the driver (a multiprocessing worker, say) inherits the handler: its own SIGTERM must
    end it, not the driver's engine."""
    with spawn([sys.executable, "-c", "import time; time.sleep(60)"]) as e:
        pid = os.fork()
        if pid == 0:                                   # the fork: waits for its SIGTERM
            time.sleep(30)
            os._exit(0)
        time.sleep(0.2)
        os.kill(pid, signal.SIGTERM)
        assert os.waitpid(pid, 0)[1] == signal.SIGTERM  # ended by the signal itself
        assert group_members(e.pid) and e.poll() is None, "the fork's SIGTERM stopped the driver's engine"


# a driver whose engine is itself a driver (a trainer over its evaluation over a vLLM server); the
# innermost engine ignores SIGTERM, as a server that hangs in its shutdown does
NESTED = ("import os, sys, time\n"
          "from dflash_prep.engine.lifetime import spawn\n"
          "depth, pids = int(sys.argv[1]), sys.argv[2]\n"
          "open(pids, 'a').write(f'{{os.getpid()}}\\n')\n"
          "if depth == 0:\n"
          "    import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
          "else:\n"
          "    e = spawn([sys.executable, '-c', {code!r}, str(depth - 1), pids])\n"
          "time.sleep(600)\n")


def test_a_signal_stops_nested_engines_within_the_grace_not_twenty_seconds(tmp_path):
    """SIGTERM to the outer driver: its handler gives the middle one ``GRACE_S``, the middle one (an
    engine itself) gives the hung innermost ``GRACE_S / 2``, so the middle one is done first and the
    driver ends only once the whole tree is gone, in about 3 s, well inside the 20 s each plain
    ``stop()`` allows (before, the outer waited out 20 s, then the watchdog 5 more)."""
    code = NESTED.format(code="")
    code = NESTED.format(code=code)                 # the middle driver's source holds the innermost one's
    pids = tmp_path / "pids.txt"
    p = subprocess.Popen([sys.executable, "-c", NESTED.format(code=code), "2", str(pids)], start_new_session=True,
                         stderr=subprocess.DEVNULL)
    tree: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(pids.read_text().split() if pids.exists() else []) < 3:
            assert time.monotonic() < deadline and p.poll() is None, "the nested engines did not start in 60 s"
            time.sleep(0.05)
        outer, middle, inner = map(int, pids.read_text().split())
        tree += group_members(middle) + group_members(inner)
        time.sleep(0.5)                              # the innermost has set SIG_IGN
        t0 = time.monotonic()
        os.kill(outer, signal.SIGTERM)
        assert p.wait(timeout=30) == -signal.SIGTERM
        exit_s = time.monotonic() - t0
        assert not _alive(tree), "the driver ended before its nested engines"   # the middle one's grace is shorter
        gone_s = _gone_within(inner, tree, 20) + exit_s
        assert exit_s < 2 * lifetime.GRACE_S + 3, exit_s
        assert gone_s < 3 * lifetime.GRACE_S, gone_s
    finally:
        if p.poll() is None:
            p.kill()
        for q in _alive(tree):
            os.kill(q, signal.SIGKILL)
