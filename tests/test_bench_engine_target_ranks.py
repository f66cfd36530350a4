"""bench.engine_target_ranks, the GPU script's target-ranks step, where no vLLM is installed (the
GPU machine today): not run, neither passed nor failed, and nothing built. The trained path runs
against the real vLLM in tests/engine/test_target_ranks_engine.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from dflash_prep.bench.gpu_all import NOT_RUN
from dflash_prep.formats.fileio import check_header


def test_without_vllm_the_step_says_it_did_not_run(tmp_path):
    env = {**os.environ, "DFLASH_PREP_VLLM_PYTHON": sys.executable}   # an interpreter without vLLM, none here
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "dflash_prep.bench.engine_target_ranks", "--out", str(out)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == NOT_RUN, p.stderr[-2000:]
    path = out / "engine_target_ranks.json"
    rec = check_header(json.loads(path.read_text()), path=path, format="dflash-prep/bench-engine-target-ranks",
                       versions=(1,))
    assert rec["status"] == "not-run" and rec["passed"] is None and rec["vllm"] is None
    assert rec["reason"].startswith("no vLLM on this machine: ") and "make venv-vllm" in rec["reason"]
    assert sorted(x.name for x in out.iterdir()) == ["engine_target_ranks.json"]
