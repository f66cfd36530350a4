"""LM head + cross-entropy in row chunks, so memory does not grow with rows x vocabulary.

``weighted_ce(hidden [N, H], weight [V, H], targets [N], w [N]) -> (loss_sum, pred [N])``:

    loss_sum = sum_i w_i * (logsumexp(hidden_i @ weight^T) - (hidden_i @ weight^T)[targets_i])
    pred_i   = argmax_v (hidden_i @ weight^T)_v        (no gradient; for accuracy metrics)

Algorithm: one pass over chunks of ``chunk`` rows. Each chunk's logits ``[chunk, V]`` (fp32
softmax) are formed, reduced to its loss and argmax, and immediately turned into the exact
gradients ``dL/dhidden = (softmax - onehot) * w @ weight`` (and ``dL/dweight`` summed over
chunks when ``weight`` requires grad), then dropped. The softmax reuses the logits' buffer in
5 passes over it (max with the argmax, in-place ``- max``, in-place ``exp``, sum, in-place scale
by ``w / sum``) and no other ``[chunk, V]`` buffer; ``logsumexp``, ``argmax`` and a separate
``exp(z - lse) * w`` took 8 passes and 3 more buffers: the head + CE ran 1.25x slower in fp32,
1.39x with the bf16 head, on CPU (docs/benchmarks.md, "The drafter step on CPU"). Peak extra memory is one chunk's logits
plus ``[N, H]`` (and ``[V, H]``) of saved gradient, instead of ``[N, V]`` logits and their
softmax kept for backward: a 32K vocabulary at 8K rows is 1 GiB of fp32 logits unchunked.
The price is computing the input gradient during the forward even when no backward follows
(evaluation calls should use ``torch.no_grad``, which skips it).

The matmul runs in ``hidden``'s compute dtype: the autocast dtype when autocast is on for its
device, else the dtype of an enclosing :func:`head_dtype` (the trainer's bf16 head on CPU),
else ``weight``'s dtype; softmax and the loss are fp32 (fp64 for fp64 inputs), summed in
chunk order (deterministic). Rows with ``w == 0`` cost compute but contribute nothing;
callers drop them first when they are many.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

_HEAD_DTYPE: contextvars.ContextVar[torch.dtype | None] = contextvars.ContextVar("head_dtype", default=None)


@contextlib.contextmanager
def head_dtype(dtype: torch.dtype | None):
    """Inside it, the head matmuls of :func:`weighted_ce` and
    :func:`dflash_prep.train.chunked_kl.row_losses` run in ``dtype`` where no autocast is on
    (None: ``weight``'s dtype). Only the matmuls: the rest of the model keeps its dtype, and the
    logits are widened to fp32 before the softmax. The trainer's bf16 head on CPU (``--bf16``,
    :func:`dflash_prep.train.distributed.autocast_for`) is this context."""
    token = _HEAD_DTYPE.set(dtype)
    try:
        yield
    finally:
        _HEAD_DTYPE.reset(token)


def _compute_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    dev = h.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return _HEAD_DTYPE.get() or weight.dtype


class _WeightedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, w, chunk, dtype, need_grad):
        N = hidden.shape[0]
        wt = weight.to(dtype)
        acc = torch.promote_types(dtype, torch.float32)  # fp32 softmax for 16-bit inputs; fp64 stays fp64
        loss = torch.zeros((), dtype=acc, device=hidden.device)
        pred = torch.empty(N, dtype=torch.int64, device=hidden.device)
        gh = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_grad[0] else None
        gw = torch.zeros(weight.shape, dtype=torch.promote_types(dtype, torch.float32), device=weight.device) \
            if need_grad[1] else None
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, N, chunk):
                e = min(N, s + chunk)
                h = hidden[s:e].to(dtype)                       # (c, H)
                logits = (h @ wt.T).to(acc)                     # (c, V) a fresh tensor: reused in place below
                tl = logits.gather(1, targets[s:e, None])[:, 0]
                wc = w[s:e].to(acc)
                m, pred[s:e] = logits.max(dim=-1)               # (c,) max and argmax (first on ties)
                g = logits.sub_(m[:, None]).exp_()              # (c, V) exp(z - max): the one exp pass
                total = g.sum(dim=-1)                           # (c,)
                loss += ((m + torch.log(total) - tl) * wc).sum()  # lse - z[target]
                if gh is None and gw is None:
                    continue
                g.mul_((wc / total)[:, None])                   # w * softmax
                g.scatter_add_(1, targets[s:e, None], -wc[:, None])  # dL/dlogits = w * (softmax - onehot)
                gd = g.to(dtype)
                if gh is not None:
                    gh[s:e] = (gd @ wt).to(hidden.dtype)        # (c, H)
                if gw is not None:
                    gw += (gd.T @ h).to(gw.dtype)               # (V, H)
        ctx.save_for_backward(*(t for t in (gh, gw) if t is not None))
        ctx.flags = (gh is not None, gw is not None, weight.dtype)
        ctx.mark_non_differentiable(pred)
        return loss, pred

    @staticmethod
    def backward(ctx, g_loss, _g_pred):
        has_h, has_w, wdtype = ctx.flags
        saved = list(ctx.saved_tensors)
        gh = gw = None
        if has_h:
            gh = saved.pop(0)
            gh = gh * g_loss.to(gh.dtype)
        if has_w:
            gw = (saved.pop(0) * g_loss).to(wdtype)
        return gh, gw, None, None, None, None, None


def weighted_ce(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, w: torch.Tensor, *,
                chunk: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted CE sum and argmax predictions over ``hidden [N, H]`` (module docstring).

    ``targets`` int64 ``[N]`` in ``[0, V)`` (pass any valid id where ``w == 0``), ``w`` ``[N]``.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"weighted_ce: hidden [N, H] and weight [V, H] expected, got {tuple(hidden.shape)} "
                         f"and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1] or w.shape != hidden.shape[:1]:
        raise ValueError("weighted_ce: targets and w need one entry per row of hidden")
    if chunk < 1:
        raise ValueError(f"weighted_ce: chunk must be >= 1, got {chunk}")
    grad_on = torch.is_grad_enabled()
    need = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad)
    return _WeightedCE.apply(hidden, weight, targets.to(torch.int64), w, int(chunk),
                             _compute_dtype(hidden, weight), need)
