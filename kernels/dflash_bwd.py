"""Triton backward kernels of DFlash attention: deterministic, no atomics.

With ``S = scale q k^T``, ``P = exp(S - lse)`` (lse from the forward), ``delta =
rowsum(O * dO)`` (the causal kernels' preprocess, run over all draft rows as one sequence)
and ``dS = P * (dO V^T - delta)``:

- :func:`dflash_bwd_dq_kernel`: one program per (query tile, query head) recomputes ``P``
  over the same keys as the forward, with the same three masks (context below the tile's
  first anchor unmasked, up to its last anchor with ``col < a_row``, then the own-block
  diagonal tile in column chunks) and writes ``dQ = scale * dS K``.
- :func:`dflash_bwd_dkdv_blk_kernel`: one program per (tile of ``BLOCK_N`` own-block keys,
  key/value head). Those keys are seen by the same rows' queries only, so it loops over
  just those rows and every query head of the GQA group and writes ``dK_blk = scale * dS^T
  Q`` and ``dV_blk = P^T dO``. (Folding this into the dQ program needs three fp32
  accumulators at once, which spilled registers at D = 128.)
- :func:`dflash_bwd_dkdv_ctx_kernel`: one program per (context key tile of ``BLOCK_N``
  positions of one document, key/value head). The blocks that see any key of the tile
  ``[c, c + BLOCK_N)`` are those with ``a_j > c`` and, under a sliding window W, whose
  first row's window starts inside it (``a_j + 1 - W < c + BLOCK_N``): a run of the
  document's sorted anchors found by binary search, so a tile outside every window costs
  two searches. Of those, blocks with ``a_j >= c + BLOCK_N`` (and ``a_j + B - W <= c``)
  see the whole tile and run without a mask; the others apply ``lo_row <= col < a_j``. It
  accumulates ``dK_ctx``/``dV_ctx`` over those rows and every query head of the group.

Every gradient element is written by exactly one program, in a fixed order, so results
are bitwise reproducible. The price is that the dQ kernel recomputes ``P`` and ``dP``: 7
matmuls per (query, key) tile pair instead of the 5 of an atomic-add dQ, i.e. 3.5x the
forward's 2 (the benchmark's TFLOP/s still counts the backward as 2.5x, by convention).
Rows past a document's draft rows load ``lse = +inf``, so their probabilities are exactly 0.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .dflash_fwd import FULL, LIMIT, SAME_BLOCK, context_spans, first_greater, jit_dflash, keep_mask, locate, window_lo
from .flash_fwd import rounded

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, k_base, v_base, skt, svt, offs_d, lim, lim_lo, lo, hi, load_hi, qk_scale,
              BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MODE: tl.constexpr,
              UPCAST: tl.constexpr, PRECISION: tl.constexpr, WINDOWED: tl.constexpr):
    """dQ (unscaled) from keys ``[lo, hi)`` of ``k_base``/``v_base``, masked as in the forward's MODE."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kt_ptrs = k_base + cols[None, :].to(tl.int64) * skt + offs_d[:, None]  # (D, BLOCK_N)
        vt_ptrs = v_base + cols[None, :].to(tl.int64) * svt + offs_d[:, None]
        if MODE == FULL:
            kt = tl.load(kt_ptrs)
            vt = tl.load(vt_ptrs)
        else:
            kt = tl.load(kt_ptrs, mask=cols[None, :] < load_hi, other=0.0)
            vt = tl.load(vt_ptrs, mask=cols[None, :] < load_hi, other=0.0)
        in_dtype = kt.dtype
        if UPCAST:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        qk = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        p = tl.math.exp2(qk - lse2[:, None])
        if MODE != FULL:
            p = tl.where(keep_mask(cols, lim, lim_lo, MODE, BLOCK_SIZE, WINDOWED), p, 0.0)
        dp = tl.dot(do, vt, input_precision=PRECISION)
        ds = rounded(p * (dp - delta[:, None]), in_dtype, UPCAST)
        dq = tl.dot(ds, tl.trans(kt), dq, input_precision=PRECISION)
    return dq


