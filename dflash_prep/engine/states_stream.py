"""The target in vLLM, online: a micro-batch's hidden states computed when the trainer asks for
them, with nothing written to disk (``--target-engine vllm`` without ``--states``).

:class:`StatesStream` starts the same engine-side worker as ``dflash-prep extract``
(:mod:`.states_worker`, over :mod:`.worker_pipe`), with the same job (:func:`.extract.worker_job`:
the taps and final state the run reads, the dtype, the engine's arguments), and sends it one
``states`` command per micro-batch: the documents' token ids in, the encoded rows (and fp8 scales)
out, through a temp folder (the transport, below). The rows are those a states
cache of the same dtype stores (:func:`.states_worker.encode_samples`, the one path both take),
so the trainer decodes them as it decodes a cache's (:class:`dflash_prep.train.engine_taps.EngineTaps`).

It quacks like an opened cache where the trainer looks (``key``, ``slot_of``, ``final_slot``,
``folder``, ``command``), so the run's checks and messages are the cache's.

**Bit for bit.** A sample's states are a function of the sample *and of the engine call it rode
in*: vLLM's CPU kernels are not batch-invariant (the same sample batched with others differs in
the last bits of fp32, 2.7e-8 measured on the test target). With ``batch_tokens = 1`` (one sample a
call) here and in ``dflash-prep extract --batch-tokens 1``, each sample's states are a function of
the sample alone, and a run trained online equals one trained from that cache bit for bit
(tested). With batching, they agree to fp32 rounding before the dtype's own rounding.

**Transport.** One command holds in its temp folder, at its peak, the micro-batch's input (4 bytes a
token), vLLM's spool files of one engine call (``[n, k, H]``, float32 at most, for at most
``--engine-tokens`` tokens or the longest document) and the encoded output (the cache's bytes a
token): for 16,384 tokens of a 4096-wide target with five taps in bf16, 0.67 GB of output and up to
1.34 GB of spool, 2.0 GB in all (:func:`transport_bytes`). Before the engine starts,
:func:`scratch_folder` checks that, for the largest micro-batch of the run's manifests and times the
ranks on this host (``LOCAL_WORLD_SIZE``), against the free space (``os.statvfs``): ``/dev/shm`` when it
fits (memory, no disk), else TMPDIR, else the run's folder, with one printed line saying why; a
folder the user chose (``--engine-scratch``) is used as is, refused in one line when it is too
small. The temp folder is ``dflash-prep-states.PID.HOST.XXXXXXXX``: removed when the stream closes
(also on SIGTERM and SIGINT, :mod:`.lifetime`), and what a killed run left (its pid dead on this
host) is removed by the next stream's start and found by ``dflash-prep clean``
(:func:`stale_scratch`).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import weakref
from pathlib import Path

import numpy as np

from dflash_prep.engine import backends
from dflash_prep.engine.env import engine_python, engine_version
from dflash_prep.engine.extract import (ExtractConfig, check_vocab, engine_args, plan_cache, worker_job,
                                        write_input)
from dflash_prep.engine.worker_pipe import Worker, engine_shim
from dflash_prep.errors import ConfigError, EngineError
from dflash_prep.formats.outputs import pid_alive

START_TIMEOUT_S = 1800.0
"""Seconds the engine may take to start (load the target, profile, allocate its cache) before the
run stops with the worker's log."""


SHM = Path("/dev/shm")
SCRATCH_PREFIX = "dflash-prep-states."
_SCRATCH = re.compile(r"^dflash-prep-states\.(?P<pid>\d+)\.(?P<host>.+)\.[A-Za-z0-9_]{8}$")
NPZ_SLACK = 1 << 16
"""Bytes added per command for the ``.npz`` containers' headers and the file system's blocks."""


def transport_bytes(p: dict, tokens: int, longest: int, batch_tokens: int) -> int:
    """Peak bytes one ``states`` command keeps in the temp folder for a micro-batch of ``tokens``
    tokens whose longest document has ``longest`` (module docstring): input + one engine call's
    spool files + the encoded output. ``p``: :func:`.extract.plan_cache`'s plan."""
    call = min(tokens, max(int(batch_tokens), longest))        # one engine call: up to batch_tokens, or one document
    spool = call * len(p["vllm_ids"]) * int(p["hidden"]) * 4   # [n, k, H] float32 per request
    return 4 * tokens + spool + tokens * int(p["bytes_per_token"]) + NPZ_SLACK


