"""Triton backward kernels: deterministic, no atomics, three launches.

With ``S = scale q k^T``, ``P = exp(S - lse)`` (lse saved by the forward) and upstream
``dO``:

1. ``attn_bwd_preprocess_kernel``: ``delta = rowsum(O * dO)`` in fp32, one value per
   query row and head (equal to ``rowsum(P * dP)``).
2. ``attn_bwd_dkdv_kernel``: one program owns one ``BLOCK_N`` tile of keys of one
   (sequence, key/value head). It recomputes ``P^T`` for every query tile of every query
   head in its GQA group and accumulates, in registers, ``dV = P^T dO`` and
   ``dK = scale * dS^T Q`` with ``dS = P * (dO V^T - delta)``. Each dK/dV element is
   written by exactly one program, so GQA needs no reduction pass and no atomics.
3. ``attn_bwd_dq_kernel``: one program owns one ``BLOCK_M`` tile of query rows of one
   (sequence, query head) and accumulates ``dQ = scale * dS K``.

The price of determinism is recomputing ``P`` twice (once per kernel): about 2.5x the
forward FLOPs in all, versus 2x for an atomic-add dQ. Causal tiles above the diagonal
are skipped; only the diagonal band is element-masked (needs ``BLOCK_N % BLOCK_M == 0``
in dK/dV and ``BLOCK_M % BLOCK_N == 0`` in dQ). Query rows past a sequence's length are
loaded with ``lse = +inf`` so their probabilities are exactly 0 and they contribute
nothing. ``UPCAST`` behaves as in :mod:`dflash_prep.kernels.flash_fwd`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .flash_fwd import jit_counts, rounded

LOG2E = tl.constexpr(1.4426950408889634)


@jit_counts
def attn_bwd_preprocess_kernel(
    O, DO, DELTA, STARTS, LENS,
    sob, soh, sot, sdb, sdh, sdt, slb, slh, slt,
    num_seqs, num_heads, max_seqlen,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):
    pid = tl.program_id(0)
    n_bh = num_seqs * num_heads
    bh = pid % n_bh
    start_m = pid // n_bh
    b = bh // num_heads
    h = (bh % num_heads).to(tl.int64)
    seq_len = tl.load(LENS + b)
    if start_m * BLOCK_M < seq_len:
        start = tl.load(STARTS + b).to(tl.int64)
        b64 = b.to(tl.int64)
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        row_ok = offs_m < seq_len
        rows = offs_m[:, None].to(tl.int64)
        o = tl.load(O + b64 * sob + h * soh + (start + rows) * sot + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        do = tl.load(DO + b64 * sdb + h * sdh + (start + rows) * sdt + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
        tl.store(DELTA + b64 * slb + h * slh + (start + offs_m.to(tl.int64)) * slt, delta, mask=row_ok)


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqt, sdt, slt,
                offs_n, offs_d, lo, hi, seq_len, qk_scale,
                BLOCK_M: tl.constexpr, MASK: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    offs_i = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_i
        row_ok = offs_m < seq_len
        rows = offs_m.to(tl.int64)
        qt = tl.load(q_base + rows[None, :] * sqt + offs_d[:, None], mask=row_ok[None, :], other=0.0)  # (D, BLOCK_M)
        do = tl.load(do_base + rows[:, None] * sdt + offs_d[None, :], mask=row_ok[:, None], other=0.0)  # (BLOCK_M, D)
        lse2 = tl.load(lse_base + rows * slt, mask=row_ok, other=float("inf")) * LOG2E
        delta = tl.load(delta_base + rows * slt, mask=row_ok, other=0.0)
        in_dtype = do.dtype
        if UPCAST:
            qt = qt.to(tl.float32)
            do = do.to(tl.float32)
        qkt = tl.dot(k, qt, input_precision=PRECISION) * qk_scale  # (BLOCK_N, BLOCK_M), log2 units
        pt = tl.math.exp2(qkt - lse2[None, :])
        if MASK:  # diagonal band: key n is seen by query m only when n <= m
            pt = tl.where(offs_m[None, :] >= offs_n[:, None], pt, 0.0)
        dv = tl.dot(rounded(pt, in_dtype, UPCAST), do, dv, input_precision=PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # (BLOCK_N, BLOCK_M)
        dst = rounded(pt * (dpt - delta[None, :]), in_dtype, UPCAST)
        dk = tl.dot(dst, tl.trans(qt), dk, input_precision=PRECISION)
    return dk, dv


@jit_counts
def attn_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, STARTS, LENS,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdb, sdh, sdt,
    sdkb, sdkh, sdkt, sdvb, sdvh, sdvt, slb, slh, slt,
    sm_scale, qk_scale, num_seqs, num_kv_heads, max_seqlen, group, SEQLEN_KEY,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    n_bh = num_seqs * num_kv_heads
    bh = pid % n_bh
    start_n = pid // n_bh  # causal: the first key tiles see the most queries, so they start first
    b = bh // num_kv_heads
    hk = (bh % num_kv_heads).to(tl.int64)
    seq_len = tl.load(LENS + b)
    if start_n * BLOCK_N < seq_len:
        start = tl.load(STARTS + b).to(tl.int64)
        b64 = b.to(tl.int64)
        offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        col_ok = offs_n < seq_len
        cols = offs_n[:, None].to(tl.int64)
        k = tl.load(K + b64 * skb + hk * skh + (start + cols) * skt + offs_d[None, :], mask=col_ok[:, None], other=0.0)
        v = tl.load(V + b64 * svb + hk * svh + (start + cols) * svt + offs_d[None, :], mask=col_ok[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        for g in range(0, group):
            h = hk * group + g
            q_base = Q + b64 * sqb + h * sqh + start * sqt
            do_base = DO + b64 * sdb + h * sdh + start * sdt
            lse_base = LSE + b64 * slb + h * slh + start * slt
            delta_base = DELTA + b64 * slb + h * slh + start * slt
            if CAUSAL:
                lo = start_n * BLOCK_N
                dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqt, sdt, slt,
                                     offs_n, offs_d, lo, tl.minimum(lo + BLOCK_N, seq_len), seq_len, qk_scale,
                                     BLOCK_M, True, UPCAST, PRECISION)
                dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqt, sdt, slt,
                                     offs_n, offs_d, lo + BLOCK_N, seq_len, seq_len, qk_scale,
                                     BLOCK_M, False, UPCAST, PRECISION)
            else:
                dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqt, sdt, slt,
                                     offs_n, offs_d, 0, seq_len, seq_len, qk_scale,
                                     BLOCK_M, False, UPCAST, PRECISION)
        dk = dk * sm_scale
        tl.store(DK + b64 * sdkb + hk * sdkh + (start + cols) * sdkt + offs_d[None, :],
                 rounded(dk, DK.dtype.element_ty, UPCAST).to(DK.dtype.element_ty), mask=col_ok[:, None])
        tl.store(DV + b64 * sdvb + hk * sdvh + (start + cols) * sdvt + offs_d[None, :],
                 rounded(dv, DV.dtype.element_ty, UPCAST).to(DV.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, k_base, v_base, skt, svt, offs_m, offs_d, lo, hi, seq_len, qk_scale,
              BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
              UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    offs_j = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_j
        cols = offs_n[None, :].to(tl.int64)
        if MASK:
            kt = tl.load(k_base + cols * skt + offs_d[:, None], mask=offs_n[None, :] < seq_len, other=0.0)
            vt = tl.load(v_base + cols * svt + offs_d[:, None], mask=offs_n[None, :] < seq_len, other=0.0)
        else:
            kt = tl.load(k_base + cols * skt + offs_d[:, None])  # (D, BLOCK_N)
            vt = tl.load(v_base + cols * svt + offs_d[:, None])
        in_dtype = kt.dtype
        if UPCAST:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        qk = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        p = tl.math.exp2(qk - lse2[:, None])
        if MASK:
            keep = offs_n[None, :] < seq_len
            if CAUSAL:
                keep = keep & (offs_n[None, :] <= offs_m[:, None])
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, vt, input_precision=PRECISION)
        ds = rounded(p * (dp - delta[:, None]), in_dtype, UPCAST)
        dq = tl.dot(ds, tl.trans(kt), dq, input_precision=PRECISION)
    return dq


@jit_counts
def attn_bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, STARTS, LENS,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdb, sdh, sdt, sdqb, sdqh, sdqt, slb, slh, slt,
    sm_scale, qk_scale, num_seqs, num_heads, max_seqlen, group, SEQLEN_KEY,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    n_bh = num_seqs * num_heads
    bh = pid % n_bh
    start_m = tl.cdiv(max_seqlen, BLOCK_M) - 1 - pid // n_bh  # heaviest causal tiles first
    b = bh // num_heads
    h = bh % num_heads
    seq_len = tl.load(LENS + b)
    if start_m * BLOCK_M < seq_len:
        start = tl.load(STARTS + b).to(tl.int64)
        b64 = b.to(tl.int64)
        h64 = h.to(tl.int64)
        hk = (h // group).to(tl.int64)
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        row_ok = offs_m < seq_len
        rows = offs_m.to(tl.int64)
        q = tl.load(Q + b64 * sqb + h64 * sqh + (start + rows[:, None]) * sqt + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)
        do = tl.load(DO + b64 * sdb + h64 * sdh + (start + rows[:, None]) * sdt + offs_d[None, :],
                     mask=row_ok[:, None], other=0.0)
        lse2 = tl.load(LSE + b64 * slb + h64 * slh + (start + rows) * slt, mask=row_ok, other=float("inf")) * LOG2E
        delta = tl.load(DELTA + b64 * slb + h64 * slh + (start + rows) * slt, mask=row_ok, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        k_base = K + b64 * skb + hk * skh + start * skt
        v_base = V + b64 * svb + hk * svh + start * svt
        dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        if CAUSAL:
            dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, skt, svt, offs_m, offs_d,
                           0, start_m * BLOCK_M, seq_len, qk_scale, BLOCK_N, False, CAUSAL, UPCAST, PRECISION)
            dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, skt, svt, offs_m, offs_d,
                           start_m * BLOCK_M, tl.minimum((start_m + 1) * BLOCK_M, seq_len), seq_len, qk_scale,
                           BLOCK_N, True, CAUSAL, UPCAST, PRECISION)
        else:
            full = (seq_len // BLOCK_N) * BLOCK_N
            dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, skt, svt, offs_m, offs_d,
                           0, full, seq_len, qk_scale, BLOCK_N, False, CAUSAL, UPCAST, PRECISION)
            dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, skt, svt, offs_m, offs_d,
                           full, seq_len, seq_len, qk_scale, BLOCK_N, True, CAUSAL, UPCAST, PRECISION)
        dq = dq * sm_scale
        tl.store(DQ + b64 * sdqb + h64 * sdqh + (start + rows[:, None]) * sdqt + offs_d[None, :],
                 rounded(dq, DQ.dtype.element_ty, UPCAST).to(DQ.dtype.element_ty), mask=row_ok[:, None])
