"""Triton backward kernels of DFlash attention: deterministic, no atomics.

With ``S = scale q k^T``, ``P = exp(S - lse)`` (lse from the forward), ``delta =
rowsum(O * dO)`` (the causal kernels' preprocess, run over all draft rows as one sequence)
and ``dS = P * (dO V^T - delta)``:

- :func:`dflash_bwd_dq_kernel`: one program per (query tile, key/value head). For each query
  head of the GQA group it recomputes ``P`` over the tile's context range (as in the
  forward: unmasked below the first anchor, per-row limit up to the last) and over the
  dense own-block diagonal tile, and writes ``dQ = scale * dS K``. The own-block keys are
  seen by this tile's rows only, so the same program also owns ``dK_blk = scale * dS^T Q``
  and ``dV_blk = P^T dO`` of those rows, summed over the group in registers.
- :func:`dflash_bwd_dkdv_ctx_kernel`: one program per (context key tile of ``BLOCK_N``
  positions of one document, key/value head). The blocks that see any key of the tile
  ``[c, c + BLOCK_N)`` are those with ``a_j > c``, a suffix of the document's sorted
  anchors found by binary search; of those, blocks with ``a_j >= c + BLOCK_N`` see the whole
  tile and run without a mask, and only the blocks in between apply ``col < a_j``. It
  accumulates ``dK_ctx``/``dV_ctx`` over those rows and every query head of the group.

Every gradient element is written by exactly one program, in a fixed order, so results
are bitwise reproducible. The price is recomputing ``P`` in both kernels (backward about
2.5x the forward FLOPs). Rows past a document's draft rows load ``lse = +inf``, so their
probabilities are exactly 0.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .dflash_fwd import first_greater, jit_dflash, locate
from .flash_fwd import rounded

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _dq_ctx(dq, q, do, lse2, delta, kc_base, vc_base, skct, svct, offs_d, a_row, lo, hi, qk_scale,
            BLOCK_N: tl.constexpr, MASK: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """dQ (unscaled) from context keys ``[lo, hi)``; ``MASK``: keep ``col < a_row``."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kt_ptrs = kc_base + cols[None, :].to(tl.int64) * skct + offs_d[:, None]  # (D, BLOCK_N)
        vt_ptrs = vc_base + cols[None, :].to(tl.int64) * svct + offs_d[:, None]
        if MASK:
            kt = tl.load(kt_ptrs, mask=cols[None, :] < hi, other=0.0)
            vt = tl.load(vt_ptrs, mask=cols[None, :] < hi, other=0.0)
        else:
            kt = tl.load(kt_ptrs)
            vt = tl.load(vt_ptrs)
        in_dtype = kt.dtype
        if UPCAST:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        qk = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        p = tl.math.exp2(qk - lse2[:, None])
        if MASK:
            p = tl.where(cols[None, :] < a_row[:, None], p, 0.0)
        dp = tl.dot(do, vt, input_precision=PRECISION)
        ds = rounded(p * (dp - delta[:, None]), in_dtype, UPCAST)
        dq = tl.dot(ds, tl.trans(kt), dq, input_precision=PRECISION)
    return dq


