"""Compiled kernels on a real GPU against the fp32 reference, at lengths the interpreter cannot reach.

Marked ``gpu``: skipped without CUDA, excluded from ``make test``. Runs in a subprocess
without ``TRITON_INTERPRET`` (this test session defines the kernels interpreted).
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
import sys
import torch
sys.path.insert(0, sys.argv[1])
from helpers import close_to_reference, make_padded, make_varlen, reference_pair, run
from dflash_prep.kernels.attention import attention_padded, attention_varlen, force_backend

NAMES = ("o", "dq", "dk", "dv")
cuda = lambda ts: [t.cuda() for t in ts]

def check(layout, shape, heads, d, dtype, causal=True):
    if layout == "varlen":
        q, k, v, do, cu, max_len = make_varlen(shape, *heads, d, dtype)
        q, k, v, do, cu = cuda((q, k, v, do, cu))
        meta, fn = (cu, max_len), attention_varlen
    else:
        q, k, v, do, lens = make_padded(shape, max(shape), *heads, d, dtype, transposed=True)
        q, k, v, do, lens = cuda((q, k, v, do, lens))
        meta, fn = (lens,), attention_padded
    with force_backend("triton"):
        got = run(fn, q, k, v, do, *meta, causal=causal)
        again = run(fn, q, k, v, do, *meta, causal=causal)
    f32, same = reference_pair(layout, q, k, v, do, meta, causal)
    for name, g, a, r, s in zip(NAMES, got, again, f32, same):
        close_to_reference(f"{layout} {shape} {heads} D={d} {dtype} causal={causal} {name}", g, r, s)
        assert torch.equal(g, a), f"{name} is not bitwise deterministic"
    print("ok", layout, heads, d, dtype, causal, flush=True)

docs = [1, 17, 0, 63, 130, 256, 1000, 1500]
for d in (64, 128):
    check("varlen", docs, (8, 2), d, torch.bfloat16)
    check("padded", [1024, 0, 700, 1], (4, 1), d, torch.bfloat16)
check("varlen", docs, (2, 2), 128, torch.float16)
check("varlen", docs, (4, 1), 32, torch.float32)
check("padded", [513, 64], (2, 2), 64, torch.bfloat16, causal=False)
"""


@pytest.mark.gpu
def test_compiled_kernels_match_reference_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(Path(__file__).parent)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    if proc.returncode:
        pytest.fail(f"GPU check failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    assert proc.stdout.count("ok ") == 7
