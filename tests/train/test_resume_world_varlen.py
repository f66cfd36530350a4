"""--rescale on varlen LM and DFlash runs: K steps under W ranks (gloo), the rest of the epoch
under W' from its continuation manifest (pack --resume-from-step), W = 2 -> 1 and 1 -> 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash_prep.formats import lengths as lengths_mod
from dflash_prep.formats import manifest
from dflash_prep.verify import verify_epoch
from dflash_prep.formats import plan as plan_mod
from dflash_prep.formats.dataset import open_dataset
from dflash_prep.objectives.drafter_cost import DrafterCostModel
from dflash_prep.objectives.dflash import DrafterOptions
from dflash_prep.pack.pack import PackConfig, pack_epochs
from dflash_prep.synth.synth import SynthConfig, synth
from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize
from dflash_prep.train import checkpoint as ckpt
from dflash_prep.train.config import TrainConfig, build as build_config
from dflash_prep.train.data import build_batch
from dflash_prep.train.loop import train

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
SMALL = dict(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64)
K = 3                  # steps trained under the first world size


def _cfg(root: Path, kind: str, **kw) -> TrainConfig:
    base = dict(data=str(root / "data"), plan=str(root / "plan" / "plan.json"), manifests=str(root / "man"),
                out=str(root / "run"), progress=False, device="cpu", prefetch=2, warmup_steps=1)
    if kind == "dflash":
        base.update(objective="dflash", target=str(root / "target"), draft_layers=2, mask_token_id=3, lr=3e-3,
                    ce_chunk=16, sliding_window=0)   # the window the manifests' cost model has
    else:
        base.update(model_overrides=SMALL)
    return build_config(**{**base, **kw})


def _run(root: Path, kind: str, world: int, **kw) -> None:
    """``train`` under ``world`` gloo ranks (spawned), or in this process for one rank."""
    if world == 1:
        train(_cfg(root, kind, **kw))
    else:
        mp.spawn(_worker, args=(world, str(root), kind, kw), nprocs=world, join=True)


def _worker(rank: int, world: int, root: str, kind: str, kw: dict) -> None:
    import torch

    from dflash_prep.train.distributed import Dist

    torch.set_num_threads(1)
    init = Path(root) / f"init-{world}-{kw.get('rescale', False)}"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        train(_cfg(Path(root), kind, **kw), dist_ctx=Dist(rank, world, 0, torch.device("cpu")))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _prepare(root: Path, kind: str, world: int) -> manifest.Manifest:
    """synth -> tokenize -> plan -> pack epoch 0 for ``world`` ranks (varlen, or --objective dflash)."""
    if kind == "dflash":
        from dflash_prep.tests.train.dflash_fixtures import tiny_target

        target = tiny_target()
        (root / "target").symlink_to(target)
        synth(SynthConfig(out=root / "corpus", n=48, seed=7))
        tokenize(TokenizeConfig(inputs=(str(root / "corpus" / "chat.jsonl"),), out=root / "data",
                                tokenizer=str(target), max_len=256, on_overflow="truncate"))
        drafter = DrafterOptions(cost_model=DrafterCostModel.from_config(target, 2), block_size=4, max_anchors=6,
                                 anchor_budget=40, anchor_seed=11)
        cfg = PackConfig(world_size=world, objective="dflash", options=drafter)
        budget = 512
    else:
        synth(SynthConfig(out=root / "corpus", n=60, seed=0))
        tokenize(TokenizeConfig(inputs=(str(root / "corpus" / "chat.jsonl"),), out=root / "data", tokenizer="byte",
                                max_len=128))
        cfg, budget = PackConfig(world_size=world, layout="varlen"), 384
    src = lengths_mod.load(data=root / "data")
    plan_mod.save(plan_mod.Plan(data=src.describe(), boundaries=(), budget=plan_mod.Budget(value=budget), seed=0),
                  root / "plan")
    [d] = pack_epochs(plan=root / "plan" / "plan.json", epochs=[0], out=root / "man", data=root / "data", config=cfg)
    m = manifest.open(d)
    assert m.num_steps > K + 1, f"the test needs an epoch longer than {K} steps at W = {world}"
    return m


@pytest.mark.parametrize("kind", ["varlen", "dflash"])
@pytest.mark.parametrize("w_from,w_to", [(2, 1), (1, 2)])
def test_rescaled_run_trains_exactly_the_continuation(tmp_path, kind, w_from, w_to):
    root = tmp_path
    parent = _prepare(root, kind, w_from)
    _run(root, kind, w_from, max_steps=K)
    _run(root, kind, w_to, rescale=True)               # the rest of epoch 0 under W'
    cont = manifest.open(root / "man" / "resume" / "epoch-0000")
    assert cont.world_size == w_to and cont.layout == "varlen" and cont.header["resume"]["from_step"] == K
    verify_epoch(cont.path)
    recs = [json.loads(x) for x in (root / "run" / "log.jsonl").read_text().splitlines()[1:]]
    assert [r["global_step"] for r in recs] == list(range(1, K + 1 + cont.num_steps))
    assert [r["step"] for r in recs] == list(range(K + cont.num_steps))      # the epoch's own step numbers
    # what each logged step read: steps 0..K-1 from the parent's ranks, then every rank of the continuation
    steps = {s: [mb for w in range(w_from) for mb in parent.microbatches(w) if mb.step == s] for s in range(K)}
    steps.update({K + s: [mb for w in range(w_to) for mb in cont.microbatches(w) if mb.step == s]
                  for s in range(cont.num_steps)})
    ds = open_dataset(root / "data")
    kc = {}
    for m in (parent, cont):
        if "anchor_counts" in m.arrays:
            kc.update(zip(m.sample_ids.tolist(), m.arrays["anchor_counts"].tolist()))
    for r in recs:
        mbs = steps[r["step"]]
        assert r["real_tokens"] == sum(mb.real_tokens for mb in mbs)
        if kind == "dflash":                           # the anchors the trainer regenerated are the manifests'
            assert r["anchors"] == sum(kc[int(i)] for mb in mbs for i in mb.sample_ids)
        else:                                          # the loss normaliser is the step's all-reduced target count
            assert r["targets"] == sum(int(build_batch(ds, mb, "varlen").n_targets) for mb in mbs)
    ids = np.concatenate([mb.sample_ids for mbs in steps.values() for mb in mbs] + [cont.dropped_ids])
    assert np.array_equal(np.bincount(ids, minlength=len(ds)), np.ones(len(ds), np.int64)), "not exactly once"
    state = ckpt.load(root / "run" / ckpt.CKPT_FILE)
    assert state["run_key"]["world_size"] == w_to and state["run_key"]["continuation"]["from_step"] == K
    assert state["cursor"] == {"epoch": 1, "step": 0, "global_step": K + cont.num_steps}
    assert len(state["rng"]) == w_to


def test_second_world_size_change_inside_an_epoch_is_refused():
    """A checkpoint inside a continuation (epoch 0 from step 3 under W = 1) cannot re-pack epoch 0
    again: its steps 3.. came from the continuation, not from the epoch manifest."""
    from dflash_prep.errors import ConfigError
    from dflash_prep.train.rescale import plan_resume

    cont = {"epoch": 0, "from_step": 3, "parent_world_size": 2, "parent_grad_accum": 1, "world_size": 1}
    inside = {"run_key": {"world_size": 1, "grad_accum": 1, "continuation": cont},
              "cursor": {"epoch": 0, "step": 5, "global_step": 5}}
    for w in (2, 4):
        with pytest.raises(ConfigError, match="second world-size change"):
            plan_resume(inside, rescale=True, world_size=w, ckpt_path="run/checkpoint.pt")
    assert plan_resume(inside, rescale=False, world_size=1, ckpt_path="run/checkpoint.pt") == cont
    # at the next epoch edge, or in a later epoch, a new world size starts afresh
    edge = {**inside, "cursor": {"epoch": 1, "step": 0, "global_step": 9}}
    assert plan_resume(edge, rescale=True, world_size=2, ckpt_path="run/checkpoint.pt") == cont
    later = {**inside, "cursor": {"epoch": 1, "step": 2, "global_step": 11}}
    assert plan_resume(later, rescale=True, world_size=2, ckpt_path="run/checkpoint.pt") == {
        "epoch": 1, "from_step": 2, "parent_world_size": 1, "parent_grad_accum": 1, "world_size": 2}
