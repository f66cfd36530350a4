"""The README's first command, ``make demo``, run whole by CI (``make test-jobs``): every stage of the
Makefile target (synth, tokenize, verify, analyze, pack, verify, then ``make train``: two gloo
processes) on a smaller corpus and a few steps, into a temporary folder, with this venv. A stage that
breaks, or a make variable that stops reaching its command, fails here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.jobs   # two training processes (~1 min): `make test-jobs` (and CI), not `make test`
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(900)
def test_make_demo_runs_every_stage_and_trains_on_two_ranks(tmp_path):
    venv = Path(sys.prefix)
    demo = tmp_path / "demo"
    cmd = ["make", "--no-print-directory", "-o", f"{venv}/bin/.installed", "demo", f"VENV={venv}", f"DEMO={demo}",
           "DEMO_N=1500", "TRAIN_CPU_ARGS=--device cpu --max-steps 4 --no-progress"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=840)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "train: 2 process(es) (gloo, CPU)" in r.stdout
    assert len((demo / "corpus" / "chat.jsonl").read_text().splitlines()) == 1500
    assert r.stdout.count("dflash-prep verify") == 2 and "error" not in r.stderr.lower(), r.stderr[-2000:]
    summary = json.loads((demo / "run" / "summary.json").read_text())
    assert summary["steps"] == summary["global_step"] == 4, summary
