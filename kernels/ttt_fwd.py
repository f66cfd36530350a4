"""Triton forward kernel of EAGLE-3 TTT attention, the tiles of every TTT kernel, and its launcher.

Semantics: :mod:`dflash_prep.kernels.ttt_reference`. Tensors are stacked per step, ``q``/``o``
``[Sq, T, Hq, D]``, ``k``/``v`` ``[Sk, T, Hkv, D]`` (any strides, last dim contiguous); ``q[iq]``
is step ``iq + Sk - Sq`` (``step_offset`` = Sk - Sq). The LSE buffer is fp32 ``[Sq, Hq, T]``.

One program computes one ``BLOCK_M`` tile of query rows of one (document, query head, query
step), with fp32 online softmax:

1. the ``step`` diagonal keys first: for ``j = 1..step``, each row's own token's ``k[j]``/``v[j]``
   give one score per row (an elementwise fp32 ``q . k_j``, no ``tl.dot``), folded into the running
   max, sum and accumulator. That adds ``step`` row loads of K and V per tile: small against the
   causal part's ``~t/BLOCK_N`` key tiles for any document longer than a few tiles. (Folding them
   in after the causal loop instead spilled registers at D = 128: the sm_90 cubin's stack was
   48 B, against 0 B this way round.)
2. then the causal step-0 keys of its document: exactly the causal varlen kernel's loop
   (:func:`~dflash_prep.kernels.flash_fwd._fwd_inner`, reused): key tiles strictly below the
   diagonal band run unmasked, only the ``BLOCK_M`` band is element-masked, tiles above it are
   never loaded; programs run the heaviest (last) tiles first.

Then the natural-log LSE of the scaled scores is saved per (step, head, row). For ``Sq = Sk = 1``
the program is the causal varlen kernel's: with the same tiles the results are bitwise equal
(tested under the interpreter, where both use the same tiles). ``UPCAST``/``rounded`` handle the
interpreter's bf16 ``tl.dot`` as in :mod:`dflash_prep.kernels.flash_fwd`.

Tiles are fixed per kernel, as for the DFlash kernels (no autotuning: no GPU has timed them yet), so
results are bitwise identical run to run and across processes. Under ``TRITON_INTERPRET=1`` the
causal kernels' small :data:`~dflash_prep.kernels.flash.INTERPRET_BLOCKS` are used.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .flash import INTERPRET_BLOCKS as FLASH_INTERPRET_BLOCKS
from .flash import INTERPRETED
from .flash_fwd import LN2, LOG2E, _fwd_inner, rounded
from .inputs import TTTProblem

# runtime ints that must not be specialized (a value of 1 would compile a new variant)
COUNTS = ["num_seqs", "num_heads", "num_kv_heads", "max_seqlen", "group", "step_offset", "q_steps", "tokens"]


def jit_ttt(fn):
    names = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    return triton.jit(fn, do_not_specialize=[a for a in COUNTS if a in names])


@triton.jit
def _diag_fwd(acc, l_i, m_i, q, k_tile, v_tile, sks, svs, skt, svt, loc, offs_d, row_ok, n_diag, qk_scale):
    """Fold the diagonal keys of steps ``1..n_diag`` into the online softmax.

    ``k_tile``/``v_tile`` point at the tile's first token in step 0 and advance one step stride
    per step; rows are ``loc`` (int32 offsets within the tile): no 2-D int64 address tensor is
    carried through the loop (that spilled registers at D = 128).
    """
    qf = q.to(tl.float32)
    for _ in range(0, n_diag):
        k_tile += sks
        v_tile += svs
        kj = tl.load(k_tile + loc[:, None] * skt + offs_d[None, :], mask=row_ok[:, None], other=0.0)  # (BLOCK_M, D)
        vj = tl.load(v_tile + loc[:, None] * svt + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        s = tl.sum(qf * kj.to(tl.float32), 1) * qk_scale  # (BLOCK_M,) log2 units
        m_new = tl.maximum(m_i, s)
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * vj.to(tl.float32)
        m_i = m_new
    return acc, l_i, m_i


@jit_ttt
def ttt_fwd_kernel(
    Q, K, V, O, LSE, STARTS, LENS,
    sqs, sqh, sqt, sks, skh, skt, svs, svh, svt, sos, soh, sot, sls, slh,
    qk_scale, num_seqs, num_heads, max_seqlen, group, step_offset,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    iq = tl.program_id(1)  # query step index; its true step is iq + step_offset
    n_bh = num_seqs * num_heads
    bh = pid % n_bh
    start_m = tl.cdiv(max_seqlen, BLOCK_M) - 1 - pid // n_bh  # heaviest causal tiles first
    b = bh // num_heads
    h = bh % num_heads
    seq_len = tl.load(LENS + b)
    if start_m * BLOCK_M < seq_len:
        start = tl.load(STARTS + b).to(tl.int64)
        iq64 = iq.to(tl.int64)
        hk = (h // group).to(tl.int64)
        h64 = h.to(tl.int64)
        loc = tl.arange(0, BLOCK_M)  # rows within the tile: int32 offsets from the tile's base
        offs_m = start_m * BLOCK_M + loc  # rows within the document
        offs_d = tl.arange(0, HEAD_DIM)
        row_ok = offs_m < seq_len
        tile0 = start + start_m * BLOCK_M  # the tile's first token (int64)
        q = tl.load(Q + iq64 * sqs + h64 * sqh + tile0 * sqt + loc[:, None] * sqt + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        # diagonal keys of steps 1..step at each row's own token
        acc, l_i, m_i = _diag_fwd(acc, l_i, m_i, q, K + hk * skh + tile0 * skt, V + hk * svh + tile0 * svt,
                                  sks, svs, skt, svt, loc, offs_d, row_ok, iq + step_offset, qk_scale)
        k_base = K + hk * skh + start * skt  # step 0
        v_base = V + hk * svh + start * svt
        # causal step-0 keys: strictly below the diagonal band with no mask, then the band
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, skt, svt, offs_m, offs_d,
                                   0, start_m * BLOCK_M, seq_len, qk_scale,
                                   BLOCK_N, False, True, UPCAST, PRECISION)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, skt, svt, offs_m, offs_d,
                                   start_m * BLOCK_M, tl.minimum((start_m + 1) * BLOCK_M, seq_len),
                                   seq_len, qk_scale, BLOCK_N, True, True, UPCAST, PRECISION)
        acc = acc / l_i[:, None]
        lse = (m_i + tl.math.log2(l_i)) * LN2  # natural-log LSE of scale * q.k
        tl.store(O + iq64 * sos + h64 * soh + tile0 * sot + loc[:, None] * sot + offs_d[None, :],
                 rounded(acc, O.dtype.element_ty, UPCAST).to(O.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LSE + iq64 * sls + h64 * slh + tile0 + loc, lse, mask=row_ok)


# ----------------------------------------------------------------------------- tiles and launch
# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel: fwd/dq tile queries (BLOCK_M % BLOCK_N == 0),
# dkdv tiles step-0 keys (BLOCK_N % BLOCK_M == 0), diag tiles BLOCK_M tokens (BLOCK_N unused).
# The interpreter uses the causal kernels' tiles, so Sq = Sk = 1 runs exactly their programs.
INTERPRET_BLOCKS = {**{name: (*FLASH_INTERPRET_BLOCKS[name], 4, 1) for name in ("fwd", "dq", "dkdv")},
                    "diag": (32, 32, 4, 1)}
# GPU tiles, picked without a GPU the way the DFlash tiles were: among a few candidates per kernel,
# those whose sm_90 cubin (bf16, compiled ahead of time with 16-divisible pointers and strides, as a
# launch specializes them) spills least. Stack bytes with Triton 3.9: none at D = 64; at D = 128
# only dkdv, 24 B. Not yet timed on a GPU.
FIXED_BLOCKS = {
    64: {"fwd": (128, 64, 8, 3), "dq": (128, 64, 8, 3), "dkdv": (32, 128, 8, 3), "diag": (64, 64, 8, 2)},
    128: {"fwd": (128, 64, 8, 3), "dq": (64, 64, 8, 3), "dkdv": (16, 128, 8, 3), "diag": (64, 64, 8, 2)},
}


def blocks_for(name: str, head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) of TTT kernel ``name``."""
    if INTERPRETED:
        return INTERPRET_BLOCKS[name]
    return FIXED_BLOCKS[128 if head_dim > 64 else 64][name]


