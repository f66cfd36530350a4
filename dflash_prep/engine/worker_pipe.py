"""The pipe to the engine-side states worker (:mod:`.states_worker`), shared by its two drivers:
``dflash-prep extract`` (:mod:`.extract`: shards of a states cache) and the trainer's online target
(:mod:`dflash_prep.train.engine_taps`: a micro-batch's states, no disk).

The worker is the engine's own (its backend's ``worker_module``, :mod:`.backends`; vLLM's is
:mod:`.states_worker`). It runs with the engine's python (:mod:`.env`), with this very
``dflash_prep`` first on its ``PYTHONPATH`` (:func:`engine_shim`) and nothing else of the main
venv. Commands go to its stdin, one JSON object a line; events come back on a pipe of their own
(:class:`LineReader`), one JSON object a line; the engine's own output goes to a log file. A worker
silent for longer than the timeout is asked for its stacks (:data:`.states_worker.STACK_SIGNAL`)
and the error names its log. The worker is started by :func:`.lifetime.spawn`: it and the engine's
processes die with the driver, however the driver ends.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from pathlib import Path

import dflash_prep
from dflash_prep.engine import backends
from dflash_prep.engine.lifetime import spawn
from dflash_prep.engine.states_worker import STACK_SIGNAL
from dflash_prep.errors import EngineError


def engine_shim(tmp: Path) -> str:
    """A folder holding only a link to this ``dflash_prep`` package: put first on the engine's
    ``PYTHONPATH``, the worker runs this very code (the same format writer), and nothing else of
    this venv leaks into the engine's."""
    link = tmp / "dflash_prep"
    link.symlink_to(Path(dflash_prep.__file__).resolve().parent, target_is_directory=True)
    return str(tmp)


class LineReader:
    """Lines from a pipe's file descriptor, each waited for with a timeout.

    ``select`` says whether the *descriptor* has bytes; a buffered file object's ``readline`` may
    already have pulled the next lines into its own buffer, after which ``select`` waits for bytes
    that were already read (two events written together, ``progress`` then ``shard``, hung the
    build that way). So the bytes are read here with ``os.read`` and split here, and ``select`` is
    asked only when no whole line is buffered."""

    def __init__(self, fd: int):
        self.fd, self.buf = fd, b""
        os.set_blocking(fd, False)

    def readline(self, timeout_s: float) -> str | None:
        """The next line (without its newline); ``""`` at the end of the pipe (the writer is gone);
        ``None`` when no whole line came within ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                return None
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                return ""
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def close(self) -> None:
        os.close(self.fd)


class Worker:
    """The engine-side worker process (the backend ``engine``'s ``worker_module``) and its two pipes:
    JSON commands on its stdin, JSON events back on a pipe of their own (the engine's output goes to
    ``log``)."""

    def __init__(self, py: Path, job: Path, log: Path, shim: str, timeout_s: float, env: dict | None = None, *,
                 engine: str):
        b = backends.get(engine)
        r, w = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([shim, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               **b.quiet_env, **(env or {})}
        for k, v in b.cpu_env.items():
            env.setdefault(k, v)
        self.log_path, self.timeout_s, self.label = log, timeout_s, b.label
        self.log = open(log, "ab")
        try:
            self.engine = spawn([str(py), "-m", b.worker_module, "--job", str(job),
                                 "--events-fd", str(w)], stdin=subprocess.PIPE, stdout=self.log,
                                stderr=subprocess.STDOUT, pass_fds=(w,), env=env)
        finally:
            os.close(w)
        self.proc = self.engine.proc
        self.events = LineReader(r)

    def send(self, cmd: dict) -> None:
        try:
            self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._died() from None

    def event(self, timeout_s: float | None = None) -> dict:
        line = self.events.readline(timeout_s or self.timeout_s)
        if line is None:
            where = "its stacks are at the end of" if self._dump_stacks() else "see"
            raise EngineError(f"the {self.label} worker sent nothing for {timeout_s or self.timeout_s:.0f} s; {where} "
                              f"{self.log_path} (raise --timeout if the engine is only slow)")
        if not line:
            raise self._died()
        ev = json.loads(line)
        if ev.get("event") == "error":
            raise EngineError(f"{self.label} worker: {ev['message']} (its log: {self.log_path})")
        return ev

    def _dump_stacks(self) -> bool:
        """Have a silent worker write every thread's stack to its log (:data:`.states_worker.STACK_SIGNAL`);
        True when it did (the log then ends with them), False when the worker is gone or wrote nothing."""
        size = self.log_path.stat().st_size if self.log_path.exists() else 0
        try:
            os.kill(self.proc.pid, STACK_SIGNAL)
        except ProcessLookupError:
            return False
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and self.log_path.stat().st_size == size:
            time.sleep(0.1)
        time.sleep(0.2)                                 # the rest of the dump
        return self.log_path.stat().st_size > size

    def _died(self) -> EngineError:
        try:
            rc = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            rc = None
        tail = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()][-1:] \
            if self.log_path.exists() else []
        return EngineError(f"the {self.label} worker stopped (exit {rc}): {tail[0].strip() if tail else 'no output'} "
                           f"(its log: {self.log_path})")

    def close(self, ok: bool) -> None:
        try:
            if ok:
                self.send({"stop": True})
                self.proc.wait(timeout=120)
        except (EngineError, subprocess.TimeoutExpired):
            pass
        finally:
            try:
                self.engine.stop(timeout_s=30)         # the worker's group: the engine's processes too
            finally:
                self._close_pipes()

    def _close_pipes(self) -> None:
        for f in (self.proc.stdin, self.events, self.log):
            try:
                f.close()
            except OSError:
                pass
