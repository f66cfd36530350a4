"""``make demo-real DEMO_SIZE=small``: the real-target demo end to end as CI's smoke run.

SmolLM2-135M-Instruct from ``make real-target`` (converted once; the conversion is not timed):
a few training prompts answered by the target, tokenized with its chat template, packed, a few
drafter steps, the export served by a real vLLM (``.venv-vllm``) on every shipped set beside vLLM's
n-gram speculator. It asserts what a user reads off the result: the export loaded strictly, every
set lossless, the n-gram rows (lossless too), the three report files, and
the time: under 4 minutes (printed, with the machine's load average, since a loaded machine mostly
slows vLLM's starts). ``make test-engines`` runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parents[2]
LIMIT_S = 240


def _make(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_demo_real_small_is_strict_lossless_and_under_four_minutes(engine_python, tmp_path):
    built = _make("real-target", timeout=900)       # downloads and converts once; up to date in seconds after
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]

    out = tmp_path / "demo-real"
    load = os.getloadavg()
    t0 = time.monotonic()
    run = _make("demo-real", "DEMO_SIZE=small", f"DEMO_REAL={out}", timeout=900)
    took = time.monotonic() - t0
    print(f"make demo-real DEMO_SIZE=small: {took:.1f} s (load average at start {load[0]:.2f}, "
          f"at end {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs)")
    print(run.stdout[-6000:])
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]

    for name in ("eval-bench.json", "eval-bench.md", "eval-bench.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "target" / "config.json").exists() and (out / "drafter" / "config.json").exists()
    report = json.loads((out / "eval-bench.json").read_text())
    (export,) = report["exports"]
    assert export["strict_load"]["ok"] is True, export["strict_load"]
    sets = ("gsm8k", "humaneval", "mbpp", "mt-bench")
    assert set(export["sets"]) == set(sets), list(export["sets"])
    lossless = {s: export["sets"][s]["lossless"] for s in sets}
    assert all(v["checked"] and v["ok"] and v["equal"] == v["of"] > 0 for v in lossless.values()), lossless

    (baseline,) = report["baselines"]                 # vLLM's n-gram speculator, on the same prompts
    assert baseline["method"] == "ngram", baseline["label"]
    assert set(baseline["sets"]) == set(sets), list(baseline["sets"])
    assert all(baseline["sets"][s]["lossless"]["ok"] for s in sets), {s: baseline["sets"][s]["lossless"] for s in sets}
    assert "ngram" in (out / "eval-bench.md").read_text()

    assert took < LIMIT_S, f"make demo-real DEMO_SIZE=small took {took:.1f} s, over {LIMIT_S} s (load {load[0]:.2f})"
