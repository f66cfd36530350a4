"""Triton forward kernel: causal flash attention over B sequences (padded rows or packed docs).

One program computes one ``BLOCK_M`` tile of query rows of one (sequence, query head):
online softmax over ``BLOCK_N`` key tiles of the same sequence, fp32 accumulation, and the
natural-log log-sum-exp of the scaled scores saved per row for the backward.

Work skipped, which is the point of the kernel:
- tiles past a sequence's length exit at once (padding costs no FLOPs);
- causal: key tiles above the diagonal are never loaded. Tiles strictly below the
  diagonal run without any mask; only the ``BLOCK_M`` wide diagonal band (and, when not
  causal, the key tail) applies the element mask. This needs ``BLOCK_M % BLOCK_N == 0``.

Programs are numbered so that the longest causal rows (the last query tiles) start
first, which balances the triangle across SMs.

Masked scores are set to ``-1e30`` rather than ``-inf``: a fully masked row then stays
finite (never NaN) and its ``exp2`` underflows to exactly 0 once any real key is seen.
``UPCAST`` (constexpr, set under ``TRITON_INTERPRET=1``) casts 16-bit operands to fp32
before ``tl.dot``, because the interpreter's bf16 dot is wrong. Values the compiled kernel
rounds to the input dtype (probabilities, dS, outputs) are still rounded there, by
:func:`rounded`, because the interpreter's own fp32->bf16 cast truncates instead of
rounding to nearest even; so interpreted numerics match the compiled kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

MASKED = tl.constexpr(-1.0e30)
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def rounded(x, DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """fp32 ``x`` rounded to nearest even in ``DTYPE``: a DTYPE tensor, or fp32 when UPCAST."""
    if UPCAST:
        if DTYPE == tl.bfloat16:  # RTNE by hand: add 0x7FFF + lsb, drop the low 16 bits
            bits = x.to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            return bits.to(tl.float32, bitcast=True)
        else:
            return x.to(DTYPE).to(tl.float32)
    else:
        return x.to(DTYPE)


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d,
               lo, hi, seq_len, qk_scale,
               BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
               UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kt_ptrs = k_base + cols[None, :].to(tl.int64) * stride_kt + offs_d[:, None]  # (D, BLOCK_N)
        v_ptrs = v_base + cols[:, None].to(tl.int64) * stride_vt + offs_d[None, :]  # (BLOCK_N, D)
        if MASK:
            kt = tl.load(kt_ptrs, mask=cols[None, :] < seq_len, other=0.0)
            v = tl.load(v_ptrs, mask=cols[:, None] < seq_len, other=0.0)
        else:
            kt = tl.load(kt_ptrs)
            v = tl.load(v_ptrs)
        in_dtype = v.dtype
        if UPCAST:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        if MASK:
            keep = cols[None, :] < seq_len
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            qk = tl.where(keep, qk, MASKED)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        p = rounded(p, in_dtype, UPCAST)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


_COUNTS = ("num_seqs", "num_heads", "num_kv_heads", "max_seqlen", "group", "SEQLEN_KEY")


def jit_counts(fn):
    """``triton.jit`` that does not specialize the count arguments (a B=1 batch or an odd
    max_seqlen would otherwise compile new variants); strides still are, for vector loads."""
    names = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    return triton.jit(fn, do_not_specialize=[a for a in _COUNTS if a in names])


@jit_counts
def attn_fwd_kernel(
    Q, K, V, O, LSE, STARTS, LENS,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot, slb, slh, slt,
    qk_scale, num_seqs, num_heads, max_seqlen, group, SEQLEN_KEY,
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
        hk = (h // group).to(tl.int64)
        h64 = h.to(tl.int64)
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        row_ok = offs_m < seq_len
        q_base = Q + b64 * sqb + h64 * sqh + start * sqt
        k_base = K + b64 * skb + hk * skh + start * skt
        v_base = V + b64 * svb + hk * svh + start * svt
        q = tl.load(q_base + offs_m[:, None].to(tl.int64) * sqt + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        if CAUSAL:
            # strictly below the diagonal band: every key < start_m*BLOCK_M < seq_len, no mask
            acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, skt, svt, offs_m, offs_d,
                                       0, start_m * BLOCK_M, seq_len, qk_scale,
                                       BLOCK_N, False, CAUSAL, UPCAST, PRECISION)
            acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, skt, svt, offs_m, offs_d,
                                       start_m * BLOCK_M, tl.minimum((start_m + 1) * BLOCK_M, seq_len),
                                       seq_len, qk_scale, BLOCK_N, True, CAUSAL, UPCAST, PRECISION)
        else:
            full = (seq_len // BLOCK_N) * BLOCK_N
            acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, skt, svt, offs_m, offs_d,
                                       0, full, seq_len, qk_scale,
                                       BLOCK_N, False, CAUSAL, UPCAST, PRECISION)
            acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, skt, svt, offs_m, offs_d,
                                       full, seq_len, seq_len, qk_scale,
                                       BLOCK_N, True, CAUSAL, UPCAST, PRECISION)
        acc = acc / l_i[:, None]
        lse = (m_i + tl.math.log2(l_i)) * LN2  # natural-log LSE of scale * q.k
        o_base = O + b64 * sob + h64 * soh + start * sot
        tl.store(o_base + offs_m[:, None].to(tl.int64) * sot + offs_d[None, :],
                 rounded(acc, O.dtype.element_ty, UPCAST).to(O.dtype.element_ty), mask=row_ok[:, None])
        lse_base = LSE + b64 * slb + h64 * slh + start * slt
        tl.store(lse_base + offs_m.to(tl.int64) * slt, lse, mask=row_ok)
