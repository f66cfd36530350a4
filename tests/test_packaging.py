"""The wheel adds exactly one top-level import name, and a source checkout resolves the same names."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_installs_only_dflash_prep(tmp_path):
    import shutil

    src = tmp_path / "src"      # build from a copy (links kept): setuptools writes build/ and *.egg-info into the tree
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__",
                                                            ".numba_cache", "demo", "demo-dflash", "results"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(src)], check=True, capture_output=True, timeout=300)
    (whl,) = tmp_path.glob("dflash_prep-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"dflash_prep"}, top
    info = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert zipfile.ZipFile(whl).read(info).decode().split() == ["dflash_prep"]
    for sub in ("dflash_prep/kernels/attention.py", "dflash_prep/train/loader.py", "dflash_prep/docs/definitions.md",
                "dflash_prep/train/configs/gpu-100m.toml"):
        assert sub in names, sub
    assert not any(n.startswith(("bench/", "tests/", "dflash_prep/bench/", "dflash_prep/tests/")) for n in names)


def test_source_checkout_maps_kernels_and_train_under_dflash_prep():
    """Through the directory symlinks, from any working directory, with no install (the GPU machine)."""
    code = ("import dflash_prep, dflash_prep.kernels.attention as k, dflash_prep.train.loop as t, sys, os;"
            "print(os.path.realpath(k.__file__)); print(os.path.realpath(t.__file__)); print('kernels' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd="/", env={"PYTHONPATH": str(ROOT), "PATH": ""},
                         check=True, capture_output=True, text=True, timeout=120).stdout.split()
    assert out == [str(ROOT / "kernels" / "attention.py"), str(ROOT / "train" / "loop.py"), "False"]


def test_cli_version_and_no_torch_at_startup():
    from dflash_prep import __version__

    code = "import sys; from dflash_prep import cli; print('torch' in sys.modules, 'triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stderr
    from typer.testing import CliRunner

    from dflash_prep.cli import app

    r = CliRunner().invoke(app, ["--version"])
    assert r.exit_code == 0 and r.stdout.strip() == f"dflash-prep {__version__}"
