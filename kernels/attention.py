"""Causal flash attention for padded and packed (varlen) batches: Triton kernels + PyTorch reference.

Public API (the trainer codes against exactly this)::

    from dflash_prep.kernels.attention import attention_varlen, attention_padded, force_backend
    o = attention_varlen(q, k, v, cu_seqlens, max_seqlen, causal=True, scale=None)
        # q [T,Hq,D], k/v [T,Hkv,D], cu_seqlens int32 [N+1] -> o [T,Hq,D]
    o = attention_padded(q, k, v, lengths, causal=True, scale=None)
        # q [B,Hq,L,D], k/v [B,Hkv,L,D], lengths int32 [B] -> o [B,Hq,L,D]
    o = attention_dflash(q, k_ctx, v_ctx, k_blk, v_blk, cu_ctx, cu_blk, anchors, block_size, scale=None)
        # the DFlash drafter's mask: q/k_blk/v_blk [sum N_d*B, H, D], k_ctx/v_ctx [sum S_d, Hkv, D],
        # cu_ctx/cu_blk int32 [docs+1], anchors int32 [sum N_d] -> o [sum N_d*B, Hq, D]
    o = ttt_attention(q, k, v, cu_seqlens, max_seqlen, sm_scale=None, backend="auto")
        # EAGLE-3 training-time test: q [Sq,T,Hq,D], k/v [Sk,T,Hkv,D] (steps), see kernels.ttt
    with force_backend("reference"):  # or "triton"; default "auto"
        ...

``auto`` runs the Triton kernels on CUDA tensors and the PyTorch reference elsewhere; the
``DFLASH_ATTN_BACKEND`` environment variable (auto|triton|reference) sets the default and
:func:`force_backend` overrides both (see :mod:`dflash_prep.kernels.backend`). Both paths are
differentiable. Varlen attention is block-diagonal: a token never attends across a
document boundary. Padded query rows (position >= length) output zeros and get zero
gradients, never NaN. GQA: Hq must be a multiple of Hkv. Triton supports D in {32, 64, 128}
and float16/bfloat16/float32 with fp32 accumulation.

Under ``torch.autocast`` the inputs are first cast to the autocast dtype, as torch SDPA
does (so fp32 q/k after RoPE and a bf16 v are fine there); outside autocast q, k and v
must share one dtype.

The Triton module is imported only when the Triton path first runs, so importing this
module does not compile anything, and CPU-only users never import triton.

This module is the package's front door: ``kernels/`` has no ``__init__.py`` on purpose (a
folder named ``kernels`` at the repository root must never be importable as ``kernels``, which
is Hugging Face's package; docs/reliability.md#one-import-name).
"""

from __future__ import annotations

import torch

from .backend import force_backend, resolve_backend
from .dflash_reference import attention_dflash_reference
from .inputs import autocast_inputs as _autocast
from .inputs import check_dflash, check_padded, check_varlen
from .reference import attention_padded_reference, attention_varlen_grouped
from .ttt import ttt_attention

__all__ = ["attention_varlen", "attention_padded", "attention_dflash", "ttt_attention", "force_backend"]


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """Attention over documents packed back to back. q [T,Hq,D], k/v [T,Hkv,D] -> o [T,Hq,D].

    ``cu_seqlens`` int32 [N+1]: document ``i`` is tokens ``cu[i]:cu[i+1]`` (zero-length
    documents are allowed). ``max_seqlen`` bounds every document's length; it sizes the
    kernel grid, so pass the true maximum. ``scale`` defaults to 1/sqrt(D).
    """
    q, k, v = _autocast(q, k, v)
    if resolve_backend(q.device) == "reference":
        return attention_varlen_grouped(q, k, v, cu_seqlens, max_seqlen, causal, scale)
    from . import flash  # lazy: compiles/imports triton only on first use

    prob = check_varlen(q, k, v, cu_seqlens, max_seqlen, scale)
    return flash.flash_varlen(q, k, v, cu_seqlens, prob, causal)


def attention_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                     causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """Attention over right-padded rows. q [B,Hq,L,D], k/v [B,Hkv,L,D] -> o [B,Hq,L,D].

    Row ``b`` holds ``lengths[b]`` real tokens at positions ``0..lengths[b]-1``; keys past
    the length are never attended and query rows past it output 0 with 0 gradient.
    No FLOPs are spent on tiles that lie entirely in the padding.
    """
    q, k, v = _autocast(q, k, v)
    if resolve_backend(q.device) == "reference":
        return attention_padded_reference(q, k, v, lengths, causal, scale)
    from . import flash

    prob = check_padded(q, k, v, lengths, scale)
    return flash.flash_padded(q, k, v, lengths, prob, causal)


def attention_dflash(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, k_blk: torch.Tensor,
                     v_blk: torch.Tensor, cu_ctx: torch.Tensor, cu_blk: torch.Tensor, anchors: torch.Tensor,
                     block_size: int, *, scale: float | None = None, window: int = 0) -> torch.Tensor:
    """DFlash drafter attention over packed documents -> o ``[sum_d N_d*B, Hq, D]``.

    Document ``d`` has ``S_d`` context rows ``k_ctx``/``v_ctx[cu_ctx[d]:cu_ctx[d+1]]``
    (``[sum S_d, Hkv, D]``) and ``N_d`` blocks of ``B = block_size`` draft rows
    ``q``/``k_blk``/``v_blk[cu_blk[d]:cu_blk[d+1]]`` (``[sum N_d*B, H, D]``; ``cu_blk`` holds
    multiples of B). ``anchors`` int32 ``[sum N_d]`` gives block ``j``'s anchor ``a_j``, sorted
    within a document, ``0 <= a_j < S_d``. Block ``j``'s queries see context positions
    ``[0, a_j)`` of their document and the B draft keys of their own block (bidirectional),
    nothing else. ``N_d = 0`` is allowed. GQA when Hq is a multiple of Hkv; ``scale``
    defaults to 1/sqrt(D). ``window`` > 0 is a sliding window (at least B): the query of slot
    ``r`` of block ``j`` then sees only the context positions ``>= a_j + r - window + 1``
    (:func:`~dflash_prep.kernels.inputs.window_start`), and the Triton kernels skip the key
    tiles outside every window. Differentiable in q, k_ctx, v_ctx, k_blk and v_blk.
    """
    q, k_ctx, v_ctx, k_blk, v_blk = _autocast(q, k_ctx, v_ctx, k_blk, v_blk)
    if resolve_backend(q.device) == "reference":
        return attention_dflash_reference(q, k_ctx, v_ctx, k_blk, v_blk, cu_ctx, cu_blk, anchors, block_size,
                                          scale=scale, window=window)
    from . import dflash  # lazy, as above

    prob = check_dflash(q, k_ctx, v_ctx, k_blk, v_blk, cu_ctx, cu_blk, anchors, block_size, scale, window=window)
    return dflash.flash_dflash(q, k_ctx, v_ctx, k_blk, v_blk, cu_ctx, cu_blk, anchors, prob)
