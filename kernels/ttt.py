"""EAGLE-3 training-time-test (TTT) attention: the ``torch.autograd.Function`` over the Triton
kernels, the public :func:`ttt_attention`, and its dispatch between Triton and the reference.

Semantics (:mod:`dflash_prep.kernels.ttt_reference`): for steps ``i = 0..S-1`` over the same
packed tokens, the query of step ``i`` at token ``t`` sees the step-0 keys of its document up to
``t`` (causal) and the keys of steps ``1..i`` at token ``t`` only, in one softmax. Kernels:
:mod:`~dflash_prep.kernels.ttt_fwd` (forward: the causal varlen loop over the step-0 keys, then
the diagonal keys folded into the same online softmax) and :mod:`~dflash_prep.kernels.ttt_bwd`
(dQ; dK/dV of the step-0 keys over every step's queries; the diagonal dK/dV). Both are imported
only when the Triton path first runs, so importing this module compiles nothing.

Forward saves (q, k, v, o, lse fp32 ``[Sq, Hq, T]``); backward runs the preprocess, dQ, dK/dV of
step 0 and the diagonal dK/dV. Outputs and gradients start as zeros.
"""

from __future__ import annotations

import torch

from .backend import BACKENDS, force_backend, resolve_backend
from .errors import AttentionConfigError
from .inputs import TTTProblem, autocast_inputs, check_ttt
from .ttt_reference import ttt_attention_reference

DEFAULT_TTT_STEPS = 7  # EAGLE-3's training-time-test length (SpecForge's and speculators' default)


class _TTTAttention(torch.autograd.Function):
    """q [Sq,T,Hq,D], k/v [Sk,T,Hkv,D], cu_seqlens int32 [N+1] -> (o [Sq,T,Hq,D], lse fp32 [Sq,Hq,T])."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, prob: TTTProblem):
        from . import ttt_fwd  # lazy: imports triton only on first use
        from .flash import _last_contiguous

        q, k, v = (_last_contiguous(t) for t in (q, k, v))
        starts = cu_seqlens[:-1].contiguous()
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).contiguous()
        o, lse = ttt_fwd.forward(q, k, v, starts, lens, prob)
        ctx.save_for_backward(q, k, v, o, lse, starts, lens)
        ctx.prob = prob
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        from . import ttt_bwd

        q, k, v, o, lse, starts, lens = ctx.saved_tensors
        dq, dk, dv = ttt_bwd.backward(do, q, k, v, o, lse, starts, lens, ctx.prob)
        return dq, dk, dv, None, None


def ttt_triton(q, k, v, cu_seqlens, prob: TTTProblem, *, return_lse: bool = False):
    """Triton path of :func:`ttt_attention` (inputs already checked, q 4-D)."""
    from .flash import _check_triton

    _check_triton(q, prob)
    o, lse = _TTTAttention.apply(q, k, v, cu_seqlens, prob)
    return (o, lse) if return_lse else o


def _backend(backend: str, device: torch.device) -> str:
    """``auto`` defers to :func:`~dflash_prep.kernels.backend.resolve_backend` (force_backend, then
    the environment, then CUDA -> triton); an explicit name beats both."""
    if backend not in BACKENDS:
        raise AttentionConfigError(f"ttt_attention: unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return resolve_backend(device)
    with force_backend(backend):  # the same checks (triton on CPU only under the interpreter)
        return resolve_backend(device)


def ttt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, *,
                  sm_scale: float | None = None, backend: str = "auto") -> torch.Tensor:
    """EAGLE-3 TTT attention over packed documents -> o ``[Sq, T, Hq, D]`` (or ``[T, Hq, D]``).

    ``k``/``v`` ``[Sk, T, Hkv, D]``: step ``j``'s keys/values of the T packed tokens (RoPE already
    applied); ``cu_seqlens`` int32 ``[N+1]`` and ``max_seqlen`` as for
    :func:`~dflash_prep.kernels.attention.attention_varlen`. ``q`` ``[Sq, T, Hq, D]`` holds the last ``Sq``
    of the ``Sk`` steps: ``Sq = Sk`` runs all steps at once; ``Sq = 1`` (or a 3-D ``q`` ``[T, Hq,
    D]``, then the output is 3-D too) is the newest step, for a TTT loop that calls once per step
    with the keys so far. The query of step ``i`` at token ``t`` attends to ``k[0]`` at tokens
    ``s <= t`` of its own document and to ``k[1..i]`` at token ``t``, one softmax, scale
    ``sm_scale`` (default 1/sqrt(D)). GQA when Hq is a multiple of Hkv. Differentiable in q, k, v:
    ``k[0]``'s gradient sums over every query step, ``k[j]``'s over the steps ``>= j``.

    ``backend``: ``auto`` (Triton on CUDA tensors, the reference elsewhere; :func:`force_backend`
    and ``DFLASH_ATTN_BACKEND`` apply), or ``triton``/``reference`` to force one. Triton takes
    D in {32, 64, 128} and fp16/bf16/fp32 (fp32 accumulation); the reference anything. Under
    ``torch.autocast`` the inputs are first cast to the autocast dtype, as for the other entry points.
    """
    q, k, v = autocast_inputs(q, k, v)
    single = isinstance(q, torch.Tensor) and q.dim() == 3
    if single:
        q = q.unsqueeze(0)  # (1, T, Hq, D)
    if _backend(backend, q.device) == "reference":
        o = ttt_attention_reference(q, k, v, cu_seqlens, max_seqlen, sm_scale=sm_scale)
    else:
        o = ttt_triton(q, k, v, cu_seqlens, check_ttt(q, k, v, cu_seqlens, max_seqlen, sm_scale))
    return o[0] if single else o
