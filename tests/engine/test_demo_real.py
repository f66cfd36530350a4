"""``make demo-real DEMO_SIZE=small``: the real-target demo end to end as CI's smoke run.

SmolLM2-135M-Instruct from ``make real-target`` (converted once; the conversion is not timed):
a few training prompts answered by the target, tokenized with its chat template, packed, a few
drafter steps, the export served by a real vLLM (``.venv-vllm``) on every shipped set beside vLLM's
n-gram speculator. It asserts what a user reads off the result: the export loaded strictly, every
set lossless, the n-gram rows (lossless too), the three report files, and
the time, printed with the machine's load average: about 3 minutes on the 2-core machine with
nothing beside it (its budget, ``BUDGET_S``, is 4; docs/benchmarks.md#demo-and-tests has the
figure). A loaded machine mostly slows vLLM's three starts, and CI runs this beside other suites,
so the assertion is the looser ``LIMIT_S``: it still fails a small run that does a default run's
work (tens of minutes). ``make test-engines`` runs it.
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
BUDGET_S = 240
"""The smoke run's budget on a 2-core machine with nothing beside it (printed against the time)."""
LIMIT_S = 600
"""What the test asserts: the budget with room for CI's load (three vLLM starts at 45-110 s each
at a load average of 5-8, against 20-40 s on a quiet machine)."""


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
    print(f"make demo-real DEMO_SIZE=small: {took:.1f} s, budget {BUDGET_S} s (load average at start "
          f"{load[0]:.2f}, at end {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs)")
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
