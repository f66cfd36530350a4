"""``--eval-every``: a real vLLM evaluates the drafter's checkpoints while it trains, without
stalling the step loop, and log.jsonl puts the engine's tau beside the trainer's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_prep.bench.tiny_engine import MASK_ID
from dflash_prep.tests.train.dflash_fixtures import dflash_cfg
from dflash_prep.tests.train.train_fakes import FakeSource

pytestmark = pytest.mark.engine


def test_checkpoints_are_evaluated_in_the_background_one_at_a_time(built, tmp_path):
    from dflash_prep.train.loop import train

    out = tmp_path / "run"
    # one draft layer: it taps layer L // 2 = 2 (two layers of this 4-layer target would both tap layer 1,
    # which vLLM captures once: it refuses such a drafter, evaluate says why)
    cfg = dflash_cfg(out, built["target"], mask_token_id=MASK_ID, draft_layers=1, max_steps=4, eval_every=2,
                     eval_prompts=str(built["prompts"]))
    train(cfg, source=FakeSource(n=48, layout="varlen"))
    recs = [json.loads(ln) for ln in (out / "log.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r and "global_step" in r]
    evals = [r for r in recs if "eval" in r]
    assert [r["global_step"] for r in steps] == [1, 2, 3, 4]
    # step 4 fell due while step 2's evaluation ran (an engine start takes tens of seconds): skipped,
    # and the training steps went on meanwhile: step 2's record comes after step 4's
    assert [(r["global_step"], sorted(r["eval"])) for r in evals][0] == (4, ["skipped"]), evals
    assert "global step 2 was still running" in evals[0]["eval"]["skipped"]
    (two,) = [r["eval"] for r in evals if r["global_step"] == 2]
    assert recs.index(next(r for r in evals if r["global_step"] == 2)) > recs.index(steps[-1])
    assert "failed" not in two, two
    assert two["lossless"] is True and two["agree"] is True, two
    assert two["tau_engine"] >= 1.0 and abs(two["tau_engine"] - two["tau_ours"]) <= 0.02 * two["tau_ours"]
    assert two["tau_train"] == steps[1]["tau"]
    d = out / "evals" / "step-0000002"
    assert (d / "export" / "config.json").is_file() and (d / "eval.json").is_file()
    assert not (d / "checkpoint.pt").exists()      # the export and the report are what it keeps
    report = json.loads((d / "eval.json").read_text())
    assert report["exports"][0]["vllm"]["tau"] == two["tau_engine"]
    assert list(two["per_set"]) == [Path(built["prompts"]).stem]
