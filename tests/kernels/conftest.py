"""Kernel tests run the Triton kernels on CPU through Triton's interpreter.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is defined, so it is set here,
before any test module imports ``kernels.flash`` (which the ``kernels`` package imports
lazily). Set ``TRITON_INTERPRET=0`` yourself on a GPU machine to test the compiled kernels.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
