"""Launchers, autotuning and the ``torch.autograd.Function`` for each entry point.

Both layouts are lowered to one description, B sequences of ``lens[b]`` tokens that start
at token ``starts[b]`` of a batch row, plus per-tensor (batch, head, token) strides:

- varlen ``[T, H, D]``: batch stride 0, ``starts = cu[:-1]``, ``lens = diff(cu)``;
- padded ``[B, H, L, D]``: ``starts = 0``, ``lens = lengths``.

So one set of kernels serves both, and neither layout is copied (only a last dimension
that is not contiguous is). The LSE and ``delta`` buffers are fp32, ``[Hq, T]`` (varlen)
or ``[B, Hq, L]`` (padded). Outputs and gradients start as zeros, so padded rows are
exactly 0.

Autotuning (compiled GPU runs only) picks ``BLOCK_M``/``BLOCK_N``/warps/stages per kernel
from a small config set, keyed on (head dim, dtype, causal, max_seqlen bucketed to a power
of two). Within a process the choice is fixed, so results are bitwise deterministic run to
run; set ``DFLASH_ATTN_NO_AUTOTUNE=1`` to use one fixed config everywhere (bitwise
identical across processes too). Under ``TRITON_INTERPRET=1`` the small fixed
:data:`INTERPRET_BLOCKS` are used and 16-bit operands are upcast (see
:mod:`dflash_prep.kernels.flash_fwd`).
"""

from __future__ import annotations

import os

import torch
import triton
from triton import knobs

from .errors import AttentionConfigError

from .flash_bwd import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, attn_bwd_preprocess_kernel
from .flash_fwd import LOG2E, attn_fwd_kernel
from .inputs import Problem

HEAD_DIMS = (32, 64, 128)
INTERPRETED = bool(knobs.runtime.interpret)  # fixed when the @triton.jit kernels were defined
AUTOTUNE = not INTERPRETED and os.environ.get("DFLASH_ATTN_NO_AUTOTUNE", "0") != "1"

# (BLOCK_M, BLOCK_N) per kernel when not autotuning. In the interpreter small tiles keep
# tests fast while still putting several tiles (and BLOCK_M != BLOCK_N) in each sequence.
INTERPRET_BLOCKS = {"fwd": (32, 16), "dkdv": (16, 32), "dq": (32, 16)}
FIXED_BLOCKS = {"fwd": (128, 64), "dkdv": (64, 128), "dq": (128, 64)}
FIXED_WARPS = {"fwd": 8, "dkdv": 8, "dq": 8}
PREPROCESS_BLOCK_M = 64


def _configs(pairs: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in pairs]


# Small sets: BLOCK_M % BLOCK_N == 0 for fwd/dq, BLOCK_N % BLOCK_M == 0 for dK/dV.
FWD_CONFIGS = _configs([(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 4)])
DKDV_CONFIGS = _configs([(32, 64, 4, 3), (64, 64, 4, 3), (32, 128, 8, 3), (64, 128, 8, 3), (16, 64, 4, 4)])
DQ_CONFIGS = _configs([(64, 32, 4, 3), (64, 64, 4, 3), (128, 32, 8, 3), (128, 64, 8, 3), (128, 16, 8, 2)])
TUNE_KEY = ["HEAD_DIM", "CAUSAL", "SEQLEN_KEY"]  # the autotuner appends every tensor's dtype

_fwd_tuned = triton.autotune(FWD_CONFIGS, key=TUNE_KEY)(attn_fwd_kernel)
_dkdv_tuned = triton.autotune(DKDV_CONFIGS, key=TUNE_KEY)(attn_bwd_dkdv_kernel)
_dq_tuned = triton.autotune(DQ_CONFIGS, key=TUNE_KEY)(attn_bwd_dq_kernel)


def seqlen_bucket(max_seqlen: int) -> int:
    """Autotune bucket: the next power of two >= max_seqlen (at least 64)."""
    return max(64, triton.next_power_of_2(max(1, int(max_seqlen))))


