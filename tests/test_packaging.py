"""The wheel and the sdist: built offline, the wheel holds every module of the checkout once under one
top-level name and nothing else, the sdist builds the same wheel, and the wheel installed into a plain
venv runs its entry points outside the checkout; a source checkout resolves the same names."""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


#: What the checkout holds under the shipped trees but the wheel leaves out, and why.
NOT_SHIPPED = {"train/recipes/": "shell recipes run from a checkout (they write demo folders beside it)"}
#: Package data: shipped files that are not modules (pyproject's [tool.setuptools.package-data]).
DATA = ("dflash_prep/docs/*.md", "train/README.md", "train/configs/*.toml", "dflash_prep/evalsets/manifest.json",
        "dflash_prep/evalsets/data/*.jsonl.gz", "dflash_prep/evalsets/NOTICE", "dflash_prep/trainsets/manifest.json",
        "dflash_prep/trainsets/data/*.jsonl.gz", "dflash_prep/trainsets/NOTICE")


def _checkout_files() -> list[str]:
    """What a fresh clone of this tree holds: tracked files and new ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True, timeout=60).stdout.decode()
    return sorted(f for f in out.split("\0") if f and os.path.lexists(ROOT / f))


def _copy_checkout(dst: Path) -> None:
    """The checkout's files, symbolic links kept as links (setuptools writes build/ and *.egg-info
    into the tree it builds, so the build runs on a copy)."""
    for f in _checkout_files():
        src, out = ROOT / f, dst / f
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), out)
        else:
            shutil.copy2(src, out)


def _expected_wheel_files() -> set[str]:
    """Each module of dflash_prep/, kernels/ and train/ (the last two as dflash_prep.kernels and
    dflash_prep.train), and the package data; bench/ and tests/ stay out."""
    want, left = set(), []
    for f in _checkout_files():
        top = f.split("/")[0]
        if top not in ("dflash_prep", "kernels", "train") or (ROOT / f).is_symlink():
            continue
        name = f if top == "dflash_prep" else f"dflash_prep/{f}"
        if f.endswith(".py") or any(fnmatch.fnmatch(f, pat) for pat in DATA):
            want.add(name)
        elif not any(f.startswith(d) for d in NOT_SHIPPED):
            left.append(f)
    assert not left, f"files under the shipped trees that neither ship nor are listed in NOT_SHIPPED: {left}"
    return want


def _run(cmd, **kw) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
    assert r.returncode == 0, f"{cmd}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def _pip_wheel(src: Path, out: Path) -> Path:
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w",
          str(out), str(src)])
    (whl,) = out.glob("dflash_prep-*.whl")
    return whl


def _members(whl: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        assert len(names) == len(set(names)), f"paths in the wheel twice: {sorted(n for n in names if names.count(n) > 1)}"
        return {n: z.read(n) for n in names}


@pytest.mark.timeout(300)
def test_the_wheel_and_the_sdist_install_and_run_outside_the_checkout(tmp_path):
    """Build the sdist and the wheel offline (setuptools' PEP 517 hooks, pip without an index), build
    a second wheel from the sdist alone, install the wheel into a plain venv outside the checkout and
    run the entry points there, from a folder outside it. The venv sees .venv's site-packages for
    the dependencies through a .pth file (the .pth files there, the editable install's among them,
    do not run), so dflash_prep itself can only come from the wheel."""
    from dflash_prep import __version__

    src = tmp_path / "src"
    _copy_checkout(src)
    sdist_dir = tmp_path / "sdist"
    _run([sys.executable, "-c", "import sys\nfrom setuptools import build_meta\nprint(build_meta.build_sdist(sys.argv[1]))",
          str(sdist_dir)], cwd=src)
    (sdist,) = sdist_dir.glob("dflash_prep-*.tar.gz")
    whl = _pip_wheel(src, tmp_path / "wheel")

    # every module exactly once, nothing missing, one top-level name, no test or bench code
    files = _members(whl)
    top = {n.split("/")[0] for n in files if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"dflash_prep"}, top
    info = next(n for n in files if n.endswith(".dist-info/top_level.txt"))
    assert files[info].decode().split() == ["dflash_prep"]
    shipped = {n for n in files if not n.split("/")[0].endswith(".dist-info")}
    want = _expected_wheel_files()
    assert not want - shipped, f"missing from the wheel: {sorted(want - shipped)}"
    assert not shipped - want, f"in the wheel but no module of the checkout: {sorted(shipped - want)}"
    assert not any(n.startswith(("dflash_prep/bench/", "dflash_prep/tests/")) for n in files)

    # the sdist alone builds the same wheel, byte for byte member by member
    with tarfile.open(sdist) as t:
        t.extractall(tmp_path / "unpacked", filter="tar")
    (unpacked,) = (tmp_path / "unpacked").iterdir()
    assert _members(_pip_wheel(unpacked, tmp_path / "wheel-from-sdist")) == files

    # a plain venv outside the checkout: the project only from the wheel
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index", str(whl)])
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    deps = Path(_run([sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    (site / "zz_dflash_prep_test_deps.pth").write_text(f"{deps}\n")
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH", "PYTHONHOME")}
    env.update(COLUMNS="200", NUMBA_CACHE_DIR=str(tmp_path / "numba"))

    where = json.loads(_run([str(py), "-c", "import json, importlib.metadata as md, dflash_prep, dflash_prep.kernels.attention as k, "
                             "dflash_prep.train.loop as t\nprint(json.dumps([dflash_prep.__file__, k.__file__, t.__file__, "
                             "md.version('dflash-prep'), str(md.distribution('dflash-prep')._path)]))"], cwd=away, env=env))
    for f in where[:3] + where[4:]:
        assert Path(f).resolve().is_relative_to(site.resolve()), where
    assert where[3] == __version__, where
    exe = venv / "bin" / "dflash-prep"
    assert _run([str(exe), "--version"], cwd=away, env=env).strip() == f"dflash-prep {__version__}"
    out = _run([str(exe), "--help"], cwd=away, env=env)
    assert all(c in out for c in ("tokenize", "pack", "extract", "evaluate")), out
    out = _run([str(py), "-m", "dflash_prep.train", "--help"], cwd=away, env=env)
    assert "--objective" in out and "--draft-layers" in out, out


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
