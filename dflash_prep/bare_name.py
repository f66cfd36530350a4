"""The bare names of the repository's code folders belong to other distributions.

``kernels/``, ``train/`` and ``bench/`` sit at the repository's top level (the design card) and are
this project's ``dflash_prep.kernels``, ``dflash_prep.train`` and ``dflash_prep.bench``. Their
names are also distributions' names (Hugging Face's ``kernels``, which transformers >= 5.25
imports), and Python puts the repository root on ``sys.path`` for ``python -c``/``-m`` run from it,
for ``PYTHONPATH=.`` and for pytest. So each folder's ``__init__.py`` checks the name it is imported
under: as ``dflash_prep.<folder>`` it is the project's package; under the bare name it calls
:func:`hand_over`, which loads the package of that name that Python would have found had the
folder not been there (an installed distribution), or, without one, an empty namespace module.
The bare name never loads the checkout, whatever the interpreter, its ``sys.path`` or the working
directory (docs/reliability.md#one-import-name).

``tests/`` stays a folder without ``__init__.py``: pytest imports the test modules under it, and an
``__init__.py`` would make it name them ``tests.*`` and import that package.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def _same_file(origin: str | None, own: str) -> bool:
    return origin is not None and os.path.realpath(origin) == own


def _find_elsewhere(name: str, own: str):
    """The spec Python's finders give ``name`` once the checkout's own package is skipped: the
    first regular package or module in ``sys.meta_path`` order (``sys.path`` entry by entry for
    the path finder), as the import system itself would choose; None when there is none."""
    for finder in sys.meta_path:
        if finder is importlib.machinery.PathFinder:
            specs = (finder.find_spec(name, [entry]) for entry in sys.path)
        else:
            find = getattr(finder, "find_spec", None)
            specs = iter(() if find is None else (find(name, None),))
        for spec in specs:
            if spec is not None and spec.loader is not None and spec.origin not in (None, "namespace") \
                    and not _same_file(spec.origin, own):
                return spec
    return None


def origin(name: str) -> str | None:
    """Where ``import name`` loads code from, found without importing it (the folder's hand-over
    followed): a file, or None where the import fails or gives only a namespace module (a folder
    without ``__init__.py``, or the hand-over's empty one: no code runs)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.has_location:
        return None
    own = os.path.realpath(os.path.join(os.path.dirname(__file__), name, "__init__.py"))
    if _same_file(spec.origin, own):                 # this project's folder: what it hands over to
        spec = _find_elsewhere(name, own)
    return spec.origin if spec is not None else None


def hand_over(name: str, own_file: str) -> None:
    """Called by a code folder's ``__init__.py`` imported as the bare ``name``: replace the module
    being imported by the other package of that name. Where there is none, by an empty namespace
    module: what Python gives for a folder without ``__init__.py``, without the folder (no
    ``__file__``, no version, an empty ``__path__``: nothing can be imported under it). Not an
    ``ImportError``: libraries probe with ``find_spec`` (which sees this folder) and then import,
    and transformers reads "imported, no file, no version" as a shadowing folder, not an install,
    but does not catch an import error there."""
    own = os.path.realpath(own_file)
    spec = _find_elsewhere(name, own)
    if spec is None:                             # what a folder without __init__.py gives, minus the folder
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = []
        sys.modules[name] = importlib.util.module_from_spec(spec)
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module                   # the import statement returns what sys.modules holds
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
