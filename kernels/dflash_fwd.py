"""Triton forward kernel of DFlash attention, and the index helpers its backward shares.

Layout (see :func:`dflash_prep.kernels.attention_dflash`): per document ``d``, draft rows
``cu_blk[d]:cu_blk[d+1]`` (whole blocks of ``BLOCK_SIZE`` = B rows, block ``j`` with anchor
``a_j``, sorted) and context rows ``cu_ctx[d]:cu_ctx[d+1]``. Block ``j`` sees context
``[0, a_j)`` and its own B draft keys.

Work decomposition. A query tile is ``BLOCK_M`` draft rows of one document and one query
head; ``BLOCK_M`` is a multiple of B and tiles start at multiples of ``BLOCK_M`` inside the
document, so a tile holds whole blocks. Tiles are numbered across documents by the device
table ``CU_TILES`` (``cu_tiles[d]`` = tiles before document ``d``, computed with torch ops,
no host sync); a program finds its document by binary search over it (:func:`locate`).

Forward of one tile, online softmax with fp32 accumulation:

- context tiles ``[0, a_min)`` rounded down to ``BLOCK_N`` are loaded without any mask:
  every row of the tile sees them (``a_min`` = the tile's first anchor, anchors sorted);
- context tiles from there up to ``a_max`` (the tile's last anchor) apply the per-row
  limit ``col < a_row``; nothing at or beyond ``a_max`` is loaded;
- the tile's own blocks are one dense ``BLOCK_M x BLOCK_M`` diagonal tile of ``k_blk`` /
  ``v_blk`` (the same rows as the queries), masked to ``row // B == col // B``.

Masked scores are ``-1e30`` rather than ``-inf``: a row whose first context tile is fully
masked (anchor 0 in a tile with larger anchors) stays finite, and its weight is wiped to
exactly 0 by the rescale ``exp2(-1e30 - m)`` once a real score arrives, which the own block
guarantees. The natural-log log-sum-exp of the scaled scores is saved per (head, row).
``UPCAST``/``rounded`` handle the interpreter's bf16 ``tl.dot`` as in
:mod:`dflash_prep.kernels.flash_fwd`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .flash_fwd import LN2, MASKED, rounded

# runtime ints that must not be specialized (a value of 1 would compile a new variant)
COUNTS = ["num_docs", "group", "docs_iter", "blocks_iter"]


def jit_dflash(fn):
    names = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    return triton.jit(fn, do_not_specialize=[a for a in COUNTS if a in names])


@triton.jit
def first_greater(PTR, lo, hi, x, n_iter):
    """First index ``i`` in ``[lo, hi)`` with ``PTR[i] > x``, or ``hi``; ``PTR[lo:hi]`` is sorted.

    A fixed ``n_iter`` >= bit_length(hi - lo) halving steps (no data-dependent loop bound).
    ``lo`` and ``hi`` must be int32 tensors (not constants): they are loop-carried.
    """
    for _ in range(0, n_iter):
        active = lo < hi
        mid = (lo + hi) // 2
        val = tl.load(PTR + mid, mask=active, other=0)
        lo = tl.where(active & (val <= x), mid + 1, lo)
        hi = tl.where(active & (val > x), mid, hi)
    return lo


@triton.jit
def locate(CU_TILES, t, num_docs, docs_iter):
    """(document, tile within it) of global tile ``t`` < ``CU_TILES[num_docs]``."""
    doc = first_greater(CU_TILES, num_docs * 0, num_docs + 1, t, docs_iter) - 1
    return doc, t - tl.load(CU_TILES + doc)


@triton.jit
def _fwd_ctx(acc, l_i, m_i, q, kc_base, vc_base, skct, svct, offs_d, a_row, lo, hi, qk_scale,
             BLOCK_N: tl.constexpr, MASK: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Online softmax over context keys ``[lo, hi)``; ``MASK``: keep ``col < a_row`` (and load ``col < hi``)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kt_ptrs = kc_base + cols[None, :].to(tl.int64) * skct + offs_d[:, None]  # (D, BLOCK_N)
        v_ptrs = vc_base + cols[:, None].to(tl.int64) * svct + offs_d[None, :]  # (BLOCK_N, D)
        if MASK:
            kt = tl.load(kt_ptrs, mask=cols[None, :] < hi, other=0.0)
            v = tl.load(v_ptrs, mask=cols[:, None] < hi, other=0.0)
        else:
            kt = tl.load(kt_ptrs)
            v = tl.load(v_ptrs)
        in_dtype = v.dtype
        if UPCAST:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        if MASK:
            qk = tl.where(cols[None, :] < a_row[:, None], qk, MASKED)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(rounded(p, in_dtype, UPCAST), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@jit_dflash
def dflash_fwd_kernel(
    Q, KC, VC, KB, VB, O, LSE, CU_CTX, CU_BLK, ANCHORS, CU_TILES,
    sqt, sqh, skct, skch, svct, svch, skbt, skbh, svbt, svbh, sot, soh, slh,
    qk_scale, num_docs, group, docs_iter,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    h = tl.program_id(0)
    t = tl.program_id(1)
    if t < tl.load(CU_TILES + num_docs):
        doc, tile = locate(CU_TILES, t, num_docs, docs_iter)
        r0 = tl.load(CU_BLK + doc)
        rows = tl.load(CU_BLK + doc + 1) - r0
        c0 = tl.load(CU_CTX + doc).to(tl.int64)
        h64 = h.to(tl.int64)
        hk = (h // group).to(tl.int64)
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # draft rows within the document
        offs_d = tl.arange(0, HEAD_DIM)
        row_ok = offs_m < rows
        grow = (r0 + offs_m).to(tl.int64)  # global draft rows
        a_row = tl.load(ANCHORS + grow // BLOCK_SIZE, mask=row_ok, other=0)  # (BLOCK_M,)
        a_lo = tl.load(ANCHORS + (r0 + tile * BLOCK_M) // BLOCK_SIZE)  # sorted: the tile's smallest
        a_hi = tl.max(a_row, 0)
        q = tl.load(Q + grow[:, None] * sqt + h64 * sqh + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        kc_base = KC + c0 * skct + hk * skch
        vc_base = VC + c0 * svct + hk * svch
        full = (a_lo // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _fwd_ctx(acc, l_i, m_i, q, kc_base, vc_base, skct, svct, offs_d, a_row, 0, full,
                                 qk_scale, BLOCK_N, False, UPCAST, PRECISION)
        acc, l_i, m_i = _fwd_ctx(acc, l_i, m_i, q, kc_base, vc_base, skct, svct, offs_d, a_row, full, a_hi,
                                 qk_scale, BLOCK_N, True, UPCAST, PRECISION)
        # own blocks: one dense diagonal tile over the same rows, block-diagonal mask
        kbt = tl.load(KB + grow[None, :] * skbt + hk * skbh + offs_d[:, None], mask=row_ok[None, :], other=0.0)
        vb = tl.load(VB + grow[:, None] * svbt + hk * svbh + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        in_dtype = vb.dtype
        if UPCAST:
            kbt = kbt.to(tl.float32)
            vb = vb.to(tl.float32)
        qk = tl.dot(q, kbt, input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_M)
        same = (offs_m[:, None] // BLOCK_SIZE) == (offs_m[None, :] // BLOCK_SIZE)
        qk = tl.where(same, qk, MASKED)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(rounded(p, in_dtype, UPCAST), vb, acc * alpha[:, None], input_precision=PRECISION)
        acc = acc / l_i[:, None]
        lse = (m_new + tl.math.log2(l_i)) * LN2  # natural-log LSE of scale * q.k
        tl.store(O + grow[:, None] * sot + h64 * soh + offs_d[None, :],
                 rounded(acc, O.dtype.element_ty, UPCAST).to(O.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LSE + h64 * slh + grow, lse, mask=row_ok)
