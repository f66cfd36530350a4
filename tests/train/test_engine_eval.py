"""``--eval-every``'s refusals, before any step (the evaluation itself: tests/engine/test_eval_every.py)."""

from __future__ import annotations

import sys

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


def test_shipped_sets_alone_are_enough_and_an_unknown_one_is_refused(tmp_path, monkeypatch):
    cfg = build_config(out="x", objective="dflash", target=str(tmp_path), eval_every=2, eval_bench="gsm8k,mt-bench",
                       eval_n=4)
    monkeypatch.setenv("DFLASH_PREP_VLLM_PYTHON", str(tmp_path / "no-python"))
    with pytest.raises(EngineError, match="make venv-vllm"):      # past the sets: only the engine is missing
        engine_eval.check(cfg, trainer_spec("dflash"))
    cfg = build_config(out="x", objective="dflash", target=str(tmp_path), eval_every=2, eval_bench="gsm8k,aime")
    with pytest.raises(ConfigError, match="aime") as e:
        engine_eval.check(cfg, trainer_spec("dflash"))
    assert "\n" not in str(e.value) and "gsm8k" in str(e.value)
    with pytest.raises(ConfigError, match="--eval-n must be >= 0"):
        build_config(out="x", objective="dflash", target=str(tmp_path), eval_every=2, eval_bench="gsm8k", eval_n=-1)


def test_the_background_command_names_the_sets(tmp_path):
    evals = engine_eval.EngineEvals(tmp_path, target="T", prompts="", every=2, bench="gsm8k", n=3)
    assert evals.bench == "gsm8k" and evals.n == 3 and evals.due(4) and not evals.due(3)


def test_our_evaluator_is_passed_on_or_refused(tmp_path, monkeypatch):
    """--eval-ours reaches the background command (off: vLLM's tau alone); a bad value is one line."""
    import subprocess

    from dflash_prep.train import engine_eval as ee

    started = []
    monkeypatch.setattr(ee, "spawn", lambda cmd, **kw: started.append(cmd) or type("E", (), {"proc": None})())
    ckpt = tmp_path / "checkpoint.pt"
    ckpt.write_bytes(b"x")
    for ours in ("auto", "off"):
        ee.EngineEvals(tmp_path / ours, target="T", prompts="", every=2, bench="gsm8k", n=3, ours=ours).start(2, ckpt, None)
    assert [c[c.index("--ours") + 1] for c in started] == ["auto", "off"]
    with pytest.raises(ConfigError, match="--eval-ours must be one of auto, on, off"):
        build_config(out="x", objective="dflash", target=str(tmp_path), eval_every=2, eval_bench="gsm8k", eval_ours="no")
    r = subprocess.run([sys.executable, "-m", "dflash_prep.train.engine_eval", "--help"], capture_output=True, text=True)
    assert "--ours {auto,on,off}" in r.stdout
