"""bench.gpu_all, the GPU entry point, end to end on CPU (--smoke) with ``datasets`` made unimportable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_prep.bench.gpu_all import NOT_RUN
from dflash_prep.formats.fileio import check_header

pytestmark = pytest.mark.jobs  # every GPU step as a subprocess (~75 s): `make test-jobs` (and CI), not `make test`

ROOT = Path(__file__).resolve().parents[1]

BLOCKER = '''
import sys


class _NoDatasets:  # the GPU machine has no `datasets`: importing it anywhere on the path is a bug
    def find_spec(self, name, path=None, target=None):
        if name == "datasets" or name.startswith("datasets."):
            raise RuntimeError("bench.gpu_all imported `datasets`, which the GPU machine does not have")
        return None


sys.meta_path.insert(0, _NoDatasets())
'''


def test_gpu_entry_point_runs_every_step_on_cpu_without_datasets(tmp_path):
    """About 75 s on an idle 2-core machine (the target-workers step spawns two processes): every step through the interpreter at tiny shapes."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)])
    probe = subprocess.run([sys.executable, "-c", "import datasets"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "GPU machine does not have" in probe.stderr  # the blocker is live
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "dflash_prep.bench.gpu_all", "--smoke", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    logs = {p.name: p.read_text()[-1500:] for p in out.glob("*.log")}
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:], logs)
    summary = check_header(json.loads((out / "gpu_all.json").read_text()), path=out / "gpu_all.json",
                           format="dflash-prep/gpu-all", versions=(1,))
    assert [s["name"] for s in summary["steps"]] == ["checks", "attention-causal", "attention-dflash", "attention-ttt",
                                                     "drafter-training", "drafter-variants", "target-workers",
                                                     "engine-dflash2", "engine-target-ranks"]
    assert summary["smoke"] is True and summary["passed"] is True
    for s in summary["steps"]:
        ok = (0, NOT_RUN) if s["name"].startswith("engine-") else (0,)  # the engine steps: not run without vLLM
        assert s["returncode"] in ok and not s["timed_out"] and s["files"], s
        assert "datasets" not in logs[f"{s['name']}.log"], logs[f"{s['name']}.log"]
    checks = json.loads((out / "checks" / "gpu_checks.json").read_text())
    assert set(checks["checks"]) == {"causal", "dflash", "trainer"} and checks["passed"] is True
    assert [c["window"] for c in checks["checks"]["dflash"]["result"]] == [0, 8]
    dflash = json.loads((out / "attention-dflash" / "attention-dflash-smoke.json").read_text())
    assert [r["W"] for r in dflash["window_rows"]] == [0, 8]
    drafter = json.loads((out / "drafter-training" / "drafter_gpu.json").read_text())
    assert drafter["target_met"] is None  # smoke: no verdict from CPU figures
    variants = json.loads((out / "drafter-variants" / "drafter_variants_gpu.json").read_text())
    assert [r["drafter"] for r in variants["rows"]] == ["dflash", "dflash2", "eagle3"]
    split = json.loads((out / "target-workers" / "target_workers_gpu.json").read_text())
    assert split["smoke"] is True and split["split"]["steps"] == split["colocated"]["steps"] >= 1
    assert split["split"]["bytes_sent"] > 0 and 0.0 <= split["split"]["drafter_wait_frac"] <= 1.0
    engine = json.loads((out / "engine-dflash2" / "engine_dflash2.json").read_text())
    assert engine["status"] in ("smoke", "not-run") and engine["export"]["architecture"] == "DFlash2DraftModel"
    step = next(s for s in summary["steps"] if s["name"] == "engine-dflash2")
    # without vLLM the step is recorded as not run: not passed, not failed, listed apart
    assert (step["status"], step["passed"]) == (("passed", True) if engine["status"] == "smoke" else ("not run", None))
    ranks = json.loads((out / "engine-target-ranks" / "engine_target_ranks.json").read_text())
    assert ranks["status"] == engine["status"]                     # the same engine found, or none
    assert summary["not_run"] == ([] if engine["status"] == "smoke" else ["engine-dflash2", "engine-target-ranks"])


def test_gpu_entry_point_runs_the_chosen_steps_only(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "dflash_prep.bench.gpu_all", "--smoke", "--steps", "engine-dflash2",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "gpu_all.json").read_text())
    assert [s["name"] for s in summary["steps"]] == ["engine-dflash2"] and summary["passed"] is True
    bad = subprocess.run([sys.executable, "-m", "dflash_prep.bench.gpu_all", "--steps", "no-such", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown steps ['no-such']" in bad.stderr
