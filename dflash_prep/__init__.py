"""dflash-prep: offline length-bucketed batching for LLM and drafter training.

Stages, one sub-package each: ``synth`` -> ``tokenize`` (``regenerate`` optional) ->
``analyze`` -> ``pack``. ``formats`` holds each on-disk format (dataset, lengths, plan,
manifest) with its constants, writer and reader, and the guarded file I/O; ``objectives``
what each training objective needs on the data side; ``verify`` checks the formats in full.
``cli`` sits on top and only parses and delegates. Importing this package imports neither
torch nor triton.

``dflash_prep.kernels`` (attention) and ``dflash_prep.train`` (the trainer) are the
repository's top-level ``kernels/`` and ``train/`` folders, reached through the git-tracked
directory symlinks ``dflash_prep/kernels`` and ``dflash_prep/train``: a source checkout run
with ``PYTHONPATH=.`` and an installed wheel (which copies the files) resolve the same names.
A checkout also has ``dflash_prep.bench`` and ``dflash_prep.tests`` (the wheel leaves them out).
From the repository root their bare names never load the checkout: ``kernels/``, ``train/`` and
``bench/`` hand the bare name over to an installed package of that name (:mod:`.bare_name`), and
``tests/`` has no ``__init__.py`` (docs/reliability.md#one-import-name).
"""

from ._version import __version__

__all__ = ["__version__"]
