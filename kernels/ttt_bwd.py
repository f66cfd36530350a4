"""Triton backward kernels of EAGLE-3 TTT attention, and their launcher: deterministic, no atomics.

With ``P = exp(scale q k^T - lse)`` (lse from the forward, over all keys a row sees), ``delta =
rowsum(O * dO)`` and ``dS = P * (dO V^T - delta)``, four launches:

1. the causal kernels' preprocess (:func:`~dflash_prep.kernels.flash_bwd.attn_bwd_preprocess_kernel`,
   reused) computes ``delta`` ``[Sq, Hq, T]``, the Sq steps run as Sq sequences of T tokens;
2. :func:`ttt_bwd_dq_kernel`: one program per (query tile, document, query head, query step)
   accumulates ``dQ = scale * dS K`` over its ``step`` diagonal keys (elementwise; first, as in
   the forward) and then over the causal step-0 keys (the causal kernel's loop,
   :func:`~dflash_prep.kernels.flash_bwd._dq_inner`, reused);
3. :func:`ttt_bwd_dkdv_kernel`: one program per (step-0 key tile, document, key/value head)
   accumulates ``dK_0``/``dV_0`` over every query step and every query head of its GQA group (the
   causal kernel's :func:`~dflash_prep.kernels.flash_bwd._dkdv_inner`, reused: the query tiles
   at and below the diagonal band only);
4. :func:`ttt_bwd_dkdv_diag_kernel`: one program per (tile of ``BLOCK_M`` tokens, key/value head,
   diagonal step ``j >= 1``) accumulates ``dK_j``/``dV_j`` of those tokens from the queries of
   the steps ``i >= j`` at the same tokens and every head of the group, elementwise. A diagonal
   key is seen only by its own token, so this needs no document structure.

Every gradient element is written by exactly one program in a fixed order: bitwise reproducible.
Rows past a document's length load ``lse = +inf`` (probabilities exactly 0). As in the causal
kernels, ``P`` is recomputed in the dQ and the dK/dV kernels (2.5x the forward's FLOPs in all).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .flash import PREPROCESS_BLOCK_M
from .flash_bwd import _dkdv_inner, _dq_inner, attn_bwd_preprocess_kernel
from .flash_fwd import rounded
from .inputs import TTTProblem
from .ttt_fwd import consts, jit_ttt, sth

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _diag_dq(dq, q, do, lse2, delta, k_tile, v_tile, sks, svs, skt, svt, loc, offs_d, row_ok, n_diag, qk_scale):
    """dQ (unscaled) from the diagonal keys of steps ``1..n_diag`` (pointers as in ``ttt_fwd._diag_fwd``)."""
    qf = q.to(tl.float32)
    dof = do.to(tl.float32)
    for _ in range(0, n_diag):
        k_tile += sks
        v_tile += svs
        kj = tl.load(k_tile + loc[:, None] * skt + offs_d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        vj = tl.load(v_tile + loc[:, None] * svt + offs_d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        p = tl.math.exp2(tl.sum(qf * kj, 1) * qk_scale - lse2)  # (BLOCK_M,)
        ds = p * (tl.sum(dof * vj, 1) - delta)
        dq += ds[:, None] * kj
    return dq


@jit_ttt
def ttt_bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, STARTS, LENS,
    sqs, sqh, sqt, sks, skh, skt, svs, svh, svt, sds, sdh, sdt, sdqs, sdqh, sdqt, sls, slh,
    sm_scale, qk_scale, num_seqs, num_heads, max_seqlen, group, step_offset,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    iq = tl.program_id(1)
    n_bh = num_seqs * num_heads
    bh = pid % n_bh
    start_m = tl.cdiv(max_seqlen, BLOCK_M) - 1 - pid // n_bh  # heaviest causal tiles first
    b = bh // num_heads
    h = bh % num_heads
    seq_len = tl.load(LENS + b)
    if start_m * BLOCK_M < seq_len:
        start = tl.load(STARTS + b).to(tl.int64)
        iq64 = iq.to(tl.int64)
        h64 = h.to(tl.int64)
        hk = (h // group).to(tl.int64)
        loc = tl.arange(0, BLOCK_M)  # rows within the tile: int32 offsets from the tile's base
        offs_m = start_m * BLOCK_M + loc
        offs_d = tl.arange(0, HEAD_DIM)
        row_ok = offs_m < seq_len
        tile0 = start + start_m * BLOCK_M  # the tile's first token (int64)
        q = tl.load(Q + iq64 * sqs + h64 * sqh + tile0 * sqt + loc[:, None] * sqt + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)
        do = tl.load(DO + iq64 * sds + h64 * sdh + tile0 * sdt + loc[:, None] * sdt + offs_d[None, :],
                     mask=row_ok[:, None], other=0.0)
        lse_tile = iq64 * sls + h64 * slh + tile0
        lse2 = tl.load(LSE + lse_tile + loc, mask=row_ok, other=float("inf")) * LOG2E
        delta = tl.load(DELTA + lse_tile + loc, mask=row_ok, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        # the diagonal keys first (as in the forward: fewer registers than after the causal loop)
        dq = _diag_dq(dq, q, do, lse2, delta, K + hk * skh + tile0 * skt, V + hk * svh + tile0 * svt,
                      sks, svs, skt, svt, loc, offs_d, row_ok, iq + step_offset, qk_scale)
        k_base = K + hk * skh + start * skt  # step 0
        v_base = V + hk * svh + start * svt
        dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, skt, svt, offs_m, offs_d,
                       0, start_m * BLOCK_M, seq_len, qk_scale, BLOCK_N, False, True, UPCAST, PRECISION)
        dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, skt, svt, offs_m, offs_d,
                       start_m * BLOCK_M, tl.minimum((start_m + 1) * BLOCK_M, seq_len), seq_len, qk_scale,
                       BLOCK_N, True, True, UPCAST, PRECISION)
        dq = dq * sm_scale
        tl.store(DQ + iq64 * sdqs + h64 * sdqh + tile0 * sdqt + loc[:, None] * sdqt + offs_d[None, :],
                 rounded(dq, DQ.dtype.element_ty, UPCAST).to(DQ.dtype.element_ty), mask=row_ok[:, None])


@jit_ttt
def ttt_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, STARTS, LENS,
    sqs, sqh, sqt, sks, skh, skt, svs, svh, svt, sds, sdh, sdt, sdks, sdkh, sdkt, sdvs, sdvh, sdvt, sls, slh,
    sm_scale, qk_scale, num_seqs, num_kv_heads, max_seqlen, group, q_steps,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    n_bh = num_seqs * num_kv_heads
    bh = pid % n_bh
    start_n = pid // n_bh  # the first key tiles see the most queries, so they start first
    b = bh // num_kv_heads
    hk = (bh % num_kv_heads).to(tl.int64)
    seq_len = tl.load(LENS + b)
    if start_n * BLOCK_N < seq_len:
        start = tl.load(STARTS + b).to(tl.int64)
        loc = tl.arange(0, BLOCK_N)  # keys within the tile: int32 offsets from the tile's base
        offs_n = start_n * BLOCK_N + loc
        offs_d = tl.arange(0, HEAD_DIM)
        col_ok = offs_n < seq_len
        tile0 = start + start_n * BLOCK_N  # the tile's first token (int64)
        k = tl.load(K + hk * skh + tile0 * skt + loc[:, None] * skt + offs_d[None, :], mask=col_ok[:, None], other=0.0)
        v = tl.load(V + hk * svh + tile0 * svt + loc[:, None] * svt + offs_d[None, :], mask=col_ok[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        lo = start_n * BLOCK_N
        q_step = Q + start * sqt  # advanced one query step at a time (no int32 step * stride)
        do_step = DO + start * sdt
        lse_step = LSE + start
        delta_step = DELTA + start
        for _ in range(0, q_steps):
            for g in range(0, group):
                h = hk * group + g
                q_base = q_step + h * sqh
                do_base = do_step + h * sdh
                lse_base = lse_step + h * slh
                delta_base = delta_step + h * slh
                dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqt, sdt, 1,
                                     offs_n, offs_d, lo, tl.minimum(lo + BLOCK_N, seq_len), seq_len, qk_scale,
                                     BLOCK_M, True, UPCAST, PRECISION)
                dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqt, sdt, 1,
                                     offs_n, offs_d, lo + BLOCK_N, seq_len, seq_len, qk_scale,
                                     BLOCK_M, False, UPCAST, PRECISION)
            q_step += sqs
            do_step += sds
            lse_step += sls
            delta_step += sls
        dk = dk * sm_scale
        tl.store(DK + hk * sdkh + tile0 * sdkt + loc[:, None] * sdkt + offs_d[None, :],
                 rounded(dk, DK.dtype.element_ty, UPCAST).to(DK.dtype.element_ty), mask=col_ok[:, None])
        tl.store(DV + hk * sdvh + tile0 * sdvt + loc[:, None] * sdvt + offs_d[None, :],
                 rounded(dv, DV.dtype.element_ty, UPCAST).to(DV.dtype.element_ty), mask=col_ok[:, None])


@jit_ttt
def ttt_bwd_dkdv_diag_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA,
    sqs, sqh, sqt, sks, skh, skt, svs, svh, svt, sds, sdh, sdt, sdks, sdkh, sdkt, sdvs, sdvh, sdvt, sls, slh,
    sm_scale, qk_scale, tokens, group, step_offset, q_steps,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    tile0 = (tl.program_id(0) * BLOCK_M).to(tl.int64)  # the tile's first token (global)
    hk = tl.program_id(1).to(tl.int64)
    j = (tl.program_id(2) + 1).to(tl.int64)  # the diagonal step these keys belong to (>= 1)
    loc = tl.arange(0, BLOCK_M)  # int32 offsets from the tile's first token
    offs_d = tl.arange(0, HEAD_DIM)
    tok_ok = loc < tokens - tile0
    kj = tl.load(K + j * sks + hk * skh + tile0 * skt + loc[:, None] * skt + offs_d[None, :],
                 mask=tok_ok[:, None], other=0.0).to(tl.float32)  # (BLOCK_M, D)
    vj = tl.load(V + j * svs + hk * svh + tile0 * svt + loc[:, None] * svt + offs_d[None, :],
                 mask=tok_ok[:, None], other=0.0).to(tl.float32)
    dk = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    i0 = tl.maximum(tl.program_id(2) + 1 - step_offset, 0)  # the first query step that sees step j (true step >= j)
    i64 = i0.to(tl.int64)
    q_step = Q + i64 * sqs + tile0 * sqt  # scalar bases, advanced one query step at a time
    do_step = DO + i64 * sds + tile0 * sdt
    lse_step = i64 * sls + tile0
    for _ in range(i0, q_steps):
        for g in range(0, group):
            h = hk * group + g
            q = tl.load(q_step + h * sqh + loc[:, None] * sqt + offs_d[None, :], mask=tok_ok[:, None],
                        other=0.0).to(tl.float32)  # (BLOCK_M, D)
            do = tl.load(do_step + h * sdh + loc[:, None] * sdt + offs_d[None, :], mask=tok_ok[:, None],
                         other=0.0).to(tl.float32)
            lse2 = tl.load(LSE + lse_step + h * slh + loc, mask=tok_ok, other=float("inf")) * LOG2E
            delta = tl.load(DELTA + lse_step + h * slh + loc, mask=tok_ok, other=0.0)
            p = tl.math.exp2(tl.sum(q * kj, 1) * qk_scale - lse2)  # (BLOCK_M,)
            dv += p[:, None] * do
            ds = p * (tl.sum(do * vj, 1) - delta)
            dk += ds[:, None] * q
        q_step += sqs
        do_step += sds
        lse_step += sls
    dk = dk * sm_scale
    tl.store(DK + j * sdks + hk * sdkh + tile0 * sdkt + loc[:, None] * sdkt + offs_d[None, :],
             rounded(dk, DK.dtype.element_ty, UPCAST).to(DK.dtype.element_ty), mask=tok_ok[:, None])
    tl.store(DV + j * sdvs + hk * sdvh + tile0 * sdvt + loc[:, None] * sdvt + offs_d[None, :],
             rounded(dv, DV.dtype.element_ty, UPCAST).to(DV.dtype.element_ty), mask=tok_ok[:, None])


# ----------------------------------------------------------------------------- launch
def backward(do, q, k, v, o, lse, starts, lens, prob: TTTProblem):
    """(dq, dk, dv) in the inputs' dtypes; ``do`` ``[Sq, T, Hq, D]``."""
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    if prob.num_seqs == 0 or prob.max_seqlen == 0 or q.numel() == 0:
        return dq, dk, dv
    do = do.to(q.dtype)
    do = do if do.stride(-1) == 1 else do.contiguous()
    delta = torch.empty_like(lse)  # (Sq, Hq, T)
    steps = torch.zeros(prob.q_steps, dtype=torch.int32, device=q.device)  # the Sq steps as Sq sequences of T tokens
    attn_bwd_preprocess_kernel[(prob.q_steps * prob.heads_q * triton.cdiv(prob.tokens, PREPROCESS_BLOCK_M),)](
        o, do, delta, steps, steps + prob.tokens, *sth(o), *sth(do), delta.stride(0), delta.stride(1), 1,
        prob.q_steps, prob.heads_q, prob.tokens, HEAD_DIM=prob.head_dim, BLOCK_M=PREPROCESS_BLOCK_M)
    scales = (prob.scale, prob.scale * LOG2E.value)
    lse_s = (lse.stride(0), lse.stride(1))

    const, opts = consts(q, prob, "dq")
    ttt_bwd_dq_kernel[(prob.num_seqs * prob.heads_q * triton.cdiv(prob.max_seqlen, const["BLOCK_M"]), prob.q_steps)](
        q, k, v, do, dq, lse, delta, starts, lens, *sth(q), *sth(k), *sth(v), *sth(do), *sth(dq), *lse_s,
        *scales, prob.num_seqs, prob.heads_q, prob.max_seqlen, prob.group, prob.step_offset, **opts, **const)

    const, opts = consts(q, prob, "dkdv")
    ttt_bwd_dkdv_kernel[(prob.num_seqs * prob.heads_kv * triton.cdiv(prob.max_seqlen, const["BLOCK_N"]),)](
        q, k, v, do, dk, dv, lse, delta, starts, lens, *sth(q), *sth(k), *sth(v), *sth(do), *sth(dk), *sth(dv),
        *lse_s, *scales, prob.num_seqs, prob.heads_kv, prob.max_seqlen, prob.group, prob.q_steps, **opts, **const)

    if prob.k_steps > 1:
        const, opts = consts(q, prob, "diag")
        ttt_bwd_dkdv_diag_kernel[(triton.cdiv(prob.tokens, const["BLOCK_M"]), prob.heads_kv, prob.k_steps - 1)](
            q, k, v, do, dk, dv, lse, delta, *sth(q), *sth(k), *sth(v), *sth(do), *sth(dk), *sth(dv), *lse_s,
            *scales, prob.tokens, prob.group, prob.step_offset, prob.q_steps, **opts, **const)
    return dq, dk, dv
