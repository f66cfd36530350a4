"""bench.engine_dflash2, the GPU script's engine step: its answer where no vLLM is installed, and the
entry-point shim that lets a bare interpreter load the strict-load plugin (the served and refused
paths run against the real vLLM in tests/engine/test_vllm.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dflash_prep.bench.engine_dflash2 import PLUGIN, plugin_site
from dflash_prep.bench.gpu_all import NOT_RUN
from dflash_prep.formats.fileio import check_header

ROOT = Path(__file__).resolve().parents[1]


def test_without_vllm_the_step_says_it_did_not_run(tmp_path):
    # an interpreter without vLLM named as the engine, and none in this venv: nothing to serve with
    env = {**os.environ, "DFLASH_PREP_VLLM_PYTHON": sys.executable}
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "dflash_prep.bench.engine_dflash2", "--out", str(out)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == NOT_RUN, p.stderr[-2000:]      # neither passed nor failed: gpu_all says "not run"
    path = out / "engine_dflash2.json"
    rec = check_header(json.loads(path.read_text()), path=path, format="dflash-prep/bench-engine-dflash2", versions=(1,))
    assert rec["status"] == "not-run" and rec["passed"] is None and rec["vllm"] is None
    assert rec["reason"].startswith("no vLLM on this machine: ") and "make venv-vllm" in rec["reason"]
    assert rec["export"]["architecture"] == "DFlash2DraftModel"  # the export was built before the lookup
    assert not (out / "eval.json").exists()


def test_the_plugin_shim_is_an_entry_point_vllm_would_load(tmp_path):
    site = plugin_site(tmp_path / "site")
    probe = ("import importlib.metadata as m, sys; "
             "eps = [e for e in m.entry_points(group='vllm.general_plugins') if e.name == sys.argv[1] "
             "and e.dist.name == 'dflash-prep-load-report-shim']; print(len(eps), eps[0].value, eps[0].load().__module__)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    r = subprocess.run([sys.executable, "-c", probe, PLUGIN[0]], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", PLUGIN[1], "dflash_prep.engine.load_report"]