def _launch(kernel, tuned, name: str, tiles: int, max_seqlen: int, tile_axis: str, *args, **consts) -> None:
    """Launch ``kernel`` over ``tiles`` (sequence, head) pairs x cdiv(max_seqlen, block) tiles."""
    if AUTOTUNE:
        tuned[lambda meta: (tiles * triton.cdiv(max_seqlen, meta[tile_axis]),)](*args, **consts)
        return
    bm, bn = (INTERPRET_BLOCKS if INTERPRETED else FIXED_BLOCKS)[name]
    block = bm if tile_axis == "BLOCK_M" else bn
    kernel[(tiles * triton.cdiv(max_seqlen, block),)](
        *args, BLOCK_M=bm, BLOCK_N=bn, num_warps=FIXED_WARPS[name], **consts)


def _strides(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, head, token) strides in elements: [T,H,D] -> (0, sH, sT); [B,H,L,D] -> (sB, sH, sL)."""
    return (0, t.stride(1), t.stride(0)) if varlen else (t.stride(0), t.stride(1), t.stride(2))


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_triton(q: torch.Tensor, prob: Problem) -> None:
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise AttentionConfigError(f"the Triton attention takes float16, bfloat16 or float32, got {q.dtype}; "
                          "cast the inputs or use backend 'reference'")
    if prob.head_dim not in HEAD_DIMS:
        raise AttentionConfigError(
            f"the Triton attention supports head dims {HEAD_DIMS}, got {prob.head_dim}; "
            "pad the head dim or use backend 'reference'"
        )
    if q.device.type != "cuda" and not INTERPRETED:
        raise AttentionConfigError(
            f"kernels.flash was imported without TRITON_INTERPRET=1, so it cannot run on {q.device} "
            "tensors; move them to a GPU or use backend 'reference'"
        )


def _consts(q: torch.Tensor, prob: Problem, causal: bool) -> dict:
    upcast = INTERPRETED and q.dtype != torch.float32
    return dict(HEAD_DIM=prob.head_dim, CAUSAL=bool(causal), UPCAST=upcast,
                PRECISION="ieee" if (q.dtype == torch.float32 or upcast) else "tf32")


def _forward(q, k, v, starts, lens, prob: Problem, causal: bool, varlen: bool):
    o = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.zeros((q.shape[1], q.shape[0]) if varlen else q.shape[:3], dtype=torch.float32, device=q.device)
    if prob.num_seqs == 0 or prob.max_seqlen == 0 or q.numel() == 0:
        return o, lse
    lse_s = (0, lse.stride(0), 1) if varlen else (lse.stride(0), lse.stride(1), lse.stride(2))
    _launch(attn_fwd_kernel, _fwd_tuned, "fwd", prob.num_seqs * prob.heads_q, prob.max_seqlen, "BLOCK_M",
            q, k, v, o, lse, starts, lens,
            *_strides(q, varlen), *_strides(k, varlen), *_strides(v, varlen), *_strides(o, varlen), *lse_s,
            prob.scale * LOG2E.value, prob.num_seqs, prob.heads_q, prob.max_seqlen, prob.group,
            seqlen_bucket(prob.max_seqlen), **_consts(q, prob, causal))
    return o, lse


def _backward(do, q, k, v, o, lse, starts, lens, prob: Problem, causal: bool, varlen: bool):
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    if prob.num_seqs == 0 or prob.max_seqlen == 0 or q.numel() == 0:
        return dq, dk, dv
    do = _last_contiguous(do.to(q.dtype))
    delta = torch.empty_like(lse)
    lse_s = (0, lse.stride(0), 1) if varlen else (lse.stride(0), lse.stride(1), lse.stride(2))
    tiles_q = prob.num_seqs * prob.heads_q
    attn_bwd_preprocess_kernel[(tiles_q * triton.cdiv(prob.max_seqlen, PREPROCESS_BLOCK_M),)](
        o, do, delta, starts, lens, *_strides(o, varlen), *_strides(do, varlen), *lse_s,
        prob.num_seqs, prob.heads_q, prob.max_seqlen, HEAD_DIM=prob.head_dim, BLOCK_M=PREPROCESS_BLOCK_M)
    consts = _consts(q, prob, causal)
    common = (prob.scale, prob.scale * LOG2E.value)
    _launch(attn_bwd_dkdv_kernel, _dkdv_tuned, "dkdv", prob.num_seqs * prob.heads_kv, prob.max_seqlen, "BLOCK_N",
            q, k, v, do, dk, dv, lse, delta, starts, lens,
            *_strides(q, varlen), *_strides(k, varlen), *_strides(v, varlen), *_strides(do, varlen),
            *_strides(dk, varlen), *_strides(dv, varlen), *lse_s,
            *common, prob.num_seqs, prob.heads_kv, prob.max_seqlen, prob.group,
            seqlen_bucket(prob.max_seqlen), **consts)
    _launch(attn_bwd_dq_kernel, _dq_tuned, "dq", tiles_q, prob.max_seqlen, "BLOCK_M",
            q, k, v, do, dq, lse, delta, starts, lens,
            *_strides(q, varlen), *_strides(k, varlen), *_strides(v, varlen), *_strides(do, varlen),
            *_strides(dq, varlen), *lse_s,
            *common, prob.num_seqs, prob.heads_q, prob.max_seqlen, prob.group,
            seqlen_bucket(prob.max_seqlen), **consts)
    return dq, dk, dv


class _Flash(torch.autograd.Function):
    """Both layouts run the same kernels over (starts, lens) per sequence; only the
    strides (``varlen``) differ. Subclasses turn their layout's arguments into those."""

    @staticmethod
    def _run(ctx, q, k, v, starts, lens, prob: Problem, causal: bool, varlen: bool):
        q, k, v = (_last_contiguous(t) for t in (q, k, v))
        o, lse = _forward(q, k, v, starts, lens, prob, causal, varlen=varlen)
        ctx.save_for_backward(q, k, v, o, lse, starts, lens)
        ctx.prob, ctx.causal, ctx.varlen = prob, causal, varlen
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, starts, lens = ctx.saved_tensors
        dq, dk, dv = _backward(do, q, k, v, o, lse, starts, lens, ctx.prob, ctx.causal, varlen=ctx.varlen)
        return dq, dk, dv, None, None, None


