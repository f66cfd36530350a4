"""The trainer on real pipeline outputs: synth -> tokenize -> plan -> (pack on the fly) -> train."""

from __future__ import annotations

import json

import pytest

from dflash_prep.errors import ConfigError, FingerprintMismatch
from dflash_prep.formats import lengths as lengths_mod
from dflash_prep.formats import plan as plan_mod
from dflash_prep.synth.synth import SynthConfig, synth
from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize
from dflash_prep.train.config import build as build_config
from dflash_prep.train.loop import train
from dflash_prep.train.source import FileSource

SMALL = dict(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipe")
    synth(SynthConfig(out=root / "corpus", n=40, seed=0))
    tokenize(TokenizeConfig(inputs=(str(root / "corpus" / "chat.jsonl"),), out=root / "data", tokenizer="byte", max_len=128))
    src = lengths_mod.load(data=root / "data")
    plan_mod.save(plan_mod.Plan(data=src.describe(), boundaries=(64,), budget=plan_mod.Budget(value=512), seed=0),
                  root / "plan")
    return root


def _cfg(root, **kw):
    return build_config(data=str(root / "data"), plan=str(root / "plan" / "plan.json"), manifests=str(root / "man"),
                       out=str(root / "run"), model_overrides=SMALL, progress=False, device="cpu", **kw)


def test_missing_manifest_is_an_error_naming_the_command(pipeline):
    with pytest.raises(ConfigError, match=r"dflash-prep pack \S+data --plan \S+plan.json --out \S+man --epoch 0 --world-size 1"):
        train(_cfg(pipeline, pack_missing=False, max_steps=1))


def test_missing_epochs_are_packed_on_the_fly_and_trained_in_manifest_order(pipeline):
    from dflash_prep.formats import manifest

    s = train(_cfg(pipeline, epochs=2, max_steps=0))
    for e in (0, 1):
        assert (manifest.epoch_dir(pipeline / "man", e) / manifest.MANIFEST_FILE).is_file()
    m0, m1 = (manifest.open(manifest.epoch_dir(pipeline / "man", e)) for e in (0, 1))
    assert s["global_step"] == m0.num_steps + m1.num_steps
    assert s["real_tokens"] == int(m0.table[:, 7].sum() + m1.table[:, 7].sum())  # every listed token, once
    recs = [json.loads(x) for x in (pipeline / "run" / "log.jsonl").read_text().splitlines()[1:]]
    assert [(r["epoch"], r["step"]) for r in recs] == \
        [(0, i) for i in range(m0.num_steps)] + [(1, i) for i in range(m1.num_steps)]
    assert [r["real_tokens"] for r in recs[:m0.num_steps]] == [m0.step_real_tokens(i) for i in range(m0.num_steps)]


def test_plan_for_other_data_is_refused(pipeline, tmp_path):
    other = lengths_mod.LengthSource(lengths_mod.load(data=pipeline / "data").lengths, "lengths", "x", "f" * 32)
    plan_mod.save(plan_mod.Plan(data=other.describe(), boundaries=(64,), budget=plan_mod.Budget(value=512)), tmp_path)
    with pytest.raises(FingerprintMismatch, match="analyze"):
        FileSource(pipeline / "data", tmp_path / "plan.json", tmp_path / "man")


def test_epoch_packed_on_the_fly_keeps_a_neighbours_budget_override(pipeline, tmp_path):
    from dflash_prep.formats import manifest
    from dflash_prep.pack.pack import pack_epochs

    override = plan_mod.Budget(value=384)
    pack_epochs(plan=pipeline / "plan" / "plan.json", epochs=[0], out=tmp_path / "man", data=pipeline / "data",
                budget=override)
    src = FileSource(pipeline / "data", pipeline / "plan" / "plan.json", tmp_path / "man", pack_missing=False)
    with pytest.raises(ConfigError, match="--budget-unit tokens --budget 384"):
        src.manifest(1)
    FileSource(pipeline / "data", pipeline / "plan" / "plan.json", tmp_path / "man").manifest(1)
    h0, h1 = (manifest.read_header(manifest.epoch_dir(tmp_path / "man", e)) for e in (0, 1))
    assert h1["budget"]["value"] == h0["budget"]["value"] == 384
