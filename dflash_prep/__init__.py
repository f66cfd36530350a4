"""dflash-prep: offline length-bucketed batching for LLM and drafter training.

Stages (one module each): ``synth`` -> ``tokenize`` -> ``analyze`` -> ``pack``. Each
on-disk format has its constants, writer and reader in one module: ``dataset``, ``plan``,
``manifest``; ``verify`` checks them in full, ``outputs`` guards output folders (ownership,
locks, debris of killed runs). ``cli`` sits on top and only parses and delegates.
Importing this package imports neither torch nor triton.

``dflash_prep.kernels`` (attention) and ``dflash_prep.train`` (the trainer) live in the
repository's top-level ``kernels/`` and ``train/`` folders. An installed wheel maps them
there (pyproject's ``package-dir``); in a source checkout run with ``PYTHONPATH=.`` (the GPU
machine, no install) the two lines below resolve the same names.
"""

import os as _os

from ._version import __version__

_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "kernels")) and _os.path.isfile(
        _os.path.join(_root, "kernels", "__init__.py")) and _os.path.isfile(_os.path.join(_root, "pyproject.toml")):
    __path__.append(_root)   # source checkout: dflash_prep.kernels -> <repo>/kernels, dflash_prep.train -> <repo>/train
del _os, _root

__all__ = ["__version__"]
