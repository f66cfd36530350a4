"""Causal flash attention for padded and packed (varlen) batches: Triton kernels + PyTorch reference.

Public API (the trainer codes against exactly this)::

    from dflash_prep.kernels import attention_varlen, attention_padded, force_backend
    o = attention_varlen(q, k, v, cu_seqlens, max_seqlen, causal=True, scale=None)
        # q [T,Hq,D], k/v [T,Hkv,D], cu_seqlens int32 [N+1] -> o [T,Hq,D]
    o = attention_padded(q, k, v, lengths, causal=True, scale=None)
        # q [B,Hq,L,D], k/v [B,Hkv,L,D], lengths int32 [B] -> o [B,Hq,L,D]
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
package does not compile anything, and CPU-only users never import triton.
"""

from __future__ import annotations

import torch

from .backend import force_backend, resolve_backend
from .inputs import check_padded, check_varlen
from .reference import attention_padded_reference, attention_varlen_grouped

__all__ = ["attention_varlen", "attention_padded", "force_backend"]


def _autocast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Cast floating q, k, v to the autocast dtype when autocast is on for their device."""
    dev = q.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
        return tuple(t.to(dtype) if t.is_floating_point() else t for t in (q, k, v))
    return q, k, v


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
