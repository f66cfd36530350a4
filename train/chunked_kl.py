"""LM head + per-row loss (CE, or KL to a teacher) in row chunks, weights applied afterwards.

``row_losses(hidden [N, H], weight [V, H], targets [N], teacher=None | [N, H]) -> (loss [N], ce [N], pred [N])``:

    z_i    = hidden_i @ weight^T                          (the drafter's logits)
    ce_i   = logsumexp(z_i) - z_i[targets_i]               (no gradient; D-PACE's q_i = exp(-ce_i))
    loss_i = ce_i                                          without a teacher
    loss_i = KL(p_t || p_d) = sum_v p_t,v (log p_t,v - log p_d,v)    with one, where
             p_t = softmax(teacher_i @ weight^T / T), p_d = softmax(z_i / T), T = ``temperature``
    pred_i = argmax_v z_i                                  (no gradient)

``loss`` is differentiable with respect to ``hidden`` only (the head and the teacher are frozen
here). It is :func:`dflash_prep.train.chunked_ce.weighted_ce` taken apart for per-row weights
that are only known after the forward (D-PACE): each chunk's ``d loss_i / d hidden_i``
(``(softmax - onehot) @ weight`` for CE, ``(p_d - p_t) / T @ weight`` for KL) is formed in the
forward, kept (``[N, H]``) and its logits dropped; the backward of ``sum_i w_i loss_i`` then
just scales row i by ``w_i``. Peak extra memory is one chunk's logits (two with a teacher)
plus ``[N, H]``. The KL carries no ``T^2`` factor: at T = 1 it is the plain KL.

Dtypes as in ``weighted_ce``: the matmuls run in ``hidden``'s compute dtype (autocast's, else
``weight``'s), softmax, KL and CE in fp32 (fp64 for fp64 inputs).
"""

from __future__ import annotations

import torch

from dflash_prep.train.chunked_ce import _compute_dtype


def _chunk(z, zt, tg, temperature):
    """``(loss, ce, pred, dloss/dz)`` of one chunk's logits ``z [c, V]`` (teacher logits ``zt`` or None)."""
    lse = torch.logsumexp(z, dim=-1)                                     # (c,)
    ce = lse - z.gather(1, tg[:, None])[:, 0]
    pred = z.argmax(dim=-1)
    if zt is None:
        g = torch.exp(z - lse[:, None])                                  # softmax (c, V)
        g.scatter_add_(1, tg[:, None], -torch.ones_like(ce)[:, None])
        return ce, ce, pred, g
    lpt = torch.log_softmax(zt / temperature, dim=-1)                    # (c, V)
    lpd = torch.log_softmax(z / temperature, dim=-1)
    pt = torch.exp(lpt)
    kl = (pt * (lpt - lpd)).sum(dim=-1)
    return kl, ce, pred, (torch.exp(lpd) - pt) / temperature


class _RowLosses(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, teacher, chunk, dtype, temperature, need_grad):
        N = hidden.shape[0]
        wt = weight.to(dtype)
        acc = torch.promote_types(dtype, torch.float32)
        loss = torch.empty(N, dtype=acc, device=hidden.device)
        ce = torch.empty(N, dtype=acc, device=hidden.device)
        pred = torch.empty(N, dtype=torch.int64, device=hidden.device)
        gh = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_grad else None
        with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, N, chunk):
                e = min(N, s + chunk)
                z = (hidden[s:e].to(dtype) @ wt.T).to(acc)               # (c, V)
                zt = None if teacher is None else (teacher[s:e].to(dtype) @ wt.T).to(acc)
                loss[s:e], ce[s:e], pred[s:e], g = _chunk(z, zt, targets[s:e], temperature)
                if gh is not None:
                    gh[s:e] = (g.to(dtype) @ wt).to(hidden.dtype)        # (c, H) d loss_i / d hidden_i
        ctx.save_for_backward(*(() if gh is None else (gh,)))
        ctx.mark_non_differentiable(ce, pred)
        return loss, ce, pred

    @staticmethod
    def backward(ctx, g_loss, _g_ce, _g_pred):
        gh = None
        if ctx.saved_tensors:
            (gh,) = ctx.saved_tensors
            gh = gh * g_loss[:, None].to(gh.dtype)
        return gh, None, None, None, None, None, None, None


def row_losses(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
               teacher: torch.Tensor | None = None, temperature: float = 1.0,
               chunk: int = 2048) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row loss, CE and argmax over ``hidden [N, H]`` (module docstring).

    ``targets`` int64 ``[N]`` in ``[0, V)``; ``teacher [N, H]``: the hidden states whose head
    logits give the teacher distribution of each row (same ``weight``), or None for CE.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"row_losses: hidden [N, H] and weight [V, H] expected, got {tuple(hidden.shape)} "
                         f"and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError("row_losses: targets needs one entry per row of hidden")
    if teacher is not None and teacher.shape != hidden.shape:
        raise ValueError(f"row_losses: teacher must match hidden {tuple(hidden.shape)}, got {tuple(teacher.shape)}")
    if chunk < 1 or not temperature > 0:
        raise ValueError(f"row_losses: chunk >= 1 and temperature > 0 needed, got {chunk}, {temperature}")
    need = torch.is_grad_enabled() and hidden.requires_grad
    return _RowLosses.apply(hidden, weight, targets.to(torch.int64), teacher, int(chunk),
                            _compute_dtype(hidden, weight), float(temperature), need)
