"""pack --resume-from-step on varlen LM and --objective dflash epochs: the rest of an epoch
re-packed for another world size, checked against its parent on a real byte-tokenized dataset."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from typer.testing import CliRunner

from dflash_prep.errors import FormatError
from dflash_prep.formats import manifest
from dflash_prep.verify import verify_epoch
from dflash_prep.formats import plan as plan_mod
from dflash_prep.formats.dataset import open_dataset
from dflash_prep.formats.lengths import read_dataset_lengths, read_mask_counts
from dflash_prep.objectives import anchors
from dflash_prep.objectives.dflash import drafter_options, microbatch_cost
from dflash_prep.objectives.dflash_anchors import microbatch_anchors
from dflash_prep.pack.pack import PackConfig, pack_epochs
from dflash_prep.pack.repack import resume_dir, resume_epoch
from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize
from dflash_prep.tests.assets.fixtures import CHATS, write_jsonl
from dflash_prep.tests.pack.test_pack import _files

T = 2048
DIMS = "hidden=64,layers=4,intermediate=96,heads=4,kv_heads=2,head_dim=16,vocab=300"
C = manifest.COL


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """A byte-tokenized chat dataset (160 samples, 51..965 tokens) and a plan with T = 2048."""
    tmp = tmp_path_factory.mktemp("repack-varlen")
    rng = np.random.default_rng(0)
    rows = [{"messages": [dict(m, content=m["content"] * int(rng.integers(1, 8))) for m in CHATS[i % len(CHATS)]]}
            for i in range(160)]
    tokenize(TokenizeConfig(tokenizer="byte", inputs=(str(write_jsonl(tmp / "chat.jsonl", rows)),),
                            out=tmp / "data", chunk_rows=50))
    src = read_dataset_lengths(tmp / "data")
    path = plan_mod.save(plan_mod.Plan(data=src.describe(), boundaries=(), budget=plan_mod.Budget(value=T), seed=3),
                         tmp / "plan")
    return tmp, path, np.asarray(src.lengths, np.int64)


def _config(kind: str, world_size: int) -> PackConfig:
    if kind == "varlen":
        return PackConfig(world_size=world_size, layout="varlen")
    d = drafter_options(target_dims=DIMS, draft_layers=2, block_size=4, max_anchors=24, anchor_budget=120,
                        anchor_seed=11, store_anchors=kind == "dflash-stored")
    return PackConfig(world_size=world_size, objective="dflash", options=d)


def _consumed(parent: manifest.Manifest, k: int) -> list[manifest.MicroBatch]:
    """What the parent's ranks read in steps 0..k-1 (the trainer's reads)."""
    return [mb for r in range(parent.world_size) for mb in parent.microbatches(r) if mb.step < k]


def _check(tmp, plan_path, lens, parent: manifest.Manifest, d, k: int) -> manifest.Manifest:
    """The continuation ``d`` of ``parent`` from step ``k``: coverage, kept micro-batches, budgets,
    layout, drafter arrays and verify."""
    cont = manifest.open(d)
    assert cont.layout == "varlen" == parent.layout
    assert cont.header["resume"]["from_step"] == k and cont.header["resume"]["parent_fingerprint"] == parent.fingerprint
    assert cont.header["pack_config"]["world_size"] == cont.world_size
    new = [mb for r in range(cont.world_size) for mb in cont.microbatches(r)]
    ids = np.concatenate([mb.sample_ids for mb in _consumed(parent, k) + new] + [cont.dropped_ids])
    assert np.array_equal(np.bincount(ids, minlength=len(lens)), np.ones(len(lens), np.int64)), "not exactly once"
    # every new micro-batch is one of the parent's unconsumed ones, or a contiguous half of one
    rest = {int(i): (mb.index, j) for r in range(parent.world_size) for mb in parent.microbatches(r, start_step=k)
            for j, i in enumerate(mb.sample_ids)}
    for mb in new:
        where = [rest[int(i)] for i in mb.sample_ids]
        assert len({w[0] for w in where}) == 1, f"micro-batch {mb.index} mixes the parent's rows {where}"
        assert [w[1] for w in where] == list(range(where[0][1], where[0][1] + len(where)))
    # each rank has the same count per step, and the budgets hold
    t = np.asarray(cont.table)
    assert np.all(np.bincount(t[:, C["step"]] * cont.world_size + t[:, C["rank"]]) == cont.grad_accum)
    assert t[:, C["real_tokens"]].max() <= T
    for mb in new:
        assert np.array_equal(mb.cu_seqlens, np.concatenate([[0], np.cumsum(lens[mb.sample_ids])]))
    if "dflash" in parent.header:
        _check_drafter(tmp, lens, parent, cont)
    got = verify_epoch(d)                 # coverage with the parent's first k steps, budgets, anchor digest
    assert got["samples"] == sum(len(mb.sample_ids) for mb in new)
    return cont


def _check_drafter(tmp, lens, parent: manifest.Manifest, cont: manifest.Manifest) -> None:
    h = cont.header["dflash"]
    assert h == parent.header["dflash"], "the continuation must keep the parent's drafter section and digest"
    per_id = np.zeros(len(lens), np.int64)
    per_id[parent.sample_ids] = parent.arrays["anchor_counts"]
    kc = np.asarray(cont.arrays["anchor_counts"])
    assert np.array_equal(kc, per_id[cont.sample_ids])
    assert cont.summary["anchors"] == int(kc.sum())
    t = np.asarray(cont.table)
    off = np.concatenate([[0], np.cumsum(t[:, C["count"]])])
    row_k = np.add.reduceat(kc.astype(np.int64), off[:-1])
    assert row_k.max() <= h["anchor_budget"]
    mc = read_mask_counts(tmp / "data")
    ids = np.asarray(cont.sample_ids)
    cost = microbatch_cost(cont.header, lens[ids], mc.supervised[ids], kc, off)
    assert np.all((cost <= h["cost_budget"] * (1 + 1e-9)) | (t[:, C["count"]] == 1))
    # the trainer's anchors for a moved sample are the parent's: keyed by (seed, epoch, id), not by micro-batch
    ds = open_dataset(tmp / "data")
    p_off = np.concatenate([[0], np.cumsum(parent.arrays["anchor_counts"])])
    p_row = {int(i): j for j, i in enumerate(parent.sample_ids)}
    for mb in (cont.microbatch(0), cont.microbatch(cont.num_microbatches - 1)):
        masks = np.concatenate([ds.sample(int(i))[1] for i in mb.sample_ids])
        pos, poff = microbatch_anchors(cont.header, masks, mb.cu_seqlens, mb.sample_ids)
        for j, i in enumerate(mb.sample_ids):
            want = anchors.sample_anchors(ds.sample(int(i))[1], seed=h["anchor_seed"], epoch=parent.epoch,
                                          sample_id=int(i), max_anchors=h["max_anchors"], policy=h["anchor_policy"],
                                          block_size=h["block_size"])
            assert np.array_equal(pos[poff[j]:poff[j + 1]], want)
            if "anchors" in parent.arrays:
                r = p_row[int(i)]
                assert np.array_equal(want, parent.arrays["anchors"][p_off[r]:p_off[r + 1]])
    if "anchors" in parent.arrays:
        c_off = np.concatenate([[0], np.cumsum(kc)])
        stored = np.asarray(cont.arrays["anchors"])
        for j, i in enumerate(ids):
            r = p_row[int(i)]
            assert np.array_equal(stored[c_off[j]:c_off[j + 1]], parent.arrays["anchors"][p_off[r]:p_off[r + 1]])


@pytest.mark.parametrize("kind", ["varlen", "dflash", "dflash-stored"])
@pytest.mark.parametrize("w_from,w_to", [(2, 1), (1, 2)])
def test_rest_of_epoch_for_a_new_world_size(planned, tmp_path, kind, w_from, w_to):
    tmp, plan_path, lens = planned
    [pd] = pack_epochs(plan=plan_path, epochs=[1], out=tmp_path / "m", data=tmp / "data",
                       config=_config(kind, w_from))
    parent = manifest.open(pd)
    assert parent.num_steps > 6
    # an odd rest at W' = 2, so that one micro-batch must be split in two
    k = 3 if w_to == 1 or (parent.num_microbatches - 3 * w_from) % 2 else 4
    d = resume_epoch(plan=plan_path, out=tmp_path / "m", epoch=1, from_step=k, world_size=w_to, data=tmp / "data")
    assert d == resume_dir(tmp_path / "m", 1)
    cont = _check(tmp, plan_path, lens, parent, d, k)
    assert cont.summary["split_microbatches"] == (1 if w_to == 2 else 0)
    first = _files(d)
    shutil.rmtree(d)
    again = resume_epoch(plan=plan_path, out=tmp_path / "m", epoch=1, from_step=k, world_size=w_to, data=tmp / "data")
    assert _files(again) == first, "the continuation is not deterministic"


def test_dflash_drop_last_and_cli(planned, tmp_path):
    """The brief's command on a dflash epoch, then verify; --drop-last lists the left-out samples."""
    from dflash_prep.cli import app

    tmp, plan_path, lens = planned
    [pd] = pack_epochs(plan=plan_path, epochs=[0], out=tmp_path / "m", data=tmp / "data", config=_config("dflash", 2))
    parent = manifest.open(pd)
    r = CliRunner().invoke(app, ["pack", str(tmp / "data"), "--plan", str(plan_path), "--epoch", "0", "--out",
                                 str(tmp_path / "m"), "--world-size", "1", "--resume-from-step", "3"])
    assert r.exit_code == 0, r.output
    d = resume_dir(tmp_path / "m", 0)
    assert CliRunner().invoke(app, ["verify", str(d)]).exit_code == 0
    assert manifest.open(d).num_steps == parent.num_microbatches - 6
    k = 3 if (parent.num_microbatches - 6) % 4 else 2
    d = resume_epoch(plan=plan_path, out=tmp_path / "m", epoch=0, from_step=k, world_size=4, drop_last=True,
                     overwrite=True)
    cont = _check(tmp, plan_path, lens, parent, d, k)
    assert len(cont.dropped_ids) > 0 and cont.summary["dropped_samples"] == len(cont.dropped_ids)


def test_dflash_parent_from_other_drafter_options_is_refused(planned, tmp_path):
    """A parent whose dflash section this dflash-prep would not derive (here: another anchor
    budget recorded, re-sealed) is refused rather than continued with mismatched budgets."""
    import json

    tmp, plan_path, _ = planned
    [pd] = pack_epochs(plan=plan_path, epochs=[0], out=tmp_path / "m", data=tmp / "data", config=_config("dflash", 2))
    h = json.loads((pd / manifest.MANIFEST_FILE).read_text())
    h["dflash"]["anchor_budget"] += 1
    h["fingerprint"] = manifest.epoch_fingerprint(h)
    (pd / manifest.MANIFEST_FILE).write_text(json.dumps(h))
    with pytest.raises(FormatError, match="anchor_budget"):
        resume_epoch(plan=plan_path, out=tmp_path / "m", epoch=0, from_step=2, world_size=1)
    assert not resume_dir(tmp_path / "m", 0).exists()
