"""No engine process outlives its driver (dflash_prep/engine/lifetime.py), with the real vLLM:
``dflash-prep evaluate`` (a ``vllm serve`` API server and its engine core), ``dflash-prep
extract`` and an online trainer (``--target-engine vllm`` without ``--states``; the states
worker, vLLM in it) are each started as a user would, killed once their engine is up, and so is a
trainer with ``--eval-every`` once its background evaluation's server is up; and then:

- the driver ends with the signal's status (SIGTERM: -15; SIGINT: the CLI's 130; SIGKILL: -9),
  and for SIGTERM and SIGINT only once its engine is gone;
- within 20 s nothing is left of the engine: no live process among the pids recorded in its
  group when it was up (API server, engine core, the watchdog), none in that group, none whose
  command line names this test's engine; and the server's port is free.

One engine start per test (a signal ends the driver and its engine), so each driver's engine meets
the signals that prove something of it alone: ``evaluate`` SIGTERM (its handler stops the server)
and SIGKILL (the watchdog does); ``extract`` SIGKILL (the states worker, vLLM in it, outlives no
killed driver); the online trainer both (SIGTERM leaves no transport folder; the one SIGKILL left is
found as stale and removed by the next run's start); ``--eval-every`` SIGTERM (two nested real
drivers stopped within their grace). The other signals run the same code (lifetime.py's handler
and watchdog, whatever the engine) and are proven on a stand-in process tree, SIGINT's exit 130
included: test_lifetime_units.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dflash_prep.engine.lifetime import _stat, group_members

from dflash_prep.tests.engine.conftest import dflash_inputs

pytestmark = pytest.mark.engine

UP_S = 420.0
"""Seconds an engine may take to come up on a loaded 2-core machine."""
GONE_S = 20.0


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _live(pid: int) -> bool:
    f = _stat(pid)
    return f is not None and f[0] not in ("Z", "X")


def _pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _child(parent: int, needle: str, log: Path) -> int:
    """The pid of ``parent``'s child whose command line holds ``needle`` (the engine, its group's id)."""
    deadline = time.monotonic() + UP_S
    while True:
        for pid in _pids():
            f = _stat(pid)
            if f and int(f[1]) == parent and needle in _cmdline(pid):
                return pid
        assert _live(parent), f"{parent} ended before starting its engine: {log.read_text(errors='replace')[-3000:]}"
        assert time.monotonic() < deadline, f"no engine process in {UP_S:.0f} s"
        time.sleep(0.1)


def _wait(cond, driver: subprocess.Popen, log: Path, what: str) -> None:
    deadline = time.monotonic() + UP_S
    while not cond():
        assert driver.poll() is None, f"the driver ended ({driver.returncode}) before {what}: " \
                                      f"{log.read_text(errors='replace')[-3000:]}"
        assert time.monotonic() < deadline, f"{what}: not within {UP_S:.0f} s"
        time.sleep(0.1)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as servers bind: TIME_WAIT is no holder
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _kill_and_check(driver: subprocess.Popen, sig: int, engine: int, marker: str, *, port: int | None = None) -> dict:
    """Signal the driver; assert its status and that nothing of its engine is left (module docstring)."""
    members = group_members(engine)
    assert engine in members and len(members) >= 2, members          # the engine and its watchdog, at least
    t0 = time.monotonic()
    try:
        os.kill(driver.pid, sig)
        rc = driver.wait(timeout=120)
        exit_s = time.monotonic() - t0
        expected = {signal.SIGTERM: -signal.SIGTERM, signal.SIGINT: 130, signal.SIGKILL: -signal.SIGKILL}[sig]
        assert rc == expected, rc
        left_at_exit = [p for p in members if _live(p)]

        def left():
            named = [p for p in _pids() if marker in _cmdline(p) and _live(p) and p != os.getpid()]
            return sorted(set([p for p in members if _live(p)] + group_members(engine) + named))
        while left() and time.monotonic() - t0 < GONE_S:
            time.sleep(0.1)
        gone_s = time.monotonic() - t0
        assert not left(), f"{left()} still running {GONE_S:.0f} s after {signal.Signals(sig).name} of the driver " \
                           f"(which exited after {exit_s:.1f} s): {[_cmdline(p)[:200] for p in left()]}"
        if sig != signal.SIGKILL:
            assert not left_at_exit, f"the driver ended before its engine {left_at_exit}"
        if port is not None:
            assert _port_free(port), f"port {port} is still held"
        return {"members": len(members), "driver_exit_s": round(exit_s, 2), "engine_gone_s": round(gone_s, 2)}
    finally:
        if driver.poll() is None:
            driver.kill()
        for p in members:
            if _live(p):
                os.kill(p, signal.SIGKILL)


def _start(cmd: list[str], log: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(cmd, env={**os.environ, **env}, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def _healthy(port: int) -> bool:
    """Whether the vLLM server on ``port`` answers ``/health``."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_evaluate_leaves_no_vllm_server(built, engine_python, tmp_path, sig):
    log = tmp_path / "evaluate.log"
    driver = _start([sys.executable, "-m", "dflash_prep.cli", "evaluate", "--target", str(built["target"]),
                     "--export", str(built["dflash"]), "--prompts", str(built["prompts"]),
                     "--out", str(tmp_path / "eval.json"), "--no-ours"], log,
                    {"DFLASH_PREP_VLLM_PYTHON": str(engine_python)})
    server = _child(driver.pid, "vllm.entrypoints.openai.api_server", log)
    port = int(re.search(r"--port (\d+)", _cmdline(server))[1])
    _wait(lambda: _healthy(port), driver, log, "the server answered /health")
    got = _kill_and_check(driver, sig, server, f"--port {port}", port=port)
    print(f"evaluate {sig.name}: {got}")


