"""Triton forward kernel of DFlash attention, and the index helpers its backward shares.

Layout (see :func:`dflash_prep.kernels.attention.attention_dflash`): per document ``d``, draft rows
``cu_blk[d]:cu_blk[d+1]`` (whole blocks of ``BLOCK_SIZE`` = B rows, block ``j`` with anchor
``a_j``, sorted) and context rows ``cu_ctx[d]:cu_ctx[d+1]``. Block ``j`` sees context
``[0, a_j)`` and its own B draft keys.

Work decomposition. A query tile is ``BLOCK_M`` draft rows of one document and one query
head; ``BLOCK_M`` is a multiple of B and tiles start at multiples of ``BLOCK_M`` inside the
document, so a tile holds whole blocks. Tiles are numbered across documents by the device
table ``CU_TILES`` (``cu_tiles[d]`` = tiles before document ``d``, computed with torch ops,
no host sync); a program finds its document by binary search over it (:func:`locate`).
Programs run the last tiles first: their anchors are the largest, so they carry the most
work, and the grid's surplus programs (it is sized by an upper bound) exit at once.

Forward of one tile, online softmax with fp32 accumulation. Each row sees the context
``[lo_row, a_row)`` (``lo_row`` = :func:`window_lo`: 0 without a window, ``a + slot - W + 1``
with one; the constexpr ``WINDOWED`` = W > 0 compiles the window's extra loop and masks only
into the windowed variant, so full attention runs the code it ran before), so:

- context tiles below the tile's smallest ``lo_row`` (that of its first row) are skipped:
  this is what makes a sliding window cheaper, not just masked;
- tiles from there up to the tile's largest ``lo_row`` rounded up (that of its last row)
  apply the per-row limits ``lo_row <= col < a_row``;
- tiles from there to ``a_min`` rounded down (``a_min`` = the tile's first anchor, anchors
  sorted) are loaded without any mask: every row of the tile sees them;
- tiles from there up to ``a_max`` (the tile's last anchor) apply the per-row limits
  again; nothing at or beyond ``a_max`` is loaded;
- the tile's own blocks are one dense ``BLOCK_M x BLOCK_M`` diagonal tile of ``k_blk`` /
  ``v_blk`` (the same rows as the queries), masked to ``row // B == col // B``. It is walked
  in ``BLOCK_N`` wide column chunks by the same loop as the context: a single
  ``BLOCK_M x BLOCK_M`` fp32 score tile spilled far more registers at D = 128 (cuobjdump
  on the sm_90 cubin) than the chunks do.

Masked scores are ``-1e30`` rather than ``-inf``: a row whose first context tile is fully
masked (anchor 0 in a tile with larger anchors) stays finite, and its weight is wiped to
exactly 0 by the rescale ``exp2(-1e30 - m)`` once a real score arrives, which the own block
guarantees. The natural-log log-sum-exp of the scaled scores is saved per (head, row).
``UPCAST``/``rounded`` handle the interpreter's bf16 ``tl.dot`` as in
:mod:`dflash_prep.kernels.flash_fwd`. Addresses are a per-tile int64 base plus int32 offsets
inside the tile: a vector of int64 row indices kept alive across the key loops (for the
final store) cost registers that spilled at D = 128.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .flash_fwd import LN2, MASKED, rounded

# runtime ints that must not be specialized (a value of 1 would compile a new variant)
COUNTS = ["num_docs", "group", "docs_iter", "blocks_iter", "window"]


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


# how a key tile is masked (constexpr MODE of the inner loops)
FULL = tl.constexpr(0)  # context keys every row sees: no mask
LIMIT = tl.constexpr(1)  # context keys: keep lim_lo[row] <= col < lim[row] (the row's window start and anchor)
SAME_BLOCK = tl.constexpr(2)  # own-block keys, cols local to the tile: keep col // B == lim[row] (the row's block)


@triton.jit
def window_lo(anchor, slot, window):
    """First context position the query at ``anchor + slot`` sees under a sliding window
    ``window`` > 0: ``max(0, anchor + slot - window + 1)`` (kernels.inputs.window_start, the public rule)."""
    return tl.maximum(anchor + slot + 1 - window, 0)


@triton.jit
def keep_mask(cols, lim, lim_lo, MODE: tl.constexpr, BLOCK_SIZE: tl.constexpr, WINDOWED: tl.constexpr):
    """(rows, cols) keep mask of a LIMIT or SAME_BLOCK tile; ``lim``/``lim_lo`` per row, ``cols`` per column."""
    if MODE == SAME_BLOCK:
        return (cols[None, :] // BLOCK_SIZE) == lim[:, None]
    elif WINDOWED:
        return (cols[None, :] < lim[:, None]) & (cols[None, :] >= lim_lo[:, None])
    else:
        return cols[None, :] < lim[:, None]


@triton.jit
def context_spans(a_lo, a_hi, window, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """(start, full_lo, full_hi) of a query tile with anchors ``a_lo <= ... <= a_hi`` under a
    sliding window: its rows see nothing below ``start``, every row sees all of ``[full_lo,
    full_hi)`` (no mask needed) and ``[start, full_lo)`` and ``[full_hi, a_hi)`` need the
    per-row limits; multiples of BLOCK_N."""
    start = (window_lo(a_lo, 0, window) // BLOCK_N) * BLOCK_N  # the first row's window start
    full_hi = (a_lo // BLOCK_N) * BLOCK_N
    last_lo = window_lo(a_hi, BLOCK_SIZE - 1, window)  # the last row's window start: the largest
    full_lo = tl.minimum(tl.cdiv(last_lo, BLOCK_N) * BLOCK_N, full_hi)
    return start, full_lo, full_hi


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, skt, svt, offs_d, lim, lim_lo, lo, hi, load_hi, qk_scale,
               BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MODE: tl.constexpr,
               UPCAST: tl.constexpr, PRECISION: tl.constexpr, WINDOWED: tl.constexpr):
    """Online softmax over keys ``[lo, hi)`` of ``k_base``/``v_base``; masked MODEs load only ``col < load_hi``."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kt_ptrs = k_base + cols[None, :].to(tl.int64) * skt + offs_d[:, None]  # (D, BLOCK_N)
        v_ptrs = v_base + cols[:, None].to(tl.int64) * svt + offs_d[None, :]  # (BLOCK_N, D)
        if MODE == FULL:
            kt = tl.load(kt_ptrs)
            v = tl.load(v_ptrs)
        else:
            kt = tl.load(kt_ptrs, mask=cols[None, :] < load_hi, other=0.0)
            v = tl.load(v_ptrs, mask=cols[:, None] < load_hi, other=0.0)
        in_dtype = v.dtype
        if UPCAST:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        if MODE != FULL:
            qk = tl.where(keep_mask(cols, lim, lim_lo, MODE, BLOCK_SIZE, WINDOWED), qk, MASKED)
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
    qk_scale, num_docs, group, docs_iter, window,
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
        a_row = tl.load(ANCHORS + (t0 + loc) // BLOCK_SIZE, mask=row_ok, other=0)  # (BLOCK_M,)
        a_lo = tl.load(ANCHORS + t0 // BLOCK_SIZE)  # sorted: the tile's smallest
        a_hi = tl.max(a_row, 0)
        t64 = t0.to(tl.int64)
        q = tl.load(Q + t64 * sqt + h64 * sqh + loc[:, None] * sqt + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        kc_base = KC + c0 * skct + hk * skch
        vc_base = VC + c0 * svct + hk * svch
        full_hi = (a_lo // BLOCK_N) * BLOCK_N
        full_lo = full_hi * 0
        lo_row = a_row  # unused without a window
        if WINDOWED:
            lo_row = window_lo(a_row, loc % BLOCK_SIZE, window)  # (BLOCK_M,)
            start, full_lo, full_hi = context_spans(a_lo, a_hi, window, BLOCK_N, BLOCK_SIZE)
            acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, kc_base, vc_base, skct, svct, offs_d, a_row, lo_row, start,
                                       full_lo, a_hi, qk_scale, BLOCK_N, BLOCK_SIZE, LIMIT, UPCAST, PRECISION, True)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, kc_base, vc_base, skct, svct, offs_d, a_row, lo_row, full_lo,
                                   full_hi, full_hi, qk_scale, BLOCK_N, BLOCK_SIZE, FULL, UPCAST, PRECISION, WINDOWED)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, kc_base, vc_base, skct, svct, offs_d, a_row, lo_row, full_hi,
                                   a_hi, a_hi, qk_scale, BLOCK_N, BLOCK_SIZE, LIMIT, UPCAST, PRECISION, WINDOWED)
        # own blocks: the dense BLOCK_M x BLOCK_M diagonal tile over the same rows (walked in BLOCK_N
        # wide column chunks, which bounds registers), block-diagonal mask
        kb_base = KB + t64 * skbt + hk * skbh
        vb_base = VB + t64 * svbt + hk * svbh
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, kb_base, vb_base, skbt, svbt, offs_d, loc // BLOCK_SIZE,
                                   loc, 0, tl.minimum(left, BLOCK_M), left, qk_scale,
                                   BLOCK_N, BLOCK_SIZE, SAME_BLOCK, UPCAST, PRECISION, WINDOWED)
        acc = acc / l_i[:, None]
        lse = (m_i + tl.math.log2(l_i)) * LN2  # natural-log LSE of scale * q.k
        tl.store(O + t64 * sot + h64 * soh + loc[:, None] * sot + offs_d[None, :],
                 rounded(acc, O.dtype.element_ty, UPCAST).to(O.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LSE + h64 * slh + t64 + loc, lse, mask=row_ok)
