"""Kernel tests run the Triton kernels on CPU through Triton's interpreter.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is defined, so it is set here,
before any test module imports ``dflash_prep.kernels.flash`` (which the ``kernels`` package imports
lazily). On a machine with CUDA the compiled kernels are tested instead (the interpreter is
chosen only without a GPU, unless ``TRITON_INTERPRET`` is already set).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
