"""Fault injection, issue 29 (the trainer side): a drafter's sliding window against the one its
manifests were packed for; a split job refused at set-up, and the drafters left when a drafter
rank dies, each rank ending with one line (real gloo jobs of ``train()``).

Every spawned job is bounded (``split_fixtures.supervise``), every rank runs one thread.
"""

from __future__ import annotations

import pytest

from dflash_prep.errors import ConfigError
from dflash_prep.objectives.dflash import drafter_options
from dflash_prep.pack.pack import PackConfig, pack_epochs
from tests.train.split_fixtures import BLOCK, MAX_ANCHORS, build_pipeline
from tests.train.trainer_split_fixtures import base_cfg, run_job


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


def test_a_drafter_window_other_than_the_manifests_is_refused_with_the_pack_flag(paths, tmp_path):
    from dflash_prep.train.config import TrainConfig
    from dflash_prep.train.loop import train

    w1 = _pack_w1(paths, tmp_path / "man-w0", sliding_window=0)
    with pytest.raises(ConfigError) as ei:
        train(TrainConfig(**base_cfg(w1, tmp_path / "run", sliding_window=8, max_steps=1)))
    msg = str(ei.value)
    assert "\n" not in msg and "--sliding-window 8" in msg and "window 0" in msg, msg
    assert "pack" in msg and "--sliding-window 8" in msg.split("pack", 1)[1], msg
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


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


def test_the_drafters_left_when_a_drafter_rank_dies_stop_with_one_line(paths, tmp_path):
    """SIGKILL of drafter rank 1 (global rank 2) after step 1: drafter rank 0 stops with one line
    (its drafter-group collective, or its target rank's link, whichever breaks first), never the
    backend's multi-line error."""
    cfg = base_cfg(paths, tmp_path / "run", target_ranks=1, target_timeout=8.0)
    job = run_job(tmp_path / "job", cfg, 3, kill=(2, 1), deadline=90.0)
    assert job["killed_at"] is not None and job["exit"][2] == -9, job["exit"]
    d0 = job[1]
    assert job["exit"][1] == 1 and "\n" not in d0["error"], d0
    assert d0["error_type"] in ("CollectiveBroke", "LinkError"), d0.get("trace")
    assert "drafter rank 1 (global rank 2)" in d0["error"] or "target rank 0" in d0["error"], d0["error"]
