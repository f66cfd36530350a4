"""The objective seam: a toy objective registered from the test folder packs, verifies and trains."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dflash_prep import objectives
from dflash_prep.errors import ConfigError
from dflash_prep.formats import lengths as lengths_mod
from dflash_prep.formats import manifest
from dflash_prep.formats import plan as plan_mod
from dflash_prep.pack.config import PackConfig
from dflash_prep.pack.pack import pack_epochs
from dflash_prep.synth.synth import SynthConfig, synth
from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize
from dflash_prep.verify import verify_epoch

from dflash_prep.tests.objectives.toy import ToyOptions, register_toy

SMALL = dict(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    pytest.importorskip("torch")
    register_toy()
    root = tmp_path_factory.mktemp("toy")
    synth(SynthConfig(out=root / "corpus", n=60, seed=1))
    tokenize(TokenizeConfig(inputs=(str(root / "corpus" / "chat.jsonl"),), out=root / "data", tokenizer="byte",
                            max_len=128))
    src = lengths_mod.load(data=root / "data")
    plan_mod.save(plan_mod.Plan(data=src.describe(), boundaries=(64,), budget=plan_mod.Budget(value=512), seed=0),
                  root / "plan")
    cfg = PackConfig(objective="toy", options=ToyOptions(weight=2.0), grad_accum=2)
    [d] = pack_epochs(plan=root / "plan" / "plan.json", epochs=[0], out=root / "man", config=cfg)
    return root, d


def test_toy_packs_with_its_own_layout_header_and_flags(packed):
    root, d = packed
    m = manifest.open(d)
    assert m.layout == "varlen"                       # the objective's only layout is the default
    assert m.header["toy"] == {"weight": 2.0, "tokens": int(m.table[:, manifest.COL["real_tokens"]].sum())}
    assert m.summary["toy_rows"] == m.num_steps * 2
    assert "toy" in objectives.names()
    assert PackConfig(objective="toy", options=ToyOptions(3.0)).cli_flags().endswith("--objective toy --toy-weight 3")
    with pytest.raises(ConfigError, match="packs the varlen layout only"):
        PackConfig(objective="toy", options=ToyOptions(), layout="padded")
    with pytest.raises(ConfigError, match="needs its options"):
        PackConfig(objective="toy")


def test_toy_verify_runs_its_check(packed):
    root, d = packed
    assert verify_epoch(d)["toy_rows"] == manifest.open(d).num_microbatches
    m = manifest.open(d)
    lens = lengths_mod.load(data=root / "data").lengths
    offsets = [0, len(m.sample_ids)]
    bad = SimpleNamespace(header=m.header | {"toy": {**m.header["toy"], "tokens": m.header["toy"]["tokens"] + 1}})
    obj = objectives.of_header(bad.header)
    assert obj.verify(m, lens, m.sample_ids, offsets, None)[0] == []
    problems, _, _ = obj.verify(bad, lens, m.sample_ids, offsets, None)
    assert problems and "toy header says" in problems[0]


def test_toy_trains_two_steps(packed):
    from dflash_prep.train.config import build as build_config
    from dflash_prep.train.loop import train

    root, _ = packed
    cfg = build_config(data=str(root / "data"), plan=str(root / "plan" / "plan.json"), manifests=str(root / "man"),
                      out=str(root / "run"), model_overrides=SMALL, progress=False, device="cpu", objective="toy",
                      pack_missing=False, max_steps=2, warmup_steps=1)
    s = train(cfg)
    assert s["steps"] == 2 and s["objective"] == "toy"
    recs = [json.loads(x) for x in (root / "run" / "log.jsonl").read_text().splitlines()[1:]]
    assert [r["toy_weight"] for r in recs] == [2.0, 2.0]
    assert all(r["loss"] > 0 for r in recs)


def test_toy_option_is_a_pack_flag_with_no_core_edit(packed):
    """The toy's one declared option shows in ``pack --help`` (its own panel) and the CLI builds
    its options from it; the flags ``cli_flags`` derives pack the same config again."""
    from typer.testing import CliRunner

    from dflash_prep.cli import app
    from dflash_prep.pack.config import load as load_pack_config

    root, _ = packed
    help_text = CliRunner().invoke(app, ["pack", "--help"], env={"COLUMNS": "200"}).output
    assert "--toy-weight" in help_text and "Objective toy" in help_text
    assert "--toy-weight" not in CliRunner().invoke(app, ["analyze", "--help"], env={"COLUMNS": "200"}).output
    want = PackConfig(objective="toy", options=ToyOptions(weight=3.0), grad_accum=2)
    args = ["pack", str(root / "data"), "--plan", str(root / "plan" / "plan.json"), "--out", str(root / "cli"),
            "--epoch", "0", *want.cli_flags().split()]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert load_pack_config(root / "cli").options == want.options
    assert manifest.open(root / "cli" / "epoch-0000").header["toy"]["weight"] == 3.0
