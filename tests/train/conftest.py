"""Trainer tests: make ``train_fakes`` importable (also in spawned workers) and keep CPU use small.

The fakes live beside the tests rather than in a package, so this folder goes on
``sys.path`` (spawned processes inherit ``sys.path`` from the parent).
"""

import sys
from pathlib import Path

import torch

HERE = str(Path(__file__).parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

torch.set_num_threads(1)  # the test machine has 2 cores shared with other engineers
