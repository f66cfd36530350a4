"""Compiled DFlash kernels on a real GPU against the fp32 reference, at sizes the interpreter cannot reach.

Marked ``gpu``: skipped without CUDA, excluded from ``make test``. Runs the GPU check's own
correctness routine (bench.attention_dflash) in a subprocess without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import torch
from dflash_prep.bench.attention_dflash import DFlashBenchConfig, correctness, make_case

for (s, n), b, heads, d in [((1024, 64), 16, (32, 8), 128), ((700, 300), 4, (8, 2), 64), ((333, 40), 8, (4, 1), 128)]:
    cfg = DFlashBenchConfig(block_size=b, heads_q=heads[0], heads_kv=heads[1], head_dim=d)
    leaves, meta = make_case(cfg, s, n, torch.device("cuda"))
    do = torch.randn_like(leaves[0])
    res = correctness(leaves, meta, b, do)
    assert res["passed"], (s, n, b, heads, d, res)
    print("ok", s, n, b, heads, d, flush=True)
"""


@pytest.mark.gpu
def test_compiled_dflash_kernels_match_reference_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1200)
    if proc.returncode:
        pytest.fail(f"GPU check failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    assert proc.stdout.count("ok ") == 3
