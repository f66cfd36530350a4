"""``train/recipes/demo_dflash.sh``'s ``BASE_FROM``: a folder whose steps 1-5 were not finished, or were
made with other knobs, or that is the run's own output folder, is refused in one line before
anything of ``DEMO_DFLASH`` is touched. The run on a base (``BASE_ONLY=1``, then ``BASE_FROM``) is the
engine suite's: its three ``make demo-dflash`` tests share one (tests/engine/conftest.py ``demo_base``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_ARGS = "--vocab-size 512 --hidden 64 --layers 4 --heads 2 --kv-heads 1 --head-dim 32 --intermediate 192"


def _knobs(**over: str) -> str:
    """A base.knobs as the recipe writes it, at the recipe's defaults except ``over``."""
    k = {"N": "2000", "HELD": "32", "LM_STEPS": "400", "LM_EPOCHS": "3", "REGEN_TOKENS": "96", "BUDGET": "2048",
         "TARGET_ARGS": TARGET_ARGS} | over
    return "".join(f"{n}={v}\n" for n, v in k.items())


def _run(tmp_path: Path, base: Path, out: Path, **env: str) -> subprocess.CompletedProcess:
    drop = ("N", "HELD", "LM_STEPS", "LM_EPOCHS", "REGEN_TOKENS", "BUDGET", "TARGET_ARGS", "BASE_ONLY")
    clean = {k: v for k, v in os.environ.items() if k not in drop}
    return subprocess.run(["bash", str(REPO / "train/recipes/demo_dflash.sh")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, env={**clean, "PY": sys.executable, "ENGINE_EVAL": "0",
                                                      "BASE_FROM": str(base), "DEMO_DFLASH": str(out), **env})


def _one_error(r: subprocess.CompletedProcess) -> str:
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: BASE_FROM="), r.stderr
    return lines[0]


def test_an_unfinished_base_is_refused_and_nothing_is_made(tmp_path):
    (tmp_path / "base" / "target").mkdir(parents=True)            # steps 1-5 began, never finished
    line = _one_error(_run(tmp_path, tmp_path / "base", tmp_path / "out"))
    assert "holds no finished steps 1-5 of this recipe (no base.knobs)" in line and "BASE_ONLY=1" in line
    assert not (tmp_path / "out").exists()


def test_a_base_of_other_knobs_is_refused_naming_each(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "base.knobs").write_text(_knobs(N="600", LM_STEPS="200"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("the user's")
    line = _one_error(_run(tmp_path, base, out, N="2000"))
    assert "was made with other knobs: N: 600 there, 2000 here; LM_STEPS: 200 there, 400 here." in line, line
    assert [p.name for p in out.iterdir()] == ["mine.txt"]        # refused before the folder was claimed

    (base / "base.knobs").write_text(_knobs(N="600", LM_STEPS="200").replace("HELD=32\n", ""))
    line = _one_error(_run(tmp_path, base, out, N="600", LM_STEPS="200"))
    assert "other knobs: HELD: none there, 32 here." in line, line


def test_the_output_folder_itself_is_refused_as_its_base(tmp_path):
    base = tmp_path / "demo"
    base.mkdir()
    (base / ".demo-dflash").touch()
    (base / "base.knobs").write_text(_knobs())
    (tmp_path / "link").symlink_to(base, target_is_directory=True)   # the same folder by another name
    line = _one_error(_run(tmp_path, base, tmp_path / "link"))
    assert f"is DEMO_DFLASH={tmp_path / 'link'} itself, which the run starts by emptying" in line, line
    assert sorted(p.name for p in base.iterdir()) == [".demo-dflash", "base.knobs"]
