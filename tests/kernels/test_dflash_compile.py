"""The DFlash kernels compile for an H100/H200 (sm_90) without a GPU, as in test_compile.py:
Triton's ahead-of-time path down to a ptxas cubin, at the fixed GPU tile shapes, in a
subprocess (this session defines the kernels under ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import pytest

from dflash_prep.tests.kernels.test_compile import SM90_SMEM, _compile_script

SCRIPT = r"""
import json, sys
from dflash_prep.kernels import dflash

dtype, dims, block_sizes = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], [int(x) for x in sys.argv[3].split(",")]
out = []
for d in dims:
    for b in block_sizes:
        for name in dflash.KERNELS:
            bm, bn, warps, stages = dflash.blocks_for(name, dflash.DFlashProblem(
                num_docs=1, heads_q=4, heads_kv=1, head_dim=d, block_size=b, num_blocks=1, ctx_tokens=1, scale=1.0))
            consts = dict(HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, BLOCK_SIZE=b, UPCAST=False,
                          PRECISION="ieee" if dtype == "fp32" else "tf32")
            compiled = dflash.compile_sm90(name, consts, warps=warps, stages=stages, dtype=dtype)
            out.append(dict(kernel=name, d=d, block_size=b, blocks=[bm, bn], shared=compiled.metadata.shared,
                            ptx="ld.global" in compiled.asm["ptx"]))
print(json.dumps(out))
"""


def _check(results: list[dict]) -> None:
    assert {r["kernel"] for r in results} == {"fwd", "dq", "dkdv_blk", "dkdv_ctx"}
    for r in results:
        assert r["ptx"], f"{r}: no global loads in the PTX"
        assert 0 < r["shared"] <= SM90_SMEM, f"{r}: {r['shared']} bytes of shared memory do not fit sm_90"


def test_dflash_kernels_compile_for_sm90_bf16_d128_b16():
    _check(_compile_script(SCRIPT, "bf16", "128", "16"))


@pytest.mark.slow
def test_dflash_kernels_compile_for_sm90_every_dtype_head_dim_and_block_size():
    for dtype in ("bf16", "fp16", "fp32"):
        _check(_compile_script(SCRIPT, dtype, "64,128", "4,16,128"))