class _FlashVarlen(_Flash):
    """Packed documents: q [T,Hq,D], k/v [T,Hkv,D], cu_seqlens int32 [N+1]."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, prob: Problem, causal: bool):
        starts = cu_seqlens[:-1].contiguous()
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).contiguous()
        return _Flash._run(ctx, q, k, v, starts, lens, prob, causal, True)


class _FlashPadded(_Flash):
    """Right-padded rows: q [B,Hq,L,D], k/v [B,Hkv,L,D], lengths int32 [B]."""

    @staticmethod
    def forward(ctx, q, k, v, lengths, prob: Problem, causal: bool):
        return _Flash._run(ctx, q, k, v, torch.zeros_like(lengths), lengths.contiguous(), prob, causal, False)


def flash_varlen(q, k, v, cu_seqlens, prob: Problem, causal: bool = True, *, return_lse: bool = False):
    """Triton path of :func:`dflash_prep.kernels.attention.attention_varlen` (inputs already checked)."""
    _check_triton(q, prob)
    o, lse = _FlashVarlen.apply(q, k, v, cu_seqlens, prob, causal)
    return (o, lse) if return_lse else o


def flash_padded(q, k, v, lengths, prob: Problem, causal: bool = True, *, return_lse: bool = False):
    """Triton path of :func:`dflash_prep.kernels.attention.attention_padded` (inputs already checked)."""
    _check_triton(q, prob)
    o, lse = _FlashPadded.apply(q, k, v, lengths, prob, causal)
    return (o, lse) if return_lse else o
