"""Resume an epoch under a new world size (pack --resume-from-step): coverage across both parts."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from dflash_prep.errors import ConfigError, FingerprintMismatch, FormatError
from dflash_prep.formats import manifest
from dflash_prep.pack.pack import pack_epochs
from dflash_prep.pack.repack import resume_dir, resume_epoch
from dflash_prep.verify import verify_epoch

from dflash_prep.tests.pack.test_pack import _files, make_plan


@pytest.fixture()
def packed(tmp_path):
    plan_path, lens = make_plan(tmp_path, "bimodal", 6000, (300, 2500), 64)
    [d] = pack_epochs(plan=plan_path, epochs=[1], out=tmp_path / "m", world_size=2)
    return tmp_path, plan_path, lens, manifest.open(d)


def test_resume_at_world_size_1_after_3_steps_at_2(packed):
    tmp, plan_path, lens, old = packed
    # what two ranks consumed in steps 0..2 (the trainer's reads)
    seen_old = [mb for r in range(2) for mb in old.microbatches(r) if mb.step < 3]
    assert len(seen_old) == 3 * 2 and old.num_steps > 6
    d = resume_epoch(plan=plan_path, out=tmp / "m", epoch=1, from_step=3, world_size=1, grad_accum=1)
    assert d == resume_dir(tmp / "m", 1)
    new = manifest.open(d)
    assert new.world_size == 1 and new.header["resume"]["from_step"] == 3
    assert new.header["resume"]["parent_fingerprint"] == old.fingerprint
    seen_new = list(new.microbatches(0))
    ids = np.concatenate([mb.sample_ids for mb in seen_old + seen_new])
    assert np.array_equal(np.bincount(ids, minlength=len(lens)), np.ones(len(lens), np.int64)), "not exactly once"
    # the loss normaliser of each new step is its own tokens (one rank, one micro-batch now)
    for s in range(new.num_steps):
        assert new.step_real_tokens(s) == sum(mb.real_tokens for mb in seen_new if mb.step == s)
    real_old = sum(old.step_real_tokens(s) for s in range(3))
    assert real_old + sum(new.step_real_tokens(s) for s in range(new.num_steps)) == int(lens.sum())
    # the untouched micro-batches keep their samples; only the step layout changes
    kept = {tuple(mb.sample_ids) for r in range(2) for mb in old.microbatches(r, start_step=3)}
    assert {tuple(mb.sample_ids) for mb in seen_new} == kept
    got = verify_epoch(d)                     # coverage across the parent's first 3 steps and the rest
    assert got["samples"] == len(ids) - sum(mb.sample_ids.size for mb in seen_old)


def test_resume_is_deterministic_and_checked(packed, tmp_path_factory):
    tmp, plan_path, lens, old = packed
    d = resume_epoch(plan=plan_path, out=tmp / "m", epoch=1, from_step=2, world_size=4, grad_accum=1)
    first = _files(d)
    import shutil

    shutil.rmtree(d)
    assert _files(resume_epoch(plan=plan_path, out=tmp / "m", epoch=1, from_step=2, world_size=4)) == first
    with pytest.raises(ConfigError, match="other inputs"):
        resume_epoch(plan=plan_path, out=tmp / "m", epoch=1, from_step=3, world_size=4)
    with pytest.raises(ConfigError, match="resume-from-step must be in"):
        resume_epoch(plan=plan_path, out=tmp / "m", epoch=1, from_step=old.num_steps, world_size=1, overwrite=True)
    # the parent re-packed under other options: the continuation no longer matches it
    pack_epochs(plan=plan_path, epochs=[1], out=tmp / "m", world_size=3, overwrite=True)
    with pytest.raises(FingerprintMismatch, match="resume-from-step"):
        verify_epoch(d)


def test_verify_catches_a_lost_sample(packed):
    tmp, plan_path, lens, old = packed
    d = resume_epoch(plan=plan_path, out=tmp / "m", epoch=1, from_step=3, world_size=1)
    h = json.loads((d / manifest.MANIFEST_FILE).read_text())
    h["resume"]["consumed_microbatches"] -= 1   # a consumed micro-batch is forgotten: its samples are lost
    from dflash_prep.formats.manifest import epoch_fingerprint

    h["fingerprint"] = epoch_fingerprint({k: v for k, v in h.items()})
    (d / manifest.MANIFEST_FILE).write_text(json.dumps(h))
    with pytest.raises(FormatError, match="missing"):
        verify_epoch(d)


def test_cli_resume(packed):
    from dflash_prep.cli import app

    tmp, plan_path, _, _ = packed
    r = CliRunner().invoke(app, ["pack", "--plan", str(plan_path), "--epoch", "1", "--out", str(tmp / "m"),
                                 "--world-size", "1", "--resume-from-step", "3"])
    assert r.exit_code == 0, r.output
    assert (tmp / "m" / "resume" / "epoch-0001" / manifest.MANIFEST_FILE).is_file()
    assert CliRunner().invoke(app, ["verify", str(tmp / "m" / "resume" / "epoch-0001")]).exit_code == 0
