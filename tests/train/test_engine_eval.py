"""``--eval-every``'s refusals, before any step (the evaluation itself: tests/engine/test_eval_every.py)."""

from __future__ import annotations

import pytest

from dflash_prep.errors import ConfigError, EngineError
from dflash_prep.train import engine_eval
from dflash_prep.train.config import build as build_config
from dflash_prep.train.objectives.registry import get as trainer_spec


def test_eval_every_needs_prompts():
    with pytest.raises(ConfigError, match="--eval-every needs --eval-prompts FILE"):
        build_config(out="x", objective="lm", eval_every=2)


def test_an_lm_run_has_nothing_to_evaluate(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    cfg = build_config(out="x", objective="lm", eval_every=2, eval_prompts=str(tmp_path / "p.jsonl"))
    with pytest.raises(ConfigError, match="an --objective lm run has none"):
        engine_eval.check(cfg, trainer_spec("lm"))


def test_missing_prompts_and_missing_engine_are_one_line_each(tmp_path, monkeypatch):
    cfg = build_config(out="x", objective="dflash", target=str(tmp_path), eval_every=2,
                       eval_prompts=str(tmp_path / "none.jsonl"))
    with pytest.raises(ConfigError, match="--eval-prompts .*none.jsonl: no such file"):
        engine_eval.check(cfg, trainer_spec("dflash"))
    (tmp_path / "p.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    cfg = build_config(out="x", objective="dflash", target=str(tmp_path), eval_every=2,
                       eval_prompts=str(tmp_path / "p.jsonl"))
    monkeypatch.setenv("DFLASH_PREP_VLLM_PYTHON", str(tmp_path / "no-python"))
    with pytest.raises(EngineError, match="make venv-vllm") as e:
        engine_eval.check(cfg, trainer_spec("dflash"))
    assert "\n" not in str(e.value)