def consts(q: torch.Tensor, prob: TTTProblem, name: str) -> tuple[dict, dict]:
    """(constexprs, launch options) of kernel ``name``."""
    bm, bn, warps, stages = blocks_for(name, prob.head_dim)
    upcast = INTERPRETED and q.dtype != torch.float32
    return (dict(HEAD_DIM=prob.head_dim, BLOCK_M=bm, BLOCK_N=bn, UPCAST=upcast,
                 PRECISION="ieee" if (q.dtype == torch.float32 or upcast) else "tf32"),
            dict(num_warps=warps, num_stages=stages))


def sth(t: torch.Tensor) -> tuple[int, int, int]:
    """(step, head, token) strides of a ``[S, T, H, D]`` tensor, in elements."""
    return t.stride(0), t.stride(2), t.stride(1)


def forward(q, k, v, starts, lens, prob: TTTProblem):
    """o ``[Sq, T, Hq, D]`` (q's dtype) and lse fp32 ``[Sq, Hq, T]``; inputs already checked."""
    o = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.zeros((prob.q_steps, prob.heads_q, prob.tokens), dtype=torch.float32, device=q.device)
    if prob.num_seqs == 0 or prob.max_seqlen == 0 or q.numel() == 0:
        return o, lse
    const, opts = consts(q, prob, "fwd")
    grid = (prob.num_seqs * prob.heads_q * triton.cdiv(prob.max_seqlen, const["BLOCK_M"]), prob.q_steps)
    ttt_fwd_kernel[grid](
        q, k, v, o, lse, starts, lens, *sth(q), *sth(k), *sth(v), *sth(o), lse.stride(0), lse.stride(1),
        prob.scale * LOG2E.value, prob.num_seqs, prob.heads_q, prob.max_seqlen, prob.group, prob.step_offset,
        **opts, **const)
    return o, lse
