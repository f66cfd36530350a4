"""``--help`` is readable at 80 columns: options grouped in panels, no help cell cut short."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _help(*args: str) -> str:
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(ROOT), "TERM": "dumb"}
    r = subprocess.run([sys.executable, "-m", *args, "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("args, panels", [
    (("dflash_prep.cli", "pack"), ("Inputs and outputs", "Steps and ranks", "Layout and budget", "Objective")),
    (("dflash_prep.train",), ("Data", "Model", "Optimizer", "Run", "Objective")),
    (("dflash_prep.cli", "extract"), ("Inputs and outputs", "Objective", "Engine (vLLM)")),
])
def test_help_fits_80_columns_in_panels(args, panels):
    out = _help(*args)
    assert "…" not in out, "a help cell or metavar is cut short at 80 columns:\n" + out
    assert max(len(line) for line in out.splitlines()) <= 80
    for p in panels:
        assert f"─ {p} ─" in out, f"no {p!r} panel in:\n{out}"


def test_every_trainer_option_comes_from_the_config():
    """Each TrainConfig field with a flag is in --help, with the field's own default."""
    from dataclasses import fields

    from dflash_prep.train.config import TrainConfig

    out = " ".join(_help("dflash_prep.train").split())
    for f in fields(TrainConfig):
        if f.metadata.get("cli", True):
            flag = (f.metadata.get("flag") or "--" + f.name.replace("_", "-")).split("/")[0]
            assert flag in out, flag
    assert "[default: 0.003]" in out and "[default: 2048]" in out     # lr, ce_chunk: the dataclass's defaults
