"""A stand-in serving engine for the tests of ``extract``'s driver (shares across nodes, locks,
headers, resume) without vLLM: :data:`FAKE` is a backend record whose offline worker is this
module, speaking :mod:`dflash_prep.engine.states_worker`'s protocol, with states that are a fixed
function of each token's id and position (so two builds of the same data give the same bits).
The real engine's states are tested in test_extract.py and test_extract_nodes.py.

- ``python -m dflash_prep.tests.engine.fake_states_worker --job JOB --events-fd N``: the worker
  (started by :class:`dflash_prep.engine.worker_pipe.Worker`); ``$FAKE_STATES_DELAY`` seconds of
  sleep per shard, so a test can catch a build in flight;
- ``python -m dflash_prep.tests.engine.fake_states_worker --extract CONFIG_JSON``: one ``extract``
  process with this engine registered (the ``ExtractConfig`` fields as JSON); prints its summary
  as JSON on the last line of stdout, or the error's one line on stderr and exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from dflash_prep.engine.backends.vllm import VLLM
from dflash_prep.formats.states import StatesKey, shard_name, write_shard

FAKE = dataclasses.replace(
    VLLM, name="fake", label="Fake engine", python_var="DFLASH_PREP_FAKE_PYTHON", venv_dir=".venv-fake",
    make_target="venv-fake", distributions=("numpy",), worker_module="dflash_prep.tests.engine.fake_states_worker",
    quiet_env={}, cpu_env={}, offline_args=lambda version: {}, reserved_args=frozenset())


def fake_rows(ids: np.ndarray, off: np.ndarray, key: StatesKey) -> np.ndarray:
    """``(T, S, H)`` float32: slot s, element h of a token of id i at position p of its sample is
    ``sin(0.37 i + 1.3 s + 0.11 h) + p / 1000``."""
    pos = np.concatenate([np.arange(off[j + 1] - off[j]) for j in range(len(off) - 1)]) if len(ids) else ids
    s = np.arange(key.slots)[None, :, None]
    h = np.arange(key.hidden)[None, None, :]
    x = np.sin(0.37 * ids[:, None, None] + 1.3 * s + 0.11 * h) + pos[:, None, None] / 1000.0
    return x.astype(np.float32)


def _worker(job_path: str, fd: int) -> int:
    events = os.fdopen(fd, "w", buffering=1)

    def emit(**kw):
        events.write(json.dumps(kw) + "\n")

    job = json.loads(Path(job_path).read_text())
    key = StatesKey(**{**job["key"], "taps": tuple(job["key"]["taps"])})
    if key.dtype != "fp32":
        emit(event="error", message="the fake engine writes fp32 states only")
        return 1
    emit(event="ready", vllm="fake")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("stop"):
            emit(event="stopped")
            return 0
        k, (a, b) = int(cmd["shard"]), cmd["samples"]
        with np.load(cmd["input"], allow_pickle=False) as d:
            ids, lens = np.asarray(d["ids"], np.int64), np.asarray(d["lens"], np.int64)
        off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        time.sleep(float(os.environ.get("FAKE_STATES_DELAY", "0")))
        entry = write_shard(Path(job["cache"]) / shard_name(k), cache_fingerprint=job["fingerprint"], index=k,
                            samples=(a, b), key=key, rows=fake_rows(ids, off, key), scales=None, offsets=off)
        os.unlink(cmd["input"])
        emit(event="progress", shard=k, tokens=int(off[-1]))
        emit(event="shard", shard=k, entry=entry)
    return 2


def _extract(config: str) -> int:
    from dflash_prep.engine.backends import base
    from dflash_prep.engine.extract import ExtractConfig, extract
    from dflash_prep.errors import DflashError

    base.REGISTRY.entries[FAKE.name] = FAKE
    kw = json.loads(config)
    kw = {**kw, "data": Path(kw["data"]), "target": Path(kw["target"]), "out": Path(kw["out"]), "engine": FAKE.name,
          "python": sys.executable}
    try:
        s = extract(ExtractConfig(**kw), progress=False)
    except DflashError as e:
        print(str(e), file=sys.stderr)
        return 1
    print(json.dumps(s))
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--job")
    ap.add_argument("--events-fd", type=int)
    ap.add_argument("--extract")
    a = ap.parse_args()
    sys.exit(_extract(a.extract) if a.extract else _worker(a.job, a.events_fd))
