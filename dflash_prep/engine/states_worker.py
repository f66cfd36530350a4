"""The engine side of ``dflash-prep extract`` and of the trainer's online target: vLLM's offline
``LLM`` over token-id prompts, each sample's hidden states quantized as the states cache stores
them, written into a cache shard or handed to the trainer.

Run with the engine's python (:func:`dflash_prep.engine.env.engine_python`) by
:mod:`dflash_prep.engine.worker_pipe`, never by hand, through :func:`dflash_prep.engine.lifetime.spawn`:
it dies with the driver however the driver ends (a parent-death signal and a watchdog), so a killed
build's worker never goes on with the commands already in its stdin, writing shards behind the back
of the build that resumes it::

    python -m dflash_prep.engine.states_worker --job JOB.json --events-fd N

``JOB.json`` (written by the driver): the target, the vLLM layer ids to capture, how each slot of
the cache is made of them, the dtype, the engine's arguments, the spool folder. Then, one JSON
command a line on stdin (each input an ``.npz`` of ``ids``, int32, the samples' tokens concatenated,
and ``lens``):

- ``{"shard": k, "samples": [a, b], "input": NPZ}`` (``extract``): shard k written into the cache;
- ``{"states": n, "input": NPZ, "output": NPZ}`` (the trainer's ``--target-engine vllm`` without a
  cache, :mod:`dflash_prep.train.engine_taps`): the same encoded rows (and fp8 scales) written to
  ``output``;
- ``{"stop": true}``; stdin's end without a stop means the driver is gone, and the worker exits.

Events go to file descriptor N, one JSON object a line (vLLM logs on stdout and stderr, which the
driver sends to a log file): ``ready``, ``progress`` (tokens done), ``shard`` (its table entry,
once the file is in place), ``states`` (the output in place) and ``error`` (one line, then exit 1).
On ``SIGUSR1`` (:data:`STACK_SIGNAL`) every thread's stack is written to the log: the driver sends
it before giving up on a silent worker.

Per command: the samples go to ``LLM.generate`` in batches of at most ``batch_tokens`` tokens, with
``max_tokens = 1`` (only the prefill matters; the one sampled token is thrown away) and
``kv_transfer_params = {"states_key": NAME}``, which :mod:`.states_connector` names the states
file after. Each file is ``[n, k, H]`` in vLLM's layer-id order; a cache slot is one of them
(tap ``l`` is vLLM id ``l + 1``), the final slot vLLM id ``L`` through the target's final RMSNorm
(``weight * x / sqrt(mean(x^2) + eps)``, in float32, with ``model.norm.weight`` and
``rms_norm_eps``: vLLM captures the residual stream before that norm). Then
:func:`dflash_prep.formats.states.encode_torch` (:func:`encode_samples`, the one path both
commands take) and, for a shard, :func:`~dflash_prep.formats.states.write_shard`.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from dflash_prep.formats.states import STORAGE, StatesKey, encode_torch, shard_name, write_shard


def _emit(events, **kw) -> None:
    events.write(json.dumps(kw) + "\n")
    events.flush()


def final_norm_weight(target: Path):
    """``model.norm.weight`` of the target's safetensors (float32 tensor)."""
    from safetensors import safe_open

    key = "model.norm.weight"
    index = target / "model.safetensors.index.json"
    files = ([target / json.loads(index.read_text())["weight_map"][key]] if index.is_file()
             else [target / "model.safetensors"])
    for f in files:
        with safe_open(str(f), "pt") as fh:
            if key in fh.keys():
                return fh.get_tensor(key).float()
    raise ValueError(f"{target}: no {key} in its safetensors; the final hidden state needs a Llama-style final "
                     "RMSNorm (Qwen3, Llama, Mistral)")


STACK_SIGNAL = signal.SIGUSR1
"""Sent by the driver when the worker has been silent for ``--timeout`` seconds: every thread's
Python stack goes to stderr (``extract.log``) before the worker is stopped."""

IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
"""vLLM's engine core in this process (its executor's workers, with tensor or pipeline parallelism,
are still processes of their own, which stop when this one dies): a killed build then leaves no
engine process behind (an engine core in a process of its own outlived a SIGKILLed parent on the
CPU build), and nothing steps the engine but this code."""


