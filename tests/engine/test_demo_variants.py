"""The README's ``make demo-dflash`` variants, each run by CI at the smallest size that takes every
step, the engine's included: ``OBJECTIVE=eagle3`` to its vLLM step, ``OBJECTIVE=dflash2`` to the one
line that says why vLLM cannot serve it on this build (or, on a GPU build, through it):
``test_demo_dflash2.py``, a file of its own so that the engine suite's two workers (``--dist loadfile``)
can run the two at once. Steps 1-5 are made once for the three demo tests (the session's
``demo_base``: the recipe run with ``BASE_ONLY=1``); each runs the rest with ``BASE_FROM``.

The plain ``OBJECTIVE=dflash`` run is ``test_vllm.py::test_a_trained_demo_drafter_agrees_with_our_evaluator``.
A regression in a variant's own branch of the recipe (its pack, train, export, the step 9 targets or the
step 10 decision) fails here; ``test_engine_cuda.py`` checks the step 10 decision alone, without training.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_prep.tests.engine.conftest import DEMO_BASE_KNOBS

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parents[2]
# the DFlash test's knobs: steps 1-5 are the session's demo_base (conftest.py), made by the recipe once
SMALL = {**DEMO_BASE_KNOBS, "DRAFT_STEPS": "150", "MAX_NEW": "32", "BENCH": "gsm8k", "BENCH_N": "2"}


def _demo(tmp_path: Path, engine_python, demo_base: Path, **knobs) -> tuple[subprocess.CompletedProcess, Path]:
    """The recipe from step 5's pack on, on the session's steps 1-5 (``BASE_FROM``)."""
    demo = tmp_path / "demo"
    env = {**os.environ, **SMALL, **knobs, "DEMO_DFLASH": str(demo), "PY": sys.executable, "BASE_FROM": str(demo_base),
           "DFLASH_PREP_VLLM_PYTHON": str(engine_python)}
    r = subprocess.run(["bash", str(ROOT / "train/recipes/demo_dflash.sh")], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=1300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"1-5. the target, corpus, regenerated answers and drafter data of {demo_base}" in r.stdout
    assert "tau >= 2.0: ok  lossless: ok" in r.stdout, r.stdout[-2000:]
    return r, demo


@pytest.mark.timeout(1500)
def test_demo_eagle3_runs_every_step_and_vllm_serves_its_export(engine_python, demo_base, tmp_path):
    from dflash_prep.engine.evaluate import cell

    r, demo = _demo(tmp_path, engine_python, demo_base, OBJECTIVE="eagle3", ENGINE_EVAL="1")
    assert "loss fell: ok" in r.stdout
    assert json.loads((demo / "drafter" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    report = json.loads((demo / "eval-bench.json").read_text())
    assert [s["name"] for s in report["sets"]] == ["gsm8k", "heldout"]
    for name in ("gsm8k", "heldout"):
        c = cell(report, 0, name)
        assert c["strict_load"]["ok"] and c["lossless"]["ok"], (name, c["strict_load"], c["lossless"])
        assert c["vllm"]["num_draft_tokens"] == 7 * c["vllm"]["num_drafts"] > 0   # chains of TTT_STEPS = 7
    assert not any("step 10" in x and "skipped" in x for x in r.stdout.splitlines())
