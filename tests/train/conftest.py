"""Trainer tests: keep CPU use small; Triton's interpreter without a GPU.

The fakes and fixtures beside the tests are imported as ``dflash_prep.tests.train.<module>``, like every
test helper (through the checkout's symlink ``dflash_prep/tests``; spawned
workers inherit it).
"""

import os

import torch

# --attn triton on CPU runs Triton's interpreter, which must be chosen before triton is imported;
# on a GPU machine the compiled kernels run (the gpu-marked tests)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
