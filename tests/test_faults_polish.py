"""Fault injection, issue 29 (the data side): a ``clean`` that cannot remove something says so
and exits 1; ``dflash-prep --help`` / ``--version`` start without numba, torch or pyarrow; and
``make demo-dflash TARGET_RANKS=1`` keeps the plain demo's one drafter rank.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


def _pin(path: Path) -> bool:
    """Make ``path`` undeletable by this process: ``chattr +i`` for root (who ignores modes),
    a read-only parent folder otherwise. False when the filesystem cannot."""
    if os.geteuid() == 0:
        return subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0
    path.parent.chmod(0o500)
    return True


def _unpin(path: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)
    else:
        path.parent.chmod(0o700)


def test_clean_reports_each_path_it_could_not_remove_and_exits_1(tmp_path):
    from typer.testing import CliRunner

    from dflash_prep.cli import app

    dead = _dead_pid()
    stuck, gone = tmp_path / f".data.{dead}.abcd1234.tmp", tmp_path / f".man.{dead}.efgh5678.tmp"
    for d in (stuck, gone):
        (d / "inner").mkdir(parents=True)
        (d / "inner" / "big.bin").write_bytes(b"0" * 4096)
    pinned = stuck / "inner" / "big.bin"
    if not _pin(pinned):
        pytest.skip("cannot make a file undeletable on this filesystem (chattr +i)")
    try:
        r = CliRunner().invoke(app, ["clean", str(tmp_path)])
    finally:
        _unpin(pinned)
    err = r.stderr
    assert r.exit_code == 1, (r.exit_code, r.output, err)
    lines = [x for x in err.splitlines() if x.startswith("error: could not remove")]
    assert len(lines) == 1 and str(stuck) in lines[0] and "big.bin" in lines[0], err
    assert "Traceback" not in err and not gone.exists() and stuck.exists()
    assert "1 of 2 stale item(s) could not be removed" in err, err


@pytest.mark.parametrize("args", [["--help"], ["--version"]])
def test_cli_help_and_version_import_no_numba_torch_or_pyarrow(args):
    code = ("import sys, runpy\n"
            f"sys.argv = ['dflash-prep', *{args!r}]\n"
            "try:\n    runpy.run_module('dflash_prep.cli', run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "print(' '.join(sorted(m for m in ('numba', 'torch', 'pyarrow') if m in sys.modules)) or 'none')\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="80", TERM="dumb")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "none", f"`dflash-prep {' '.join(args)}` imported: {r.stdout}"


def _demo_ranks(**env: str) -> tuple[str, str]:
    """TARGET_RANKS and DRAFTER_RANKS as train/recipes/demo_dflash.sh resolves them (its own lines)."""
    lines = [x for x in (REPO / "train/recipes/demo_dflash.sh").read_text().splitlines()
             if x.startswith(("TARGET_RANKS=", "DRAFTER_RANKS="))]
    assert len(lines) == 2, lines
    script = "\n".join(lines) + '\necho "$TARGET_RANKS $DRAFTER_RANKS"\n'
    base = {k: v for k, v in os.environ.items() if k not in ("TARGET_RANKS", "DRAFTER_RANKS")}
    r = subprocess.run(["bash", "-c", script], env={**base, **env}, capture_output=True, text=True, check=True)
    k, w = r.stdout.split()
    return k, w


def test_demo_dflash_with_a_target_rank_keeps_one_drafter_rank():
    assert _demo_ranks() == ("0", "1")
    assert _demo_ranks(TARGET_RANKS="1") == ("1", "1"), "TARGET_RANKS=1 changed the demo's data plan (W)"
    assert _demo_ranks(TARGET_RANKS="1", DRAFTER_RANKS="2") == ("1", "2")
    assert _demo_ranks(DRAFTER_RANKS="2") == ("0", "2")