@jit_dflash
def dflash_bwd_dq_kernel(
    Q, KC, VC, KB, VB, DO, DQ, LSE, DELTA, CU_CTX, CU_BLK, ANCHORS, CU_TILES,
    sqt, sqh, skct, skch, svct, svch, skbt, skbh, svbt, svbh, sdot, sdoh, sdqt, sdqh, slh,
    sm_scale, qk_scale, num_docs, group, docs_iter, window,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, WINDOWED: tl.constexpr,
):
    h = tl.program_id(0)
    t = tl.num_programs(1) - 1 - tl.program_id(1)  # last tiles (largest anchors, most work) first
    if t < tl.load(CU_TILES + num_docs):
        doc, tile = locate(CU_TILES, t, num_docs, docs_iter)
        r0 = tl.load(CU_BLK + doc)
        rows = tl.load(CU_BLK + doc + 1) - r0
        c0 = tl.load(CU_CTX + doc).to(tl.int64)
        h64 = h.to(tl.int64)
        hk = (h // group).to(tl.int64)
        t0 = r0 + tile * BLOCK_M  # the tile's first global draft row
        left = rows - tile * BLOCK_M  # draft rows of the document from this tile on
        loc = tl.arange(0, BLOCK_M)  # rows within the tile: int32 offsets from the tile's base
        offs_d = tl.arange(0, HEAD_DIM)
        row_ok = loc < left
        a_row = tl.load(ANCHORS + (t0 + loc) // BLOCK_SIZE, mask=row_ok, other=0)
        a_lo = tl.load(ANCHORS + t0 // BLOCK_SIZE)
        a_hi = tl.max(a_row, 0)
        t64 = t0.to(tl.int64)
        q = tl.load(Q + t64 * sqt + h64 * sqh + loc[:, None] * sqt + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        do = tl.load(DO + t64 * sdot + h64 * sdoh + loc[:, None] * sdot + offs_d[None, :], mask=row_ok[:, None],
                     other=0.0)
        lse2 = tl.load(LSE + h64 * slh + t64 + loc, mask=row_ok, other=float("inf")) * LOG2E
        delta = tl.load(DELTA + h64 * slh + t64 + loc, mask=row_ok, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        kc_base = KC + c0 * skct + hk * skch
        vc_base = VC + c0 * svct + hk * svch
        dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        full_hi = (a_lo // BLOCK_N) * BLOCK_N
        full_lo = full_hi * 0
        lo_row = a_row  # unused without a window
        if WINDOWED:
            lo_row = window_lo(a_row, loc % BLOCK_SIZE, window)  # (BLOCK_M,)
            start, full_lo, full_hi = context_spans(a_lo, a_hi, window, BLOCK_N, BLOCK_SIZE)
            dq = _dq_inner(dq, q, do, lse2, delta, kc_base, vc_base, skct, svct, offs_d, a_row, lo_row, start,
                           full_lo, a_hi, qk_scale, BLOCK_N, BLOCK_SIZE, LIMIT, UPCAST, PRECISION, True)
        dq = _dq_inner(dq, q, do, lse2, delta, kc_base, vc_base, skct, svct, offs_d, a_row, lo_row, full_lo, full_hi,
                       full_hi, qk_scale, BLOCK_N, BLOCK_SIZE, FULL, UPCAST, PRECISION, WINDOWED)
        dq = _dq_inner(dq, q, do, lse2, delta, kc_base, vc_base, skct, svct, offs_d, a_row, lo_row, full_hi, a_hi,
                       a_hi, qk_scale, BLOCK_N, BLOCK_SIZE, LIMIT, UPCAST, PRECISION, WINDOWED)
        dq = _dq_inner(dq, q, do, lse2, delta, KB + t64 * skbt + hk * skbh, VB + t64 * svbt + hk * svbh, skbt, svbt,
                       offs_d, loc // BLOCK_SIZE, loc, 0, tl.minimum(left, BLOCK_M), left, qk_scale,
                       BLOCK_N, BLOCK_SIZE, SAME_BLOCK, UPCAST, PRECISION, WINDOWED)
        dq = dq * sm_scale
        tl.store(DQ + t64 * sdqt + h64 * sdqh + loc[:, None] * sdqt + offs_d[None, :],
                 rounded(dq, DQ.dtype.element_ty, UPCAST).to(DQ.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _dkdv_rows(dk, dv, k, v, q_base, do_base, lse_base, delta_base, ANCHORS, sqt, sdot, offs_n, offs_d,
               lo, hi, qk_scale, window,
               BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, MODE: tl.constexpr,
               UPCAST: tl.constexpr, PRECISION: tl.constexpr, WINDOWED: tl.constexpr):
    """dK (unscaled) and dV of one key tile from global draft rows ``[lo, hi)``.

    ``offs_n`` holds the tile's key positions: context positions within the document (FULL,
    LIMIT: keep ``lo_row <= col < a_row``, :func:`window_lo`) or global draft rows (SAME_BLOCK: keep ``col // B == row // B``).
    """
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
        qkt = tl.dot(k, qt, input_precision=PRECISION) * qk_scale  # (BLOCK_N, BLOCK_M), log2 units
        pt = tl.math.exp2(qkt - lse2[None, :])
        if MODE == LIMIT:
            a_row = tl.load(ANCHORS + r64 // BLOCK_SIZE, mask=row_ok, other=0)
            if WINDOWED:
                lo_row = window_lo(a_row, rows % BLOCK_SIZE, window)  # draft rows start at multiples of B
                pt = tl.where((offs_n[:, None] < a_row[None, :]) & (offs_n[:, None] >= lo_row[None, :]), pt, 0.0)
            else:
                pt = tl.where(offs_n[:, None] < a_row[None, :], pt, 0.0)
        elif MODE == SAME_BLOCK:
            pt = tl.where((offs_n[:, None] // BLOCK_SIZE) == (rows[None, :] // BLOCK_SIZE), pt, 0.0)
        dv = tl.dot(rounded(pt, in_dtype, UPCAST), do, dv, input_precision=PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # (BLOCK_N, BLOCK_M)
        dst = rounded(pt * (dpt - delta[None, :]), in_dtype, UPCAST)
        dk = tl.dot(dst, tl.trans(qt), dk, input_precision=PRECISION)
    return dk, dv


@jit_dflash
def dflash_bwd_dkdv_blk_kernel(
    Q, KB, VB, DO, DKB, DVB, LSE, DELTA, CU_BLK, ANCHORS, CU_TILES,
    sqt, sqh, skbt, skbh, svbt, svbh, sdot, sdoh, sdkt, sdkh, sdvt, sdvh, slh,
    sm_scale, qk_scale, num_docs, group, docs_iter,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, WINDOWED: tl.constexpr,
):
    hk = tl.program_id(0)
    t = tl.program_id(1)
    if t < tl.load(CU_TILES + num_docs):
        doc, tile = locate(CU_TILES, t, num_docs, docs_iter)
        r0 = tl.load(CU_BLK + doc)
        r1 = tl.load(CU_BLK + doc + 1)
        k_lo = r0 + tile * BLOCK_N  # the tile's first key row (global); BLOCK_N is a multiple of B
        k_hi = tl.minimum(k_lo + BLOCK_N, r1)
        hk64 = hk.to(tl.int64)
        offs_n = k_lo + tl.arange(0, BLOCK_N)  # global draft rows = this tile's own-block keys
        offs_d = tl.arange(0, HEAD_DIM)
        key_ok = offs_n < k_hi
        loc = tl.arange(0, BLOCK_N)[:, None]  # int32 offsets from the tile's base row
        k64 = k_lo.to(tl.int64)
        kb = tl.load(KB + k64 * skbt + hk64 * skbh + loc * skbt + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        vb = tl.load(VB + k64 * svbt + hk64 * svbh + loc * svbt + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        if UPCAST:
            kb = kb.to(tl.float32)
            vb = vb.to(tl.float32)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        for g in range(0, group):
            h64 = hk64 * group + g
            dk, dv = _dkdv_rows(dk, dv, kb, vb, Q + h64 * sqh, DO + h64 * sdoh, LSE + h64 * slh, DELTA + h64 * slh,
                                ANCHORS, sqt, sdot, offs_n, offs_d, k_lo, k_hi, qk_scale, 0,
                                BLOCK_M, BLOCK_SIZE, SAME_BLOCK, UPCAST, PRECISION, False)
        dk = dk * sm_scale
        tl.store(DKB + k64 * sdkt + hk64 * sdkh + loc * sdkt + offs_d[None, :],
                 rounded(dk, DKB.dtype.element_ty, UPCAST).to(DKB.dtype.element_ty), mask=key_ok[:, None])
        tl.store(DVB + k64 * sdvt + hk64 * sdvh + loc * sdvt + offs_d[None, :],
                 rounded(dv, DVB.dtype.element_ty, UPCAST).to(DVB.dtype.element_ty), mask=key_ok[:, None])


@jit_dflash
def dflash_bwd_dkdv_ctx_kernel(
    Q, KC, VC, DO, DKC, DVC, LSE, DELTA, CU_CTX, CU_BLK, ANCHORS, CU_TILES,
    sqt, sqh, skct, skch, svct, svch, sdot, sdoh, sdkt, sdkh, sdvt, sdvh, slh,
    sm_scale, qk_scale, num_docs, group, docs_iter, blocks_iter, window,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, WINDOWED: tl.constexpr,
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
        j2 = b1
        if WINDOWED:  # past the window: a block's first row (the widest) starts at a_j + 1 - W > col_lo + BLOCK_N - 1
            j2 = first_greater(ANCHORS, j0, b1, col_lo + BLOCK_N + window - 2, blocks_iter)
        if j0 < j2:
            j1 = first_greater(ANCHORS, j0, j2, col_lo + BLOCK_N - 1, blocks_iter)  # a_j >= col_lo + BLOCK_N
            j3 = j2
            if WINDOWED:  # whole tile inside the window of every row: the last row's start a_j + B - W <= col_lo
                j3 = first_greater(ANCHORS, j1, j2, col_lo + window - BLOCK_SIZE, blocks_iter)
            hk64 = hk.to(tl.int64)
            offs_n = col_lo + tl.arange(0, BLOCK_N)  # context positions within the document
            offs_d = tl.arange(0, HEAD_DIM)
            col_ok = offs_n < seq
            loc = tl.arange(0, BLOCK_N)[:, None]  # int32 offsets from the tile's base position
            c64 = (c0 + col_lo).to(tl.int64)
            kc = tl.load(KC + c64 * skct + hk64 * skch + loc * skct + offs_d[None, :], mask=col_ok[:, None], other=0.0)
            vc = tl.load(VC + c64 * svct + hk64 * svch + loc * svct + offs_d[None, :], mask=col_ok[:, None], other=0.0)
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
                                    offs_n, offs_d, j0 * BLOCK_SIZE, j1 * BLOCK_SIZE, qk_scale, window,
                                    BLOCK_M, BLOCK_SIZE, LIMIT, UPCAST, PRECISION, WINDOWED)
                dk, dv = _dkdv_rows(dk, dv, kc, vc, q_base, do_base, lse_base, delta_base, ANCHORS, sqt, sdot,
                                    offs_n, offs_d, j1 * BLOCK_SIZE, j3 * BLOCK_SIZE, qk_scale, window,
                                    BLOCK_M, BLOCK_SIZE, FULL, UPCAST, PRECISION, WINDOWED)
                dk, dv = _dkdv_rows(dk, dv, kc, vc, q_base, do_base, lse_base, delta_base, ANCHORS, sqt, sdot,
                                    offs_n, offs_d, j3 * BLOCK_SIZE, j2 * BLOCK_SIZE, qk_scale, window,
                                    BLOCK_M, BLOCK_SIZE, LIMIT, UPCAST, PRECISION, WINDOWED)
            dk = dk * sm_scale
            tl.store(DKC + c64 * sdkt + hk64 * sdkh + loc * sdkt + offs_d[None, :],
                     rounded(dk, DKC.dtype.element_ty, UPCAST).to(DKC.dtype.element_ty), mask=col_ok[:, None])
            tl.store(DVC + c64 * sdvt + hk64 * sdvh + loc * sdvt + offs_d[None, :],
                     rounded(dv, DVC.dtype.element_ty, UPCAST).to(DVC.dtype.element_ty), mask=col_ok[:, None])