class Engine:
    """vLLM's ``LLM`` set up to capture ``job["vllm_ids"]`` through :class:`.states_connector.StatesConnector`."""

    def __init__(self, job: dict):
        from vllm import LLM

        from dflash_prep.engine.states_connector import PARAM_KEY, SPOOL_KEY

        self.job, self.param_key = job, PARAM_KEY
        self.spool = Path(job["spool"])
        self.spool.mkdir(parents=True, exist_ok=True)
        args = dict(job["engine_args"])
        self.llm = LLM(
            model=job["target"], skip_tokenizer_init=True, enable_prefix_caching=False,
            max_model_len=int(job["max_model_len"]),
            speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                "draft_model_config": {"hf_config": {
                                    "eagle_aux_hidden_state_layer_ids": list(job["vllm_ids"])}}},
            kv_transfer_config={"kv_connector": "StatesConnector",
                                "kv_connector_module_path": "dflash_prep.engine.states_connector",
                                "kv_role": "kv_producer", "kv_connector_extra_config": {SPOOL_KEY: str(self.spool)}},
            **args)
        self.norm = None
        if job["final"] is not None:
            self.norm = final_norm_weight(Path(job["target"]))

    def states(self, keys: list[str], prompts: list[np.ndarray], timeout_s: float):
        """Yield ``float32 tensor [n, k, H]`` in vLLM's layer-id order, for each prompt, in order;
        ``keys`` name the requests' states files (unique among the requests in flight)."""
        import torch
        from vllm import SamplingParams

        sps = [SamplingParams(max_tokens=1, temperature=0.0, extra_args={"kv_transfer_params": {self.param_key: k}})
               for k in keys]
        outs = self.llm.generate([{"prompt_token_ids": p.tolist()} for p in prompts], sps, use_tqdm=False)
        if len(outs) != len(keys):
            raise RuntimeError(f"vLLM returned {len(outs)} outputs for {len(keys)} prompts")
        for k, p in zip(keys, prompts):
            f = self._await(k, timeout_s)
            a = np.load(f, allow_pickle=False)
            t = torch.from_numpy(a).view(torch.bfloat16) if f.name.endswith(".bf16.npy") else torch.from_numpy(a)
            if tuple(t.shape[:2]) != (len(p), len(self.job["vllm_ids"])):
                raise RuntimeError(f"request {k}: vLLM's states have shape {tuple(t.shape)}, expected "
                                   f"({len(p)}, {len(self.job['vllm_ids'])}, H)")
            yield t.float()
            os.unlink(f)

    def _await(self, key: str, timeout_s: float) -> Path:
        """The states file of request ``key``. The connector writes it one engine step after the
        request finished (the step that hands it the request's blocks), and ``generate`` returns
        before that step: the engine runs in this process (:data:`IN_PROCESS`), so step it here."""
        names = [self.spool / f"{key}.npy", self.spool / f"{key}.bf16.npy"]
        deadline = time.monotonic() + timeout_s
        while True:
            for f in names:
                if f.exists():
                    return f
            if time.monotonic() > deadline:
                raise RuntimeError(f"request {key}: vLLM finished it but no states file came within "
                                   f"{timeout_s:.0f} s (is the extract_hidden_states connector loaded?)")
            self.llm.llm_engine.step()

    def slots(self, t):
        """``[n, S, H]`` float32: the cache's slots of vLLM's ``[n, k, H]`` (module docstring)."""
        import torch

        job = self.job
        idx = {v: i for i, v in enumerate(job["vllm_ids"])}
        cols = [t[:, idx[v]] for v in job["tap_vllm_ids"]]
        if job["final"] is not None:
            x = t[:, idx[job["final"]["vllm_id"]]]
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + float(job["final"]["eps"]))
            cols.append(self.norm * x)
        return torch.stack(cols, dim=1)


def _key(job: dict) -> StatesKey:
    return StatesKey(**{**job["key"], "taps": tuple(job["key"]["taps"])})


def _load_input(path: str) -> tuple[np.ndarray, np.ndarray]:
    """The token ids (concatenated) and the row offsets of a command's samples."""
    with np.load(path, allow_pickle=False) as d:
        ids, lens = np.asarray(d["ids"]), np.asarray(d["lens"], np.int64)
    off = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=off[1:])
    if int(off[-1]) != len(ids):
        raise RuntimeError(f"{path}: {len(ids)} token ids for lengths summing to {int(off[-1])}")
    return ids, off