def free_bytes(folder: Path) -> int:
    """Bytes an unprivileged writer may still use in ``folder``'s file system."""
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def scratch_folder(need: int | None, *, chosen: str | os.PathLike | None, fallbacks: list[Path],
                   shm: Path = SHM, free=free_bytes) -> tuple[Path, str | None]:
    """``(folder, note)``: where the commands' inputs and outputs go, and the one line to print when
    it is not ``shm`` for want of space (None otherwise). ``need``: bytes the run needs there at
    once (None: unknown, no check); ``chosen``: the user's folder (``--engine-scratch``), used as
    is unless it cannot hold ``need`` (:class:`ConfigError`); else ``shm`` when it is a writable
    folder with ``need`` free, else the first of ``fallbacks`` that has it (created if missing);
    none: :class:`ConfigError` with each one's free space. ``free(folder)`` gives the free bytes."""
    if chosen:
        folder = Path(chosen)
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise ConfigError(f"--engine-scratch {folder}: not a writable folder; create it, or drop the flag to let "
                              "the run choose")
        if need is not None and free(folder) < need:
            raise ConfigError(f"--engine-scratch {folder}: {_mib(free(folder))} free, the largest micro-batch needs "
                              f"{_mib(need)} there; choose a larger folder, or lower --engine-tokens or the plan's "
                              "token budget")
        return folder, None
    seen = []
    for i, folder in enumerate([shm, *fallbacks]):
        if i > 0:
            folder.mkdir(parents=True, exist_ok=True)
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            seen.append(f"{folder} is not a writable folder")
            continue
        got = free(folder)
        if need is None or got >= need:
            if i == 0:
                return folder, None
            why = seen[0] + ("" if need is None else f", the largest micro-batch needs {_mib(need)}")
            return folder, (f"online target: {why}; its states pass through {folder} instead (choose the folder "
                            "with --engine-scratch)")
        seen.append(f"{folder} has {_mib(got)} free")
    raise ConfigError(f"the online target's largest micro-batch needs {_mib(need)} of temp space, and "
                      f"{'; '.join(seen)}; free some, point --engine-scratch at a larger folder, or lower "
                      "--engine-tokens or the plan's token budget")


def stale_scratch(folders, *, depth: int = 1) -> list[Path]:
    """Temp folders of streams whose process is gone (``dflash-prep-states.PID.HOST.*`` with HOST this
    host and PID not alive) directly in ``folders``, or down to ``depth`` levels below them."""
    host, found = socket.gethostname(), []

    def walk(d: Path, level: int) -> None:
        try:
            entries = list(d.iterdir())
        except OSError:
            return
        for e in entries:
            m = _SCRATCH.match(e.name)
            if m:
                if m["host"] == host and not pid_alive(int(m["pid"])) and e.is_dir() and not e.is_symlink():
                    found.append(e)
            elif level < depth and e.is_dir() and not e.is_symlink():
                walk(e, level + 1)

    for f in folders:
        walk(Path(f), 1)
    return sorted(set(found))


def default_scratch_roots() -> list[Path]:
    """Where streams put their temp folders unless told: ``/dev/shm`` and TMPDIR."""
    return [SHM, Path(tempfile.gettempdir())]


