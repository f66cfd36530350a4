"""Resume under a new world size (--rescale): 3 steps at W = 2 (gloo), the rest of the epoch at W = 1."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash_prep.errors import ConfigError
from dflash_prep.formats import lengths as lengths_mod
from dflash_prep.formats import manifest
from dflash_prep.formats import plan as plan_mod
from dflash_prep.pack.pack import pack_epochs
from dflash_prep.synth.synth import SynthConfig, synth
from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize
from dflash_prep.train import checkpoint as ckpt
from dflash_prep.train.config import build as build_config
from dflash_prep.train.data import build_batch
from dflash_prep.train.loop import train

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
SMALL = dict(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64)


def _cfg(root, **kw):
    return build_config(data=str(root / "data"), plan=str(root / "plan" / "plan.json"), manifests=str(root / "man"),
                       out=str(root / "run"), model_overrides=SMALL, progress=False, device="cpu", prefetch=2,
                       warmup_steps=1, **kw)


def _worker(rank: int, world: int, root: str) -> None:
    from pathlib import Path

    import torch

    from dflash_prep.train.distributed import Dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/init", rank=rank, world_size=world)
    try:
        train(_cfg(Path(root), max_steps=3), dist_ctx=Dist(rank, world, 0, torch.device("cpu")))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_parts(tmp_path_factory):
    root = tmp_path_factory.mktemp("rescale")
    synth(SynthConfig(out=root / "corpus", n=60, seed=0))
    tokenize(TokenizeConfig(inputs=(str(root / "corpus" / "chat.jsonl"),), out=root / "data", tokenizer="byte",
                            max_len=128))
    src = lengths_mod.load(data=root / "data")
    plan_mod.save(plan_mod.Plan(data=src.describe(), boundaries=(64,), budget=plan_mod.Budget(value=384), seed=0),
                  root / "plan")
    pack_epochs(plan=root / "plan" / "plan.json", epochs=[0], out=root / "man", data=root / "data", world_size=2)
    parent = manifest.open(manifest.epoch_dir(root / "man", 0))
    assert parent.num_steps > 4, "the test needs an epoch longer than 3 steps at W = 2"
    mp.spawn(_worker, args=(2, str(root)), nprocs=2, join=True)
    return root, parent


def test_world_size_change_needs_rescale(two_parts):
    root, _ = two_parts
    before = (root / "run" / ckpt.CKPT_FILE).read_bytes()
    with pytest.raises(ConfigError, match=r"--rescale(.|\n)*--resume-from-step 3 --world-size 1"):
        train(_cfg(root))
    assert (root / "run" / ckpt.CKPT_FILE).read_bytes() == before
    # --rescale accepts only the new world size: another plan is still refused
    other = plan_mod.load(root / "plan" / "plan.json")
    plan_mod.save(plan_mod.Plan(data=other.data, boundaries=(64,), budget=other.budget, seed=1), root / "plan-b")
    pack_epochs(plan=root / "plan-b" / "plan.json", epochs=[0], out=root / "man-b", data=root / "data", world_size=2)
    with pytest.raises(ckpt.PlanChanged, match="plan.seed"):
        train(dataclasses.replace(_cfg(root, rescale=True), plan=str(root / "plan-b" / "plan.json"),
                                  manifests=str(root / "man-b")))


def test_rescaled_resume_covers_the_epoch_exactly_once(two_parts):
    root, parent = two_parts
    train(_cfg(root, rescale=True, max_steps=4))   # one step at W = 1, checkpoint inside the continuation
    s = train(_cfg(root))                            # same world size now: the continuation is kept, no option
    cont = manifest.open(root / "man" / "resume" / "epoch-0000")
    assert cont.world_size == 1 and cont.header["resume"]["from_step"] == 3
    assert s["global_step"] == 3 + cont.num_steps and s["cursor"] == {"epoch": 1, "step": 0}
    recs = [json.loads(x) for x in (root / "run" / "log.jsonl").read_text().splitlines()[1:]]
    assert [r["global_step"] for r in recs] == list(range(1, 4 + cont.num_steps))
    assert [r["step"] for r in recs] == list(range(3 + cont.num_steps))   # the epoch's own step numbers
    # what each logged step read: steps 0..2 from the parent's 2 ranks, then the continuation's rank 0
    steps = {r["step"]: [mb for w in range(2) for mb in parent.microbatches(w) if mb.step == r["step"]]
             for r in recs[:3]}
    steps.update({3 + t: [mb for mb in cont.microbatches(0) if mb.step == t] for t in range(cont.num_steps)})
    from dflash_prep.formats.dataset import open_dataset

    ds = open_dataset(root / "data")
    for r in recs:
        mbs = steps[r["step"]]
        assert r["real_tokens"] == sum(mb.real_tokens for mb in mbs)
        # the loss normaliser is the step's all-reduced target count
        assert r["targets"] == sum(int(build_batch(ds, mb, "padded").n_targets) for mb in mbs)
    assert sum(r["targets"] for r in recs[3:]) > 0
    ids = np.concatenate([mb.sample_ids for mbs in steps.values() for mb in mbs])
    n = len(lengths_mod.load(data=root / "data").lengths)
    assert np.array_equal(np.bincount(ids, minlength=n), np.ones(n, np.int64)), "not exactly once"
    state = ckpt.load(root / "run" / ckpt.CKPT_FILE)
    assert state["run_key"]["world_size"] == 1 and state["run_key"]["continuation"]["from_step"] == 3
    assert len(state["rng"]) == 1
