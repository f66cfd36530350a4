"""Fault injection, issue 29 (the trainer side): a drafter's sliding window against the one its
manifests were packed for.

Every spawned job is bounded (``split_fixtures.supervise``), every rank runs one thread.
"""

from __future__ import annotations

import pytest

from dflash_prep.errors import ConfigError
from dflash_prep.objectives.dflash import drafter_options
from dflash_prep.pack.pack import PackConfig, pack_epochs
from tests.train.split_fixtures import BLOCK, MAX_ANCHORS, build_pipeline
from tests.train.trainer_split_fixtures import base_cfg


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
