"""`make test-engines` never skips to green: with DFLASH_PREP_ENGINE_TESTS=require (what the target
sets) a missing engine stops the run with exit 1 and one line naming it; without it, a plain run
skips the engine tests with the fix. Runs in `make test` (it starts no engine)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, **env) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "engine", *args,
           "tests/engine/test_vllm.py::test_a_server_that_cannot_start_fails_fast_and_leaves_no_process"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "DFLASH_PREP_VLLM_PYTHON": "/nonexistent/python", **env})


@pytest.mark.parametrize("workers", [(), ("-n", "2", "--dist", "loadfile")], ids=["serial", "xdist"])
def test_a_missing_engine_fails_the_engine_target_naming_it(workers):
    # make test-engines runs pytest-xdist workers: there the controller checks, before any worker starts
    r = _run(*workers, DFLASH_PREP_ENGINE_TESTS="require")
    assert r.returncode == 1, r.stdout[-2000:]
    assert "the engine tests need vLLM and found none" in r.stdout and "/nonexistent/python" in r.stdout, r.stdout


def test_without_the_requirement_a_missing_engine_is_a_skip_with_the_fix():
    r = _run(DFLASH_PREP_ENGINE_TESTS="")
    assert r.returncode == 0, r.stdout[-2000:]
    assert "1 skipped" in r.stdout and "make venv-vllm" in r.stdout, r.stdout