class StatesStream:
    """One engine-side worker serving micro-batches' states (module docstring). Thread-safe: the
    trainer's prefetch thread and its step loop may both ask."""

    def __init__(self, cfg: ExtractConfig, *, identity: dict | None = None, log: Path, python: str | None = None,
                 timeout_s: float = 600.0, env: dict | None = None, scratch: str | os.PathLike | None = None,
                 largest: tuple[int, int] | None = None, copies: int = 1):
        """``scratch``: the user's temp folder (``--engine-scratch``), else chosen by
        :func:`scratch_folder` for ``copies`` streams on this host each sending the micro-batch
        ``largest = (tokens, longest document)`` (None: unknown, no check), falling back to TMPDIR,
        then ``cfg.out``."""
        self.p = plan_cache(cfg, identity)
        self.key, self.vocab = self.p["key"], self.p["vocab"]
        b = backends.get(cfg.engine)
        self.engine, self.label = b.name, b.label
        self.folder = f"the {b.label} target"
        self.command = f"--target-engine {b.name}"
        py = Path(python) if python else engine_python(cfg.engine)
        self.version = engine_version(cfg.engine, py)
        args = engine_args(cfg, self.version)
        self.timeout_s = float(timeout_s)
        need = None if largest is None else copies * transport_bytes(self.p, *largest, cfg.batch_tokens)
        folder, note = scratch_folder(need, chosen=scratch, fallbacks=[Path(tempfile.gettempdir()), Path(cfg.out)])
        for old in stale_scratch({*default_scratch_roots(), folder, Path(cfg.out)}):   # what killed runs left
            shutil.rmtree(old, ignore_errors=True)
        if note:
            print(note, flush=True)
        self.transport = {"folder": str(folder), "need_bytes": need}
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}.{socket.gethostname()}.", dir=folder))
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.tmp, True)
        (self.tmp / "job.json").write_text(json.dumps(worker_job(cfg, self.p, args, self.tmp / "spool", cache=None)))
        self.lock = threading.Lock()
        self.calls, self.tokens, self.engine_s = 0, 0, 0.0
        t0 = time.monotonic()
        self.worker = Worker(py, self.tmp / "job.json", Path(log), engine_shim(self.tmp), self.timeout_s, env,
                             engine=cfg.engine)
        self.worker.engine.on_stop(functools.partial(shutil.rmtree, self.tmp, True))   # also when a signal stops it
        self._stop = weakref.finalize(self, self.worker.close, False)      # however the run ends
        try:
            ev = self.worker.event(max(START_TIMEOUT_S, self.timeout_s))
        except EngineError:
            self.close(ok=False)
            raise
        if ev.get("event") != "ready":
            self.close(ok=False)
            raise EngineError(f"the vLLM worker said {ev} before it was ready (its log: {log})")
        self.start_s = time.monotonic() - t0

    def slot_of(self, tap: int) -> int:
        return self.key.slot_of(tap, self.folder)

    @property
    def final_slot(self) -> int:
        return self.key.final_slot(self.folder)

    def states(self, docs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
        """``rows (T, S, H)`` in the storage dtype and fp8 ``scales (T, S)`` (else None) of the
        documents (token-id arrays), concatenated in their order."""
        lens = np.array([len(d) for d in docs], np.int64)
        ids = np.concatenate(docs) if docs else np.zeros(0, np.int32)
        check_vocab(ids, self.vocab, "the micro-batch's documents")
        with self.lock:
            t0 = time.perf_counter()
            n = self.calls
            out = self.tmp / f"out-{n}.npz"
            self.worker.send({"states": n, "input": write_input(self.tmp, str(n), ids, lens), "output": str(out)})
            ev = self.worker.event()
            if ev.get("event") != "states" or int(ev.get("states", -1)) != n:
                raise EngineError(f"the vLLM worker answered {ev} to states command {n}")
            with np.load(out, allow_pickle=False) as z:
                rows, scales = z["rows"], (z["scales"] if "scales" in z.files else None)
            out.unlink()
            self.calls, self.tokens = n + 1, self.tokens + int(lens.sum())
            self.engine_s += time.perf_counter() - t0
        if rows.shape[:2] != (int(lens.sum()), self.key.slots):
            raise EngineError(f"the {self.label} worker sent states of shape {rows.shape} for {int(lens.sum())} "
                              f"tokens and {self.key.slots} slots")
        return rows, scales

    def summary(self) -> dict:
        return {"engine": self.engine, "version": self.version, "start_s": round(self.start_s, 1), "calls": self.calls,
                "tokens": self.tokens, "engine_s": round(self.engine_s, 3), "transport": self.transport}

    def close(self, ok: bool = True) -> None:
        """Stop the worker and remove the temp folder; safe to call twice. With ``ok`` the worker is
        asked to stop once the call in flight (the prefetch thread's, at a run's end) is answered,
        waiting 10 s at most; otherwise, or past that, its process group is killed."""
        self._stop.detach()
        idle = self.lock.acquire(timeout=10) if ok else False
        try:
            self.worker.close(ok and idle)
        finally:
            if idle:
                self.lock.release()
        self._cleanup()
