"""Fault injection, issue 29 (the trainer side): a drafter's sliding window and depth against the
ones its manifests were packed for; a split job refused at set-up, and the drafters left when a drafter
rank dies, each rank ending with one line (real gloo jobs of ``train()``); the launcher's crash
line naming the dead rank's role and the command that resumes.

Every spawned job is bounded (``split_fixtures.supervise``), every rank runs one thread.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_prep.errors import ConfigError
from dflash_prep.objectives.dflash import drafter_options
from dflash_prep.pack.pack import PackConfig, pack_epochs
from dflash_prep.tests.train.split_fixtures import BLOCK, MAX_ANCHORS, build_pipeline
from dflash_prep.tests.train.trainer_split_fixtures import base_cfg, run_job

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """The split-job pipeline: manifests packed for W = 2 drafter ranks, A = 2, window 0."""
    return build_pipeline(tmp_path_factory.mktemp("faults-split") / "pipe")


def _pack_w1(paths: dict, out, **flags) -> dict:
    opts = drafter_options(target_config=paths["target"], draft_layers=1, block_size=BLOCK, max_anchors=MAX_ANCHORS,
                           **flags)
    pack_epochs(plan=paths["plan"], epochs=[0, 1], out=out, data=paths["data"],
                config=PackConfig(objective="dflash", options=opts, world_size=1, grad_accum=2))
    return {**paths, "manifests": str(out)}


@pytest.mark.parametrize("flag, train_kw, theirs", [
    ("--sliding-window 8", dict(sliding_window=8), "window 0"),
    ("--draft-layers 2", dict(draft_layers=2), "1 draft layer(s)"),
])
def test_a_drafter_shape_other_than_the_manifests_is_refused_with_the_pack_flag(paths, tmp_path, flag, train_kw, theirs):
    """Manifests packed for a 1-layer, full-attention drafter; a run with another window or depth
    is refused before anything is written, in one line that names the pack command with its flag."""
    from dflash_prep.train.config import build as build_config
    from dflash_prep.train.loop import train

    w1 = _pack_w1(paths, tmp_path / "man-w0", sliding_window=0)
    with pytest.raises(ConfigError) as ei:
        train(build_config(**base_cfg(w1, tmp_path / "run", max_steps=1, **train_kw)))
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(f"{flag} contradicts") and theirs in msg, msg
    assert "pack" in msg and flag in msg.split("pack", 1)[1], msg
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


@pytest.mark.jobs
def test_a_split_job_refused_at_set_up_ends_every_rank_with_one_line(paths, tmp_path):
    """1 target + 1 drafter rank on manifests packed for 2 drafter ranks: the drafter refuses in
    its set-up while the target rank waits for its cursor; the target rank stops with one line
    that names the drafter rank (before: gloo's 60-line "Connection closed by peer")."""
    job = run_job(tmp_path / "job", base_cfg(paths, tmp_path / "run", target_ranks=1), 2, deadline=90.0)
    assert job["exit"] == [1, 1], job
    drafter, target = job[1], job[0]
    assert drafter["error_type"] == "ConfigError" and "packed for world size 2" in drafter["error"], drafter
    assert target["error_type"] == "PeerRefused", target.get("trace")
    line = target["error"]
    assert line.startswith("target rank 0: drafter rank 0 (global rank 1) refused the job at set-up"), line
    assert "packed for world size 2" in line and abs(target["t_end"] - drafter["t_end"]) < 10.0


@pytest.mark.jobs
def test_the_drafters_left_when_a_drafter_rank_dies_stop_with_one_line(paths, tmp_path):
    """SIGKILL of drafter rank 1 (global rank 2) after step 1: drafter rank 0 stops with one line
    (its drafter-group collective, or its target rank's link, whichever breaks first), never the
    backend's multi-line error."""
    # the default link timeout (20 s): long enough that no healthy step of a loaded CI machine times out before the kill (at 8 s
    # every rank once left with a link timeout before step 1, so the kill never came)
    cfg = base_cfg(paths, tmp_path / "run", target_ranks=1)
    job = run_job(tmp_path / "job", cfg, 3, kill=(2, 1), deadline=120.0)
    assert job["killed_at"] is not None, {r: (job.get(r, {}).get("error_type"), job.get(r, {}).get("error")) for r in range(3)}
    assert job["exit"][2] == -9, job["exit"]
    d0 = job[1]
    assert job["exit"][1] == 1 and "\n" not in d0["error"], d0
    assert d0["error_type"] in ("CollectiveBroke", "LinkError"), d0.get("trace")
    assert "drafter rank 1 (global rank 2)" in d0["error"] or "target rank 0" in d0["error"], d0["error"]


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (Linux /proc)."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _worker_of(launcher: int, rank: int) -> int | None:
    """The pid of the launcher's worker with ``RANK=rank`` in its environment."""
    for c in _children(launcher):
        try:
            env = (Path("/proc") / str(c) / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"TORCHELASTIC_RUN_ID" in b" ".join(env):
            return c
    return None


@pytest.mark.jobs
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the worker through /proc")
def test_the_launchers_crash_line_names_the_role_and_the_resume_command(paths, tmp_path):
    """The real launcher (torchrun in-process) over a 1 target + 2 drafter job; SIGKILL of the
    target rank's worker once global step 2 is logged (a checkpoint every step)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "dflash_prep.train.launch", "--standalone", "--nproc_per_node", "3",
           "-m", "dflash_prep.train", "--objective", "dflash", "--target", paths["target"], "--data", paths["data"],
           "--plan", paths["plan"], "--manifests", paths["manifests"], "--out", str(out), "--device", "cpu",
           "--no-progress", "--draft-layers", "1", "--slot-weights", "decay", "--optimizer", "adamw",
           "--sliding-window", "0", "--attn", "reference", "--no-bf16", "--ce-chunk", "16", "--target-layer-ids", "1",
           "--target-layer-ids", "2", "--no-pack-missing", "--target-ranks", "1", "--ckpt-every", "1",
           "--target-timeout", "20", "--from-scratch"]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", NUMBA_CACHE_DIR=str(REPO / ".numba_cache"))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log, victim, deadline = out / "log.jsonl", None, time.monotonic() + 150
    try:
        while proc.poll() is None and time.monotonic() < deadline and victim is None:
            steps = [json.loads(x).get("global_step") for x in log.read_text().splitlines()[1:] if x.strip()] \
                if log.exists() else []
            if 2 in steps:
                victim = _worker_of(proc.pid, 0)
                if victim is not None:
                    os.kill(victim, signal.SIGKILL)
            time.sleep(0.05)
        _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert victim is not None, "the run ended before the kill"
    line = [x for x in err.splitlines() if x.startswith("error: ") and "failed with" in x]
    assert proc.returncode == 1 and len(line) == 1, err[-3000:]
    line = line[0]
    assert line.startswith("error: target rank 0 failed with signal 9 (its output is above)"), line
    assert "; resume from global step " in line and str(out / "checkpoint.pt") in line, line
    again = line.split(" with: ", 1)[1]
    assert again.startswith("python -m dflash_prep.train.launch --standalone") and "--from-scratch" not in again
    assert "--target-ranks 1" in again, again