@pytest.mark.parametrize("sig", [signal.SIGKILL], ids=lambda s: s.name)
def test_extract_leaves_no_states_worker(world, tmp_path, sig):
    out, log = tmp_path / "cache", tmp_path / "extract.log"
    driver = _start([sys.executable, "-m", "dflash_prep.cli", "extract", str(world["data"]), "--target",
                     str(world["target"]), "--objective", "dflash", "--draft-layers", "1", "--dtype", "bf16",
                     "--shard-mb", "0.01", "--batch-tokens", "1", "--engine-arg", "dtype=float32", "--timeout", "240",
                     "--out", str(out)], log, {"DFLASH_PREP_VLLM_PYTHON": world["py"]})
    worker = _child(driver.pid, "dflash_prep.engine.states_worker", log)
    _wait(lambda: any(out.glob("shard-*.states")), driver, log, "the first shard")   # the engine is up and working
    got = _kill_and_check(driver, sig, worker, str(out))
    assert not json.loads((out / "states.json").read_text())["complete"], "the build ended before the signal"
    print(f"extract {sig.name}: {got}")


def _transport(pid: int) -> list[Path]:
    return sorted(Path("/dev/shm").glob(f"dflash-prep-states.{pid}.*"))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_an_online_trainer_leaves_no_states_worker(world, tmp_path, sig):
    from dflash_prep.engine.states_stream import stale_scratch

    o = dflash_inputs(world, tmp_path)
    run, log, tmpdir = tmp_path / "run", tmp_path / "train.log", tmp_path / "tmpdir"
    tmpdir.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left_before = tmpdir / f"dflash-prep-states.{dead.pid}.{socket.gethostname()}.k1ll3d_x"   # a killed run's
    (left_before / "spool").mkdir(parents=True)
    driver = _start([sys.executable, "-m", "dflash_prep.train", "--data", o["data"], "--plan", o["plan"],
                     "--manifests", o["manifests"], "--target", o["target"], "--objective", "dflash",
                     "--draft-layers", "1", "--block-size", "4", "--max-anchors", "8", "--sliding-window", "0",
                     "--optimizer", "adamw", "--lr", "3e-3", "--warmup-steps", "1", "--device", "cpu", "--epochs", "200",
                     "--log-every", "1", "--no-progress", "--target-engine", "vllm", "--engine-arg", "dtype=float32",
                     "--out", str(run)], log, {"DFLASH_PREP_VLLM_PYTHON": world["py"], "TMPDIR": str(tmpdir)})
    worker = _child(driver.pid, "dflash_prep.engine.states_worker", log)

    def stepped() -> bool:
        lines = (run / "log.jsonl").read_text().splitlines() if (run / "log.jsonl").exists() else []
        return any('"global_step"' in ln for ln in lines[1:])
    _wait(stepped, driver, log, "the first step on the engine's states")
    assert not left_before.exists(), "the new run left a killed run's transport folder in place"
    mine = _transport(driver.pid)
    assert len(mine) == 1, mine                                        # /dev/shm: 24 GB here, the micro-batch fits
    got = _kill_and_check(driver, sig, worker, f"dflash-prep-states.{driver.pid}.")
    if sig == signal.SIGKILL:                        # left behind: stale now, and `dflash-prep clean` removes it
        assert _transport(driver.pid) == mine and set(mine) <= set(stale_scratch([Path("/dev/shm")]))
        r = subprocess.run([sys.executable, "-m", "dflash_prep.cli", "clean", str(tmp_path)], capture_output=True,
                           text=True, env={**os.environ, "TMPDIR": str(tmpdir)})
        assert r.returncode == 0 and f"removing {mine[0]}" in r.stdout, r.stdout + r.stderr
        assert _transport(driver.pid) == []
    else:
        assert _transport(driver.pid) == [], "the stopped run left its transport folder"
    print(f"online trainer {sig.name}: {got}")


EVAL_DRIVER = """import sys
from dflash_prep.bench.tiny_engine import MASK_ID
from dflash_prep.tests.train.dflash_fixtures import dflash_cfg
from dflash_prep.tests.train.train_fakes import FakeSource
from dflash_prep.train.loop import train
out, target, prompts = sys.argv[1:4]
cfg = dflash_cfg(out, target, mask_token_id=MASK_ID, draft_layers=1, max_steps=4, eval_every=1, eval_prompts=prompts)
train(cfg, source=FakeSource(n=48, layout="varlen"))   # 4 steps, then it waits for the evaluation in flight
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM], ids=lambda s: s.name)
def test_a_trainer_evaluating_every_step_leaves_no_evaluation_and_no_server(built, engine_python, tmp_path, sig):
    """``--eval-every``: the trainer's background evaluation and the vLLM server that one started
    (two process groups, one under the other) are both gone when the trainer is killed."""
    log = tmp_path / "train.log"
    driver = _start([sys.executable, "-c", EVAL_DRIVER, str(tmp_path / "run"), str(built["target"]),
                     str(built["prompts"])], log, {"DFLASH_PREP_VLLM_PYTHON": str(engine_python)})
    evaluation = _child(driver.pid, "dflash_prep.train.engine_eval", log)
    server = _child(evaluation, "vllm.entrypoints.openai.api_server", tmp_path / "run" / "evals" / "step-0000001"
                    / "engine_eval.log")                                   # the evaluation is the server's driver
    port = int(re.search(r"--port (\d+)", _cmdline(server))[1])
    _wait(lambda: _healthy(port), driver, log, "the evaluation's server answered /health")
    outer = group_members(evaluation)
    got = _kill_and_check(driver, sig, server, f"--port {port}", port=port)
    assert not [p for p in outer if _live(p)] and not group_members(evaluation)
    print(f"trainer --eval-every {sig.name}: {got}")
