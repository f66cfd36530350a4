"""Launchers and the ``torch.autograd.Function`` of the Triton DFlash attention.

Tensors are ``[rows, heads, D]`` with a contiguous last dim (anything else is copied once);
the kernels take (row, head) strides. The LSE and ``delta`` buffers are fp32 ``[Hq, rows]``.
Outputs and gradients start as zeros: context keys no block sees (at or past a document's
last anchor) get exactly 0 gradient without any work.

Tiles are fixed per kernel (no autotuning: the per-document tile tables depend on the tile
size and no GPU has tuned them yet), so results are bitwise identical run to run and across
processes. A query tile must hold whole blocks: ``BLOCK_M`` is raised to ``B`` when B is
larger, and B must be a power of two (``tl.arange``) of at most :data:`MAX_BLOCK_SIZE`.
Under ``TRITON_INTERPRET=1`` the small :data:`INTERPRET_BLOCKS` are used (several tiles
per test document) and 16-bit operands are upcast, as in :mod:`dflash_prep.kernels.flash`.

Launch grids are (heads, tiles), heads first so that the heads of one tile (which share its
GQA keys) run side by side and the heaviest tiles of every head start first. The tile count
is an upper bound known from the shapes, ``cdiv(rows, BLOCK) + docs``, so nothing syncs with
the host; surplus programs exit at once. It must stay within CUDA's 65535 on that axis
(about 2M draft rows or 8M context rows per call), else the call is refused.
"""

from __future__ import annotations

import torch
import triton

from .dflash_bwd import dflash_bwd_dkdv_blk_kernel, dflash_bwd_dkdv_ctx_kernel, dflash_bwd_dq_kernel
from .dflash_fwd import dflash_fwd_kernel
from .errors import AttentionConfigError
from .flash import HEAD_DIMS, INTERPRETED, PREPROCESS_BLOCK_M, _last_contiguous
from .flash_bwd import attn_bwd_preprocess_kernel
from .flash_fwd import LOG2E
from .inputs import DFlashProblem

MAX_BLOCK_SIZE = 128
# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel
# fwd/dq tile queries (BLOCK_M >= B), dkdv_blk tiles own-block keys (BLOCK_N >= B), dkdv_ctx context keys.
INTERPRET_BLOCKS = {"fwd": (16, 8, 4, 1), "dq": (16, 8, 4, 1), "dkdv_blk": (8, 16, 4, 1), "dkdv_ctx": (16, 16, 4, 1)}
# GPU tiles, picked without a GPU: among a few candidates per kernel, those whose sm_90 cubin,
# compiled ahead of time by Triton 3.6 (the GPU machine's), spills least (`python -m
# bench.dflash_resources` with Triton 3.6 first on PYTHONPATH prints them, the sliding-window
# variant with `--windowed`; the figures: docs/kernels.md#dflash-attention). Not yet timed on a GPU.
FIXED_BLOCKS = {
    64: {"fwd": (128, 64, 8, 3), "dq": (128, 64, 8, 3), "dkdv_blk": (32, 64, 4, 2), "dkdv_ctx": (64, 128, 8, 2)},
    128: {"fwd": (128, 32, 8, 3), "dq": (128, 32, 8, 2), "dkdv_blk": (32, 32, 4, 2), "dkdv_ctx": (64, 128, 8, 2)},
}