def encode_samples(engine: Engine, names: list[str], ids: np.ndarray, off: np.ndarray, key: StatesKey, on_batch=None):
    """``rows (T, S, H)`` in the storage dtype and the fp8 ``scales (T, S)`` (None otherwise) of the
    samples ``ids[off[i]:off[i + 1]]``: the engine's states, the cache's slots, encoded. The samples
    go to the engine in calls of at most ``batch_tokens`` tokens (a sample longer than that alone;
    ``batch_tokens = 1``: one sample a call, its states a function of the sample alone, since vLLM's
    CPU kernels are not batch-invariant); ``names[i]`` names sample i's request."""
    n, T = len(off) - 1, int(off[-1])
    job = engine.job
    rows = np.empty((T, key.slots, key.hidden), STORAGE[key.dtype])          # (T, S, H)
    scales = np.empty((T, key.slots), np.float32) if key.dtype == "fp8" else None
    i = 0
    while i < n:                                                              # batches of <= batch_tokens
        j = i + 1
        while j < n and off[j + 1] - off[i] <= int(job["batch_tokens"]):
            j += 1
        got = engine.states(names[i:j], [ids[off[x]:off[x + 1]] for x in range(i, j)], float(job["timeout_s"]))
        for x, t in zip(range(i, j), got):
            r, sc = encode_torch(engine.slots(t), key.dtype)
            rows[off[x]:off[x + 1]] = r
            if scales is not None:
                scales[off[x]:off[x + 1]] = sc
        if on_batch is not None:
            on_batch(int(off[j] - off[i]))
        i = j
    return rows, scales


def run_shard(engine: Engine, cmd: dict, events) -> None:
    """``{"shard": k, "samples": [a, b], "input": NPZ}``: shard k of the cache, written in place."""
    job, key = engine.job, _key(engine.job)
    k, (a, b) = int(cmd["shard"]), cmd["samples"]
    ids, off = _load_input(cmd["input"])
    if len(off) - 1 != b - a:
        raise RuntimeError(f"shard {k}: {len(off) - 1} lengths for samples [{a}, {b})")
    rows, scales = encode_samples(engine, [f"s{s}" for s in range(a, b)], ids, off, key,
                                  lambda tokens: _emit(events, event="progress", shard=k, tokens=tokens))
    entry = write_shard(Path(job["cache"]) / shard_name(k), cache_fingerprint=job["fingerprint"], index=k,
                        samples=(a, b), key=key, rows=rows, scales=scales, offsets=off)
    os.unlink(cmd["input"])
    _emit(events, event="shard", shard=k, entry=entry)


def run_states(engine: Engine, cmd: dict, events) -> None:
    """``{"states": n, "input": NPZ, "output": NPZ}``: the encoded states of the input's samples
    (``rows``, and ``scales`` for fp8) written to ``output`` (a temp name renamed into place), for
    the trainer's online target (:mod:`dflash_prep.train.engine_taps`)."""
    n = int(cmd["states"])
    ids, off = _load_input(cmd["input"])
    rows, scales = encode_samples(engine, [f"q{n}-{x}" for x in range(len(off) - 1)], ids, off, _key(engine.job))
    tmp = f"{cmd['output']}.tmp"
    with open(tmp, "wb") as f:
        np.savez(f, rows=rows, **({} if scales is None else {"scales": scales}))
    os.replace(tmp, cmd["output"])
    os.unlink(cmd["input"])
    _emit(events, event="states", states=n, output=cmd["output"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_prep.engine.states_worker", description=__doc__.split("\n")[0])
    ap.add_argument("--job", required=True, help="the job file dflash-prep extract wrote")
    ap.add_argument("--events-fd", type=int, required=True, help="file descriptor the events go to")
    a = ap.parse_args(argv)
    faulthandler.register(STACK_SIGNAL, all_threads=True)   # the driver's "sent nothing" timeout: where it hung
    events = os.fdopen(a.events_fd, "w", buffering=1)
    os.environ.update(IN_PROCESS)                  # before vLLM is imported
    try:
        job = json.loads(Path(a.job).read_text())
        engine = Engine(job)
        import vllm

        _emit(events, event="ready", vllm=getattr(vllm, "__version__", "?"))
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd.get("stop"):
                _emit(events, event="stopped")
                return 0
            (run_states if "states" in cmd else run_shard)(engine, cmd, events)
        return 2                                   # the driver is gone: nothing to report to
    except Exception as e:  # noqa: BLE001 - any engine failure becomes the driver's one-line error
        msg = " ".join(f"{type(e).__name__}: {e}".split())
        try:
            _emit(events, event="error", message=msg)
        except OSError:
            pass
        print(f"states_worker: {msg}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":   # vLLM starts its engine in subprocesses: never at import
    sys.exit(main())
