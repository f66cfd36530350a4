"""The kernels compile for an H100/H200 (sm_90) without a GPU: Triton's ahead-of-time path
(TTIR -> TTGIR -> LLVM -> PTX -> ptxas cubin). This catches what the interpreter cannot:
type errors in constexpr branches, layouts, shared-memory overflows. It runs in a
subprocess because this test session imports the kernels under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SM90_SMEM = 232448  # bytes of shared memory a block may use on sm_90

SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dflash_prep.kernels import flash
from dflash_prep.kernels.flash_fwd import attn_fwd_kernel
from dflash_prep.kernels.flash_bwd import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, attn_bwd_preprocess_kernel

dtype, dims, every_config = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], sys.argv[3] == "all"
FP32 = ("LSE", "DELTA")

def signature(fn, consts):
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ("STARTS", "LENS"):
            sig[name] = "*i32"
        elif name in FP32:
            sig[name] = "*fp32"
        elif name.isupper():
            sig[name] = "*" + dtype
        else:
            sig[name] = "fp32" if name in ("qk_scale", "sm_scale") else "i32"
    return sig

def pick(configs, fixed):
    if every_config:
        return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in configs]
    return [fixed]

out = []
for d in dims:
    jobs = [(attn_bwd_preprocess_kernel, dict(HEAD_DIM=d, BLOCK_M=flash.PREPROCESS_BLOCK_M), 4, 2)]
    for causal in ((True, False) if every_config else (True,)):
        common = dict(HEAD_DIM=d, CAUSAL=causal, UPCAST=False, PRECISION="ieee" if dtype == "fp32" else "tf32")
        for kernel, configs, name in ((attn_fwd_kernel, flash.FWD_CONFIGS, "fwd"),
                                      (attn_bwd_dkdv_kernel, flash.DKDV_CONFIGS, "dkdv"),
                                      (attn_bwd_dq_kernel, flash.DQ_CONFIGS, "dq")):
            fixed = (*flash.FIXED_BLOCKS[name], flash.FIXED_WARPS[name], 3)
            for bm, bn, w, s in pick(configs, fixed):
                jobs.append((kernel, dict(common, BLOCK_M=bm, BLOCK_N=bn), w, s))
    for kernel, consts, warps, stages in jobs:
        src = ASTSource(fn=kernel, signature=signature(kernel, consts),
                        constexprs={(kernel.arg_names.index(k),): v for k, v in consts.items()})
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
        out.append(dict(kernel=kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__, d=d,
                        consts={k: v for k, v in consts.items() if k.startswith("BLOCK") or k == "CAUSAL"},
                        shared=compiled.metadata.shared, ptx="ld.global" in compiled.asm["ptx"]))
print(json.dumps(out))
"""


def _compile(dtype: str, dims: str, which: str) -> list[dict]:
    return _compile_script(SCRIPT, dtype, dims, which)


def _compile_script(script: str, *argv: str) -> list[dict]:
    """Run a compile ``script`` (argv after it) without the interpreter; its last stdout line is JSON."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", script, *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode:
        pytest.fail(f"sm_90 compile failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check(results: list[dict]) -> None:
    assert results
    for r in results:
        assert r["ptx"], f"{r}: no global loads in the PTX"
        assert 0 < r["shared"] <= SM90_SMEM, f"{r}: {r['shared']} bytes of shared memory do not fit sm_90"


def test_default_configs_compile_for_sm90_bf16():
    _check(_compile("bf16", "64", "fixed"))


@pytest.mark.slow
def test_every_autotune_config_compiles_for_sm90_bf16_causal_and_not():
    _check(_compile("bf16", "64,128", "all"))