def blocks_for(name: str, prob: DFlashProblem) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) of kernel ``name``; a tile that must hold whole blocks
    (fwd/dq queries, dkdv_blk keys) is raised to at least B."""
    if INTERPRETED:
        bm, bn, warps, stages = INTERPRET_BLOCKS[name]
    else:
        bm, bn, warps, stages = FIXED_BLOCKS[128 if prob.head_dim > 64 else 64][name]
    if name in ("fwd", "dq"):
        bm = max(bm, prob.block_size)
    elif name == "dkdv_blk":
        bn = max(bn, prob.block_size)
    return bm, bn, warps, stages


def _check_triton(q: torch.Tensor, prob: DFlashProblem) -> None:
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise AttentionConfigError(f"the Triton DFlash attention takes float16, bfloat16 or float32, got {q.dtype}; "
                                   "cast the inputs or use backend 'reference'")
    if prob.head_dim not in HEAD_DIMS:
        raise AttentionConfigError(f"the Triton DFlash attention supports head dims {HEAD_DIMS}, got "
                                   f"{prob.head_dim}; pad the head dim or use backend 'reference'")
    b = prob.block_size
    if b & (b - 1) or b > MAX_BLOCK_SIZE:
        raise AttentionConfigError(f"the Triton DFlash attention needs block_size a power of two <= "
                                   f"{MAX_BLOCK_SIZE}, got {b}; use backend 'reference'")
    if q.device.type != "cuda" and not INTERPRETED:
        raise AttentionConfigError(f"kernels.dflash was imported without TRITON_INTERPRET=1, so it cannot run on "
                                   f"{q.device} tensors; move them to a GPU or use backend 'reference'")


def tile_table(cu: torch.Tensor, block: int) -> torch.Tensor:
    """int32 ``[docs+1]``: tiles of ``block`` rows before each document (device ops, no sync)."""
    counts = cu[1:] - cu[:-1]
    tiles = torch.zeros(cu.shape, dtype=torch.int32, device=cu.device)
    tiles[1:] = torch.cumsum((counts + (block - 1)) // block, 0)
    return tiles


#: The four kernels by the names :func:`blocks_for` and :data:`FIXED_BLOCKS` use.
KERNELS = {"fwd": dflash_fwd_kernel, "dq": dflash_bwd_dq_kernel, "dkdv_blk": dflash_bwd_dkdv_blk_kernel,
           "dkdv_ctx": dflash_bwd_dkdv_ctx_kernel}
_I32_ARGS = ("CU_CTX", "CU_BLK", "ANCHORS", "CU_TILES")


def compile_sm90(name: str, consts: dict, *, warps: int, stages: int, dtype: str = "bf16"):
    """Kernel ``name`` compiled ahead of time for sm_90 (Triton's ``compile`` on an
    ``ASTSource``, down to a cubin; no GPU needed), with ``consts`` as its constexprs and
    ``dtype`` (``bf16``, ``fp16``, ``fp32``) for the tensor arguments: the compile test and
    ``bench/dflash_resources.py`` read its shared memory, PTX and registers."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = KERNELS[name]
    consts = {"WINDOWED": False, **consts}  # full attention unless asked
    sig = {}
    for arg in kernel.arg_names:
        if arg in consts:
            sig[arg] = "constexpr"
        elif arg in _I32_ARGS:
            sig[arg] = "*i32"
        elif arg in ("LSE", "DELTA"):
            sig[arg] = "*fp32"
        elif arg.isupper():
            sig[arg] = "*" + dtype
        else:
            sig[arg] = "fp32" if arg in ("qk_scale", "sm_scale") else "i32"
    src = ASTSource(fn=kernel, signature=sig, constexprs={(kernel.arg_names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


def _consts(q: torch.Tensor, prob: DFlashProblem, bm: int, bn: int) -> dict:
    upcast = INTERPRETED and q.dtype != torch.float32
    return dict(HEAD_DIM=prob.head_dim, BLOCK_M=bm, BLOCK_N=bn, BLOCK_SIZE=prob.block_size, UPCAST=upcast,
                PRECISION="ieee" if (q.dtype == torch.float32 or upcast) else "tf32", WINDOWED=prob.window > 0)


def _rh(t: torch.Tensor) -> tuple[int, int]:
    return t.stride(0), t.stride(1)  # (row, head)


MAX_GRID_Y = 65535  # CUDA's limit on the second grid dimension (tiles; heads are the first)


def _grid(heads: int, rows: int, block: int, docs: int) -> tuple[int, int]:
    """(heads, tile bound): ``cdiv(rows, block) + docs`` tiles cover every document's partial last tile."""
    tiles = triton.cdiv(rows, block) + docs
    if tiles > MAX_GRID_Y:
        raise AttentionConfigError(
            f"attention_dflash: {rows} rows in tiles of {block} plus {docs} documents need {tiles} programs per "
            f"head, over CUDA's grid limit of {MAX_GRID_Y}; split the batch into smaller calls"
        )
    return heads, tiles


def _iters(n: int) -> int:
    return max(1, int(n).bit_length())


def _forward(q, k_ctx, v_ctx, k_blk, v_blk, cu_ctx, cu_blk, anchors, prob: DFlashProblem):
    o = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.zeros((prob.heads_q, q.shape[0]), dtype=torch.float32, device=q.device)  # (Hq, rows)
    if q.shape[0] == 0:
        return o, lse
    bm, bn, warps, stages = blocks_for("fwd", prob)
    tiles = tile_table(cu_blk, bm)
    dflash_fwd_kernel[_grid(prob.heads_q, q.shape[0], bm, prob.num_docs)](
        q, k_ctx, v_ctx, k_blk, v_blk, o, lse, cu_ctx, cu_blk, anchors, tiles,
        *_rh(q), *_rh(k_ctx), *_rh(v_ctx), *_rh(k_blk), *_rh(v_blk), *_rh(o), lse.stride(0),
        prob.scale * LOG2E.value, prob.num_docs, prob.group, _iters(prob.num_docs + 1), prob.window,
        num_warps=warps, num_stages=stages, **_consts(q, prob, bm, bn))
    return o, lse


def _backward(do, q, k_ctx, v_ctx, k_blk, v_blk, o, lse, cu_ctx, cu_blk, anchors, prob: DFlashProblem):
    grads = [torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k_ctx, v_ctx, k_blk, v_blk)]
    dq, dkc, dvc, dkb, dvb = grads
    rows = q.shape[0]
    if rows == 0:
        return grads
    do = _last_contiguous(do.to(q.dtype))
    delta = torch.empty_like(lse)  # (Hq, rows)
    starts = torch.zeros(1, dtype=torch.int32, device=q.device)
    attn_bwd_preprocess_kernel[(prob.heads_q * triton.cdiv(rows, PREPROCESS_BLOCK_M),)](  # all rows: one sequence
        o, do, delta, starts, starts + rows, 0, o.stride(1), o.stride(0), 0, do.stride(1), do.stride(0),
        0, delta.stride(0), 1, 1, prob.heads_q, rows, HEAD_DIM=prob.head_dim, BLOCK_M=PREPROCESS_BLOCK_M)
    scales = (prob.scale, prob.scale * LOG2E.value)
    docs_iter = _iters(prob.num_docs + 1)

    bm, bn, warps, stages = blocks_for("dq", prob)
    dflash_bwd_dq_kernel[_grid(prob.heads_q, rows, bm, prob.num_docs)](
        q, k_ctx, v_ctx, k_blk, v_blk, do, dq, lse, delta, cu_ctx, cu_blk, anchors, tile_table(cu_blk, bm),
        *_rh(q), *_rh(k_ctx), *_rh(v_ctx), *_rh(k_blk), *_rh(v_blk), *_rh(do), *_rh(dq), lse.stride(0),
        *scales, prob.num_docs, prob.group, docs_iter, prob.window,
        num_warps=warps, num_stages=stages, **_consts(q, prob, bm, bn))

    bm, bn, warps, stages = blocks_for("dkdv_blk", prob)
    dflash_bwd_dkdv_blk_kernel[_grid(prob.heads_kv, rows, bn, prob.num_docs)](
        q, k_blk, v_blk, do, dkb, dvb, lse, delta, cu_blk, anchors, tile_table(cu_blk, bn),
        *_rh(q), *_rh(k_blk), *_rh(v_blk), *_rh(do), *_rh(dkb), *_rh(dvb), lse.stride(0),
        *scales, prob.num_docs, prob.group, docs_iter,
        num_warps=warps, num_stages=stages, **_consts(q, prob, bm, bn))

    if prob.ctx_tokens:
        bm, bn, warps, stages = blocks_for("dkdv_ctx", prob)
        dflash_bwd_dkdv_ctx_kernel[_grid(prob.heads_kv, prob.ctx_tokens, bn, prob.num_docs)](
            q, k_ctx, v_ctx, do, dkc, dvc, lse, delta, cu_ctx, cu_blk, anchors, tile_table(cu_ctx, bn),
            *_rh(q), *_rh(k_ctx), *_rh(v_ctx), *_rh(do), *_rh(dkc), *_rh(dvc), lse.stride(0),
            *scales, prob.num_docs, prob.group, docs_iter, _iters(prob.num_blocks), prob.window,
            num_warps=warps, num_stages=stages, **_consts(q, prob, bm, bn))
    return grads


class _DFlash(torch.autograd.Function):
    """Forward saves (inputs, o, lse); backward runs preprocess, dQ, dK/dV_blk, dK/dV_ctx."""

    @staticmethod
    def forward(ctx, q, k_ctx, v_ctx, k_blk, v_blk, cu_ctx, cu_blk, anchors, prob: DFlashProblem):
        q, k_ctx, v_ctx, k_blk, v_blk = (_last_contiguous(t) for t in (q, k_ctx, v_ctx, k_blk, v_blk))
        cu_ctx, cu_blk, anchors = (t.contiguous() for t in (cu_ctx, cu_blk, anchors))
        o, lse = _forward(q, k_ctx, v_ctx, k_blk, v_blk, cu_ctx, cu_blk, anchors, prob)
        ctx.save_for_backward(q, k_ctx, v_ctx, k_blk, v_blk, o, lse, cu_ctx, cu_blk, anchors)
        ctx.prob = prob
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k_ctx, v_ctx, k_blk, v_blk, o, lse, cu_ctx, cu_blk, anchors = ctx.saved_tensors
        grads = _backward(do, q, k_ctx, v_ctx, k_blk, v_blk, o, lse, cu_ctx, cu_blk, anchors, ctx.prob)
        return (*grads, None, None, None, None)


def flash_dflash(q, k_ctx, v_ctx, k_blk, v_blk, cu_ctx, cu_blk, anchors, prob: DFlashProblem, *,
                 return_lse: bool = False):
    """Triton path of :func:`dflash_prep.kernels.attention.attention_dflash` (inputs already checked)."""
    _check_triton(q, prob)
    o, lse = _DFlash.apply(q, k_ctx, v_ctx, k_blk, v_blk, cu_ctx, cu_blk, anchors, prob)
    return (o, lse) if return_lse else o
