"""The target in vLLM, online: a micro-batch's hidden states computed when the trainer asks for
them, with nothing written to disk (``--target-engine vllm`` without ``--states``).

:class:`StatesStream` starts the same engine-side worker as ``dflash-prep extract``
(:mod:`.states_worker`, over :mod:`.worker_pipe`), with the same job (:func:`.extract.worker_job`:
the taps and final state the run reads, the dtype, the engine's arguments), and sends it one
``states`` command per micro-batch: the documents' token ids in, the encoded rows (and fp8 scales)
out, through a temp folder in memory (``/dev/shm`` where there is one). The rows are those a states
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
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
import weakref
from pathlib import Path

import numpy as np

from dflash_prep.engine.env import vllm_python, vllm_version
from dflash_prep.engine.extract import (ExtractConfig, check_vocab, engine_args, plan_cache, worker_job,
                                        write_input)
from dflash_prep.engine.worker_pipe import Worker, engine_shim
from dflash_prep.errors import EngineError

START_TIMEOUT_S = 1800.0
"""Seconds the engine may take to start (load the target, profile, allocate its cache) before the
run stops with the worker's log."""


def _scratch() -> str | None:
    """A folder in memory for the commands' inputs and outputs, else the system's temp folder."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


class StatesStream:
    """One engine-side worker serving micro-batches' states (module docstring). Thread-safe: the
    trainer's prefetch thread and its step loop may both ask."""

    def __init__(self, cfg: ExtractConfig, *, identity: dict | None = None, log: Path, python: str | None = None,
                 timeout_s: float = 600.0, env: dict | None = None):
        self.p = plan_cache(cfg, identity)
        self.key, self.vocab = self.p["key"], self.p["vocab"]
        self.folder = "the vLLM target"
        self.command = "--target-engine vllm"
        py = Path(python) if python else vllm_python()
        self.version = vllm_version(py)
        args = engine_args(cfg, self.version)
        self.timeout_s = float(timeout_s)
        self.tmp = Path(tempfile.mkdtemp(prefix=f"dflash-prep-states.{os.getpid()}.", dir=_scratch()))
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.tmp, True)
        (self.tmp / "job.json").write_text(json.dumps(worker_job(cfg, self.p, args, self.tmp / "spool", cache=None)))
        self.lock = threading.Lock()
        self.calls, self.tokens, self.engine_s = 0, 0, 0.0
        t0 = time.monotonic()
        self.worker = Worker(py, self.tmp / "job.json", Path(log), engine_shim(self.tmp), self.timeout_s, env)
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
            raise EngineError(f"the vLLM worker sent states of shape {rows.shape} for {int(lens.sum())} tokens and "
                              f"{self.key.slots} slots")
        return rows, scales

    def summary(self) -> dict:
        return {"engine": "vllm", "version": self.version, "start_s": round(self.start_s, 1), "calls": self.calls,
                "tokens": self.tokens, "engine_s": round(self.engine_s, 3)}

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