@jit_dflash
def dflash_bwd_dq_kernel(
    Q, KC, VC, KB, VB, DO, DQ, DKB, DVB, LSE, DELTA, CU_CTX, CU_BLK, ANCHORS, CU_TILES,
    sqt, sqh, skct, skch, svct, svch, skbt, skbh, svbt, svbh, sdot, sdoh, sdqt, sdqh,
    sdkbt, sdkbh, sdvbt, sdvbh, slh,
    sm_scale, qk_scale, num_docs, group, docs_iter,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    hk = tl.program_id(0)
    t = tl.program_id(1)
    if t < tl.load(CU_TILES + num_docs):
        doc, tile = locate(CU_TILES, t, num_docs, docs_iter)
        r0 = tl.load(CU_BLK + doc)
        rows = tl.load(CU_BLK + doc + 1) - r0
        c0 = tl.load(CU_CTX + doc).to(tl.int64)
        hk64 = hk.to(tl.int64)
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # draft rows within the document
        offs_d = tl.arange(0, HEAD_DIM)
        row_ok = offs_m < rows
        grow = (r0 + offs_m).to(tl.int64)
        a_row = tl.load(ANCHORS + grow // BLOCK_SIZE, mask=row_ok, other=0)
        a_lo = tl.load(ANCHORS + (r0 + tile * BLOCK_M) // BLOCK_SIZE)
        a_hi = tl.max(a_row, 0)
        full = (a_lo // BLOCK_N) * BLOCK_N
        kc_base = KC + c0 * skct + hk64 * skch
        vc_base = VC + c0 * svct + hk64 * svch
        kb = tl.load(KB + grow[:, None] * skbt + hk64 * skbh + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        vb = tl.load(VB + grow[:, None] * svbt + hk64 * svbh + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        in_dtype = kb.dtype
        if UPCAST:
            kb = kb.to(tl.float32)
            vb = vb.to(tl.float32)
        same = (offs_m[:, None] // BLOCK_SIZE) == (offs_m[None, :] // BLOCK_SIZE)
        dkb = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        dvb = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        for g in range(0, group):
            h64 = hk64 * group + g
            q = tl.load(Q + grow[:, None] * sqt + h64 * sqh + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            do = tl.load(DO + grow[:, None] * sdot + h64 * sdoh + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            lse2 = tl.load(LSE + h64 * slh + grow, mask=row_ok, other=float("inf")) * LOG2E
            delta = tl.load(DELTA + h64 * slh + grow, mask=row_ok, other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
            dq = _dq_ctx(dq, q, do, lse2, delta, kc_base, vc_base, skct, svct, offs_d, a_row, 0, full, qk_scale,
                         BLOCK_N, False, UPCAST, PRECISION)
            dq = _dq_ctx(dq, q, do, lse2, delta, kc_base, vc_base, skct, svct, offs_d, a_row, full, a_hi, qk_scale,
                         BLOCK_N, True, UPCAST, PRECISION)
            qk = tl.dot(q, tl.trans(kb), input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_M)
            p = tl.where(same, tl.math.exp2(qk - lse2[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(vb), input_precision=PRECISION)
            ds = rounded(p * (dp - delta[:, None]), in_dtype, UPCAST)
            dq = tl.dot(ds, kb, dq, input_precision=PRECISION)
            dvb = tl.dot(tl.trans(rounded(p, in_dtype, UPCAST)), do, dvb, input_precision=PRECISION)
            dkb = tl.dot(tl.trans(ds), q, dkb, input_precision=PRECISION)
            dq = dq * sm_scale
            tl.store(DQ + grow[:, None] * sdqt + h64 * sdqh + offs_d[None, :],
                     rounded(dq, DQ.dtype.element_ty, UPCAST).to(DQ.dtype.element_ty), mask=row_ok[:, None])
        dkb = dkb * sm_scale
        tl.store(DKB + grow[:, None] * sdkbt + hk64 * sdkbh + offs_d[None, :],
                 rounded(dkb, DKB.dtype.element_ty, UPCAST).to(DKB.dtype.element_ty), mask=row_ok[:, None])
        tl.store(DVB + grow[:, None] * sdvbt + hk64 * sdvbh + offs_d[None, :],
                 rounded(dvb, DVB.dtype.element_ty, UPCAST).to(DVB.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _dkdv_rows(dk, dv, kc, vc, q_base, do_base, lse_base, delta_base, ANCHORS, sqt, sdot, offs_n, offs_d,
               lo, hi, qk_scale,
               BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASK: tl.constexpr,
               UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """dK (unscaled) and dV of one context tile from global draft rows ``[lo, hi)``; ``MASK``: ``col < a_row``."""
    offs_i = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_i
        row_ok = rows < hi
        r64 = rows.to(tl.int64)
        qt = tl.load(q_base + r64[None, :] * sqt + offs_d[:, None], mask=row_ok[None, :], other=0.0)  # (D, BLOCK_M)
        do = tl.load(do_base + r64[:, None] * sdot + offs_d[None, :], mask=row_ok[:, None], other=0.0)  # (BLOCK_M, D)
        lse2 = tl.load(lse_base + r64, mask=row_ok, other=float("inf")) * LOG2E
        delta = tl.load(delta_base + r64, mask=row_ok, other=0.0)
        in_dtype = do.dtype
        if UPCAST:
            qt = qt.to(tl.float32)
            do = do.to(tl.float32)
        qkt = tl.dot(kc, qt, input_precision=PRECISION) * qk_scale  # (BLOCK_N, BLOCK_M), log2 units
        pt = tl.math.exp2(qkt - lse2[None, :])
        if MASK:
            a_row = tl.load(ANCHORS + r64 // BLOCK_SIZE, mask=row_ok, other=0)
            pt = tl.where(offs_n[:, None] < a_row[None, :], pt, 0.0)
        dv = tl.dot(rounded(pt, in_dtype, UPCAST), do, dv, input_precision=PRECISION)
        dpt = tl.dot(vc, tl.trans(do), input_precision=PRECISION)  # (BLOCK_N, BLOCK_M)
        dst = rounded(pt * (dpt - delta[None, :]), in_dtype, UPCAST)
        dk = tl.dot(dst, tl.trans(qt), dk, input_precision=PRECISION)
    return dk, dv


@jit_dflash
def dflash_bwd_dkdv_ctx_kernel(
    Q, KC, VC, DO, DKC, DVC, LSE, DELTA, CU_CTX, CU_BLK, ANCHORS, CU_TILES,
    sqt, sqh, skct, skch, svct, svch, sdot, sdoh, sdkt, sdkh, sdvt, sdvh, slh,
    sm_scale, qk_scale, num_docs, group, docs_iter, blocks_iter,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    hk = tl.program_id(0)
    t = tl.program_id(1)
    if t < tl.load(CU_TILES + num_docs):
        doc, tile = locate(CU_TILES, t, num_docs, docs_iter)
        c0 = tl.load(CU_CTX + doc)
        seq = tl.load(CU_CTX + doc + 1) - c0
        b0 = tl.load(CU_BLK + doc) // BLOCK_SIZE
        b1 = tl.load(CU_BLK + doc + 1) // BLOCK_SIZE
        col_lo = tile * BLOCK_N
        j0 = first_greater(ANCHORS, b0, b1, col_lo, blocks_iter)  # first block with a_j > col_lo
        if j0 < b1:
            j1 = first_greater(ANCHORS, j0, b1, col_lo + BLOCK_N - 1, blocks_iter)  # a_j >= col_lo + BLOCK_N
            hk64 = hk.to(tl.int64)
            offs_n = col_lo + tl.arange(0, BLOCK_N)  # context positions within the document
            offs_d = tl.arange(0, HEAD_DIM)
            col_ok = offs_n < seq
            gcol = (c0 + offs_n).to(tl.int64)
            kc = tl.load(KC + gcol[:, None] * skct + hk64 * skch + offs_d[None, :], mask=col_ok[:, None], other=0.0)
            vc = tl.load(VC + gcol[:, None] * svct + hk64 * svch + offs_d[None, :], mask=col_ok[:, None], other=0.0)
            if UPCAST:
                kc = kc.to(tl.float32)
                vc = vc.to(tl.float32)
            dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
            dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
            for g in range(0, group):
                h64 = hk64 * group + g
                q_base = Q + h64 * sqh
                do_base = DO + h64 * sdoh
                lse_base = LSE + h64 * slh
                delta_base = DELTA + h64 * slh
                dk, dv = _dkdv_rows(dk, dv, kc, vc, q_base, do_base, lse_base, delta_base, ANCHORS, sqt, sdot,
                                    offs_n, offs_d, j0 * BLOCK_SIZE, j1 * BLOCK_SIZE, qk_scale,
                                    BLOCK_M, BLOCK_SIZE, True, UPCAST, PRECISION)
                dk, dv = _dkdv_rows(dk, dv, kc, vc, q_base, do_base, lse_base, delta_base, ANCHORS, sqt, sdot,
                                    offs_n, offs_d, j1 * BLOCK_SIZE, b1 * BLOCK_SIZE, qk_scale,
                                    BLOCK_M, BLOCK_SIZE, False, UPCAST, PRECISION)
            dk = dk * sm_scale
            tl.store(DKC + gcol[:, None] * sdkt + hk64 * sdkh + offs_d[None, :],
                     rounded(dk, DKC.dtype.element_ty, UPCAST).to(DKC.dtype.element_ty), mask=col_ok[:, None])
            tl.store(DVC + gcol[:, None] * sdvt + hk64 * sdvh + offs_d[None, :],
                     rounded(dv, DVC.dtype.element_ty, UPCAST).to(DVC.dtype.element_ty), mask=col_ok[:, None])
