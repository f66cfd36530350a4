"""Argument checks shared by every attention backend, and the per-sequence layout.

Both entry points describe a batch as B sequences; sequence ``b`` holds ``lens[b]`` real
tokens starting at token ``starts[b]`` of its batch row:

- varlen ``[T, H, D]`` + ``cu_seqlens`` int32 ``[N+1]``: B = N, ``starts = cu[:-1]``,
  ``lens = diff(cu)``, every sequence lives in the single row (batch stride 0);
- padded ``[B, H, L, D]`` + ``lengths`` int32 ``[B]``: ``starts = 0``, ``lens = lengths``.

Shape, dtype and device checks always run. Value checks (``cu_seqlens`` starts at 0, never
decreases, ends at T, no sequence longer than ``max_seqlen``; ``0 <= lengths <= L``) read
the values, so they run only when the tensor is on the CPU: on a GPU they would cost a
device sync per call. Build ``cu_seqlens``/``lengths`` on the CPU (the loader does) to have
them checked before moving them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import AttentionConfigError, AttentionInputError

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # float64: reference only


@dataclass(frozen=True)
class Problem:
    """Shapes every backend needs, after checks."""

    num_seqs: int
    """B: documents (varlen) or batch rows (padded)."""
    heads_q: int
    """Query heads Hq."""
    heads_kv: int
    """Key/value heads Hkv; Hq is a multiple of it (GQA when larger than 1)."""
    head_dim: int
    """D, shared by q, k and v."""
    max_seqlen: int
    """An upper bound on every sequence length (padded: L)."""
    scale: float
    """Softmax scale applied to q.k (default 1/sqrt(D))."""

    def __post_init__(self) -> None:
        if self.heads_kv <= 0 or self.heads_q % self.heads_kv:
            raise AttentionConfigError(
                f"query heads ({self.heads_q}) must be a positive multiple of key/value heads "
                f"({self.heads_kv}); repeat or regroup the heads"
            )
        if not math.isfinite(self.scale):
            raise AttentionConfigError(f"softmax scale must be finite, got {self.scale}")

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.heads_q // self.heads_kv


def _common(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, what: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise AttentionConfigError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise AttentionConfigError(f"{what}: {name} has dtype {t.dtype}; use float16, bfloat16 or float32 (float64 on the reference backend)")
    if not (q.dtype == k.dtype == v.dtype):
        raise AttentionConfigError(f"{what}: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one dtype")
    if not (q.device == k.device == v.device):
        raise AttentionConfigError(f"{what}: q, k, v live on different devices ({q.device}, {k.device}, {v.device})")
    if k.shape != v.shape:
        raise AttentionConfigError(f"{what}: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")


def _scale(scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def check_varlen(q, k, v, cu_seqlens, max_seqlen, scale) -> Problem:
    """Validate a packed batch; return its :class:`Problem`."""
    what = "attention_varlen"
    _common(q, k, v, what)
    if q.dim() != 3 or k.dim() != 3:
        raise AttentionConfigError(f"{what}: q and k/v must be [T, H, D]; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise AttentionConfigError(f"{what}: q {tuple(q.shape)} and k {tuple(k.shape)} disagree on T or D")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise AttentionConfigError(f"{what}: cu_seqlens must be a 1-D int32 tensor [N+1] (build it with torch.int32)")
    if cu_seqlens.numel() < 1:
        raise AttentionConfigError(f"{what}: cu_seqlens must hold at least one offset (0)")
    if cu_seqlens.device != q.device:
        raise AttentionConfigError(f"{what}: cu_seqlens is on {cu_seqlens.device} but q is on {q.device}")
    max_seqlen = int(max_seqlen)
    if max_seqlen < 0:
        raise AttentionConfigError(f"{what}: max_seqlen must be >= 0, got {max_seqlen}")
    total = q.shape[0]
    if cu_seqlens.device.type == "cpu":
        cu = cu_seqlens.to(torch.int64)
        lens = cu[1:] - cu[:-1]
        if int(cu[0]) != 0 or int(cu[-1]) != total:
            raise AttentionInputError(
                f"{what}: cu_seqlens must start at 0 and end at T={total}; got {int(cu[0])} .. {int(cu[-1])}. "
                "Build it as the cumulative sum of the sequence lengths with a leading 0."
            )
        if lens.numel() and int(lens.min()) < 0:
            bad = int(torch.nonzero(lens < 0)[0])
            raise AttentionInputError(f"{what}: cu_seqlens decreases at index {bad} ({int(cu[bad])} -> {int(cu[bad + 1])})")
        if lens.numel() and int(lens.max()) > max_seqlen:
            raise AttentionInputError(
                f"{what}: a sequence of {int(lens.max())} tokens exceeds max_seqlen={max_seqlen}; "
                "pass max_seqlen = the longest sequence length"
            )
    return Problem(
        num_seqs=cu_seqlens.numel() - 1, heads_q=q.shape[1], heads_kv=k.shape[1],
        head_dim=q.shape[2], max_seqlen=max_seqlen, scale=_scale(scale, q.shape[2]),
    )


def check_padded(q, k, v, lengths, scale) -> Problem:
    """Validate a padded batch; return its :class:`Problem`."""
    what = "attention_padded"
    _common(q, k, v, what)
    if q.dim() != 4 or k.dim() != 4:
        raise AttentionConfigError(f"{what}: q and k/v must be [B, H, L, D]; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    b, _, seq, d = q.shape
    if k.shape[0] != b or k.shape[2] != seq or k.shape[3] != d:
        raise AttentionConfigError(f"{what}: q {tuple(q.shape)} and k {tuple(k.shape)} disagree on B, L or D")
    if not isinstance(lengths, torch.Tensor) or lengths.dtype != torch.int32 or lengths.shape != (b,):
        raise AttentionConfigError(f"{what}: lengths must be an int32 tensor of shape [B]=[{b}]")
    if lengths.device != q.device:
        raise AttentionConfigError(f"{what}: lengths is on {lengths.device} but q is on {q.device}")
    if lengths.device.type == "cpu" and b:
        lo, hi = int(lengths.min()), int(lengths.max())
        if lo < 0 or hi > seq:
            raise AttentionInputError(f"{what}: lengths must lie in [0, L={seq}]; got min {lo}, max {hi}")
    return Problem(
        num_seqs=b, heads_q=q.shape[1], heads_kv=k.shape[1], head_dim=d,
        max_seqlen=seq, scale=_scale(scale, d),
    )
