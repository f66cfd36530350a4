"""One import name: the repository's top-level folders never shadow installed distributions.

``kernels``, ``train``, ``bench`` and ``tests`` are names other distributions own (transformers >= 5.25
imports Hugging Face's ``kernels``). Python puts the repository root on ``sys.path`` for ``python -m``
run from it, ``PYTHONPATH=.`` (the GPU machine) and pytest. So ``kernels/``, ``train/`` and ``bench/``
carry an ``__init__.py`` that, imported under the bare name, hands the import over to the package of
that name installed elsewhere or an empty namespace module (dflash_prep/bare_name.py);
``tests/`` has none (pytest names its modules). The code is reached as ``dflash_prep.*`` through the
checkout's symlinks (docs/reliability.md#one-import-name).

The end-to-end test installs a distribution named like each folder (a tiny one written here, dist-info
and all; Hugging Face's real ``kernels`` where transformers pulled it in), then runs, from the root:
the GPU script's import check, a recipe's first step, ``python -m dflash_prep.train`` and pytest's
collection, and checks what each name resolved to.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_prep.bench.gpu_all import FOLDERS, import_check

ROOT = Path(__file__).resolve().parents[1]
FOREIGN_ENV = "DFLASH_PREP_FOREIGN_SITE"  # set by the end-to-end test for its pytest subprocess


def _installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def _foreign_site(site: Path) -> dict[str, str]:
    """A distribution named like each folder, in ``site`` (``pip install --target`` lays it out the
    same way), except where one is installed already (HF ``kernels``); ``{name: its package folder}``."""
    where = {}
    for name in FOLDERS:
        if _installed(name):
            where[name] = str(Path(importlib.util.find_spec(name).origin).parent)
            continue
        pkg = site / name
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(f'"""A distribution named {name}, not dflash-prep."""\nOWNER = "foreign"\n')
        info = site / f"{name}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        (info / "top_level.txt").write_text(f"{name}\n")
        (info / "INSTALLER").write_text("test\n")
        (info / "RECORD").write_text(f"{name}/__init__.py,,\n{info.name}/METADATA,,\n")
        where[name] = str(pkg)
    return where


def test_each_code_folder_hands_its_bare_name_over():
    """Only ``dflash_prep/`` is the project's package at the root; ``kernels/``, ``train/`` and
    ``bench/`` carry the hand-over ``__init__.py`` (dflash_prep/bare_name.py), ``tests/`` none."""
    handed = {}
    for d in sorted(p for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if d.name != "dflash_prep" and not d.is_symlink() and (d / "__init__.py").exists():
            handed[d.name] = (d / "__init__.py").read_text()
    assert sorted(handed) == sorted(n for n in FOLDERS if n != "tests"), sorted(handed)
    for name, text in handed.items():
        assert f'if __name__ == "{name}":' in text and "hand_over(__name__, __file__)" in text, name
    for name in FOLDERS:
        link = ROOT / "dflash_prep" / name
        assert link.is_symlink() and link.resolve() == (ROOT / name).resolve(), link


def test_without_a_distribution_of_that_name_the_bare_name_loads_nothing():
    """From the root with no site-packages (``-S``): nothing else is named ``kernels``, ``train`` or
    ``bench``, and each bare import gives an empty namespace module (no file, nothing under it:
    transformers' availability probe says not installed, as for a folder without ``__init__.py``);
    ``python -m train`` runs nothing; the project's packages import as before."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    code = ("import importlib, json\nout = {}\n"
            "for name in ('kernels', 'train', 'bench'):\n"
            "    m = importlib.import_module(name)\n"
            "    out[name] = [getattr(m, '__file__', None), list(m.__path__)]\n"
            "    try:\n        importlib.import_module(name + '.loop')\n        out[name].append('imported')\n"
            "    except ModuleNotFoundError as e:\n        out[name].append(str(e))\n"
            "import dflash_prep.kernels, dflash_prep.train, dflash_prep.bench\n"
            "out['ours'] = [m.__name__ for m in (dflash_prep.kernels, dflash_prep.train, dflash_prep.bench)]\n"
            "print(json.dumps(out))")
    got = json.loads(_run([sys.executable, "-S", "-c", code], env).stdout)
    for name in ("kernels", "train", "bench"):
        assert got[name] == [None, [], f"No module named '{name}.loop'"], got
    assert got["ours"] == ["dflash_prep.kernels", "dflash_prep.train", "dflash_prep.bench"]
    r = subprocess.run([sys.executable, "-S", "-m", "train", "--help"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and "No module named train.__main__" in r.stderr, r.stderr[-2000:]


def test_no_module_imports_a_top_level_folder_by_its_bare_name():
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    bad = []
    for f in files:
        path = ROOT / f
        if path.is_symlink() or not path.is_file():
            continue
        for node in ast.walk(ast.parse(path.read_text(), f)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{f}:{node.lineno}: {n}" for n in names if n.split(".")[0] in FOLDERS]
    assert not bad, bad


def test_this_process_resolves_each_name_where_it_is_meant():
    """In pytest itself (and, run by the end-to-end test, with the foreign distributions on the path)."""
    rec = import_check()
    assert rec["passed"], rec
    foreign = os.environ.get(FOREIGN_ENV)
    if foreign:
        for name, where in json.loads(foreign).items():
            if name == "tests" and getattr(sys.modules.get("tests"), "__file__", None) is None:
                continue  # pytest's own placeholder parent of the test modules (tests.<path>): no code
            assert rec["bare"][name] == str(Path(where) / "__init__.py"), (name, rec)


def _run(cmd, env, **kw):
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, **kw)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.timeout(600)
def test_from_the_root_installed_distributions_win(tmp_path):
    where = _foreign_site(tmp_path / "site")
    # PYTHONPATH comes after the root (sys.path[0] for `python -m` from it), as site-packages does
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"), OMP_NUM_THREADS="1")
    env.pop("PYTHONSAFEPATH", None)
    py = [sys.executable, "-m"]

    # the GPU script's import check (the same sys.path as `python3 -m dflash_prep.bench.gpu_all` there)
    _run(py + ["dflash_prep.bench.gpu_all", "--check-imports", "--out", str(tmp_path / "gpu")], env)
    rec = json.loads((tmp_path / "gpu" / "gpu_all.json").read_text())["imports"]
    assert rec["passed"] and rec["transformers"] == "ok", rec
    assert rec["bare"] == {n: str(Path(w) / "__init__.py") for n, w in where.items()}, rec

    # a bare import from the root (the root is sys.path[0], before the distributions): theirs
    out = _run([sys.executable, "-c", "import json, kernels, train, bench\n"
                "print(json.dumps({m.__name__: m.__file__ for m in (kernels, train, bench)}))"], env).stdout
    assert json.loads(out) == {n: str(Path(w) / "__init__.py") for n, w in where.items() if n != "tests"}, out

    # a recipe's first step, as train/recipes/demo_dflash.sh runs it (it imports transformers)
    recipe = (ROOT / "train" / "recipes" / "demo_dflash.sh").read_text()
    assert '$PY -m dflash_prep.train.target_init --out "$OUT/target0" $TARGET_ARGS' in recipe
    target_args = "--vocab-size 512 --hidden 64 --layers 4 --heads 2 --kv-heads 1 --head-dim 32 --intermediate 192"
    assert f"TARGET_ARGS=${{TARGET_ARGS:---{target_args[2:]}}}" in recipe
    _run(py + ["dflash_prep.train.target_init", "--out", str(tmp_path / "target0"), *target_args.split()], env)
    assert (tmp_path / "target0" / "config.json").is_file()

    # python -m dflash_prep.train: the trainer's entry point, its objectives' options included
    out = _run(py + ["dflash_prep.train", "--help"], dict(env, COLUMNS="200")).stdout
    assert "--objective" in out and "--draft-layers" in out

    # pytest's collection and a test run with the foreign distributions installed: the helpers
    # (dflash_prep.tests.*) and transformers import, and the bare names are the foreign ones
    sel = ["tests/test_import_names.py::test_this_process_resolves_each_name_where_it_is_meant",
           "tests/train/test_export.py", "tests/tokenize/test_chat_fidelity.py"]
    out = _run(py + ["pytest", "-q", "-p", "no:cacheprovider", "--collect-only", *sel[1:]], env).stdout
    assert " collected" in out or "tests collected" in out, out[-2000:]
    _run(py + ["pytest", "-q", "-p", "no:cacheprovider", sel[0]], dict(env, **{FOREIGN_ENV: json.dumps(where)}))
