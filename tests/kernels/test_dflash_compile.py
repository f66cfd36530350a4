"""The DFlash kernels compile for an H100/H200 (sm_90) without a GPU, as in test_compile.py:
Triton's ahead-of-time path down to a ptxas cubin, at the fixed GPU tile shapes, in a
subprocess (this session defines the kernels under ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import pytest

from .test_compile import SM90_SMEM, _compile_script

SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dflash_prep.kernels import dflash
from dflash_prep.kernels.dflash_fwd import dflash_fwd_kernel
from dflash_prep.kernels.dflash_bwd import dflash_bwd_dkdv_ctx_kernel, dflash_bwd_dq_kernel

dtype, dims, block_sizes = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], [int(x) for x in sys.argv[3].split(",")]
I32 = ("CU_CTX", "CU_BLK", "ANCHORS", "CU_TILES")

def signature(fn, consts):
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in I32:
            sig[name] = "*i32"
        elif name in ("LSE", "DELTA"):
            sig[name] = "*fp32"
        elif name.isupper():
            sig[name] = "*" + dtype
        else:
            sig[name] = "fp32" if name in ("qk_scale", "sm_scale") else "i32"
    return sig

out = []
for d in dims:
    for b in block_sizes:
        for kernel, name in ((dflash_fwd_kernel, "fwd"), (dflash_bwd_dq_kernel, "dq"), (dflash_bwd_dkdv_ctx_kernel, "dkdv")):
            bm, bn, warps, stages = dflash.FIXED_BLOCKS[128 if d > 64 else 64][name]
            if name != "dkdv":
                bm = max(bm, b)
            consts = dict(HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, BLOCK_SIZE=b, UPCAST=False,
                          PRECISION="ieee" if dtype == "fp32" else "tf32")
            src = ASTSource(fn=kernel, signature=signature(kernel, consts),
                            constexprs={(kernel.arg_names.index(k),): v for k, v in consts.items()})
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                      options=dict(num_warps=warps, num_stages=stages))
            out.append(dict(kernel=name, d=d, block_size=b, blocks=[bm, bn], shared=compiled.metadata.shared,
                            ptx="ld.global" in compiled.asm["ptx"]))
print(json.dumps(out))
"""


def _check(results: list[dict]) -> None:
    assert {r["kernel"] for r in results} == {"fwd", "dq", "dkdv"}
    for r in results:
        assert r["ptx"], f"{r}: no global loads in the PTX"
        assert 0 < r["shared"] <= SM90_SMEM, f"{r}: {r['shared']} bytes of shared memory do not fit sm_90"


def test_dflash_kernels_compile_for_sm90_bf16_d128_b16():
    _check(_compile_script(SCRIPT, "bf16", "128", "16"))


@pytest.mark.slow
def test_dflash_kernels_compile_for_sm90_every_dtype_head_dim_and_block_size():
    for dtype in ("bf16", "fp16", "fp32"):
        _check(_compile_script(SCRIPT, dtype, "64,128", "4,16,128"))
