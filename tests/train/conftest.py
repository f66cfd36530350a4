"""Trainer tests: make ``train_fakes`` importable (also in spawned workers), keep CPU use small.

The fakes live beside the tests rather than in a package, so this folder goes on
``sys.path`` (spawned processes inherit ``sys.path`` from the parent).
"""

import os
import sys
from pathlib import Path

import torch

# --attn triton on CPU runs Triton's interpreter, which must be chosen before triton is imported;
# on a GPU machine the compiled kernels run (the gpu-marked tests)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HERE = str(Path(__file__).parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

torch.set_num_threads(1)  # the test machine has 2 cores shared with other engineers
