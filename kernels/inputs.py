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

:func:`check_dflash` does the same for :func:`~dflash_prep.kernels.attention.attention_dflash` (context
and draft rows per document, one anchor per block) and returns a :class:`DFlashProblem`.
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


def autocast_inputs(q: torch.Tensor, *rest: torch.Tensor):
    """Cast floating q, k, v (and any further tensors) to the autocast dtype when autocast is on.

    Every public entry point calls it first (here, not in the package ``__init__``, so that
    ``kernels.ttt`` can use it without an import cycle)."""
    dev = q.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
        return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in (q, *rest))
    return (q, *rest)


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


# ----------------------------------------------------------------------------- DFlash
@dataclass(frozen=True)
class DFlashProblem:
    """Shapes of one :func:`~dflash_prep.kernels.attention.attention_dflash` call, after checks."""

    num_docs: int
    """Documents: ``len(cu_ctx) - 1``."""
    heads_q: int
    """Query heads Hq."""
    heads_kv: int
    """Key/value heads Hkv; Hq is a multiple of it."""
    head_dim: int
    """D, shared by q and every k/v."""
    block_size: int
    """B: draft tokens per block (rows of q per anchor)."""
    num_blocks: int
    """sum_d N_d: anchors, i.e. ``q.shape[0] // B``."""
    ctx_tokens: int
    """sum_d S_d: rows of k_ctx / v_ctx."""
    scale: float
    """Softmax scale applied to q.k (default 1/sqrt(D))."""
    window: int = 0
    """Sliding window W of the draft queries, 0 = full: the query of slot r of block j (position
    ``a_j + r``) sees context positions ``c`` with ``a_j + r - c < W`` only (see
    :func:`window_start`); its own block is always whole (W >= B)."""

    def __post_init__(self) -> None:
        if self.heads_kv <= 0 or self.heads_q % self.heads_kv:
            raise AttentionConfigError(
                f"attention_dflash: query heads ({self.heads_q}) must be a positive multiple of "
                f"key/value heads ({self.heads_kv}); repeat or regroup the heads"
            )
        if not math.isfinite(self.scale):
            raise AttentionConfigError(f"attention_dflash: softmax scale must be finite, got {self.scale}")

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.heads_q // self.heads_kv


def _offsets(name: str, cu: torch.Tensor, total: int, what: str) -> torch.Tensor:
    """Check a CPU offsets tensor: starts at 0, never decreases, ends at ``total``; int64 copy."""
    c = cu.to(torch.int64)
    if int(c[0]) != 0 or int(c[-1]) != total:
        raise AttentionInputError(
            f"{what}: {name} must start at 0 and end at {total}; got {int(c[0])} .. {int(c[-1])}. "
            "Build it as the cumulative sum of the per-document counts with a leading 0."
        )
    steps = c[1:] - c[:-1]
    if steps.numel() and int(steps.min()) < 0:
        bad = int(torch.nonzero(steps < 0)[0])
        raise AttentionInputError(f"{what}: {name} decreases at index {bad} ({int(c[bad])} -> {int(c[bad + 1])})")
    return c


def check_window(window, block_size: int, what: str) -> int:
    """``window`` as an int: 0 (full attention) or a sliding window of at least ``block_size``."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise AttentionConfigError(f"{what}: window must be an int >= 0 (0 = full attention), got {window!r}")
    if 0 < window < block_size:
        raise AttentionConfigError(
            f"{what}: window={window} is smaller than block_size={block_size}; a sliding window must hold a "
            "whole block (the public code's rule for the block's own keys is only defined then): use 0 or >= B"
        )
    return window


def window_start(anchor: torch.Tensor, slot: torch.Tensor, window: int) -> torch.Tensor:
    """First context position the query at ``anchor + slot`` sees under sliding window ``window``.

    The public DFlash inference code passes ``sliding_window=W`` of a ``sliding_attention``
    layer to transformers, whose flash-attention path keeps key ``k`` for query ``p`` when
    ``|p - k| <= W - 1`` (``window_size=(W-1, W-1)``, keys and queries aligned on absolute
    positions), the same as its mask rule ``k > p - W``. For context keys (``k < a <= p``)
    that is ``k >= a + slot - W + 1``; 0 when ``window`` is 0 (full attention).
    """
    if window == 0:
        return torch.zeros_like(anchor)
    return (anchor + slot - (window - 1)).clamp_min(0)


def check_dflash(q, k_ctx, v_ctx, k_blk, v_blk, cu_ctx, cu_blk, anchors, block_size, scale, *,
                 window: int = 0) -> DFlashProblem:
    """Validate a DFlash attention call; return its :class:`DFlashProblem`.

    Shapes, dtypes and devices are always checked. The values of ``cu_ctx``, ``cu_blk`` and
    ``anchors`` (offsets from 0 to the totals, never decreasing, ``cu_blk`` a multiple of B,
    anchors sorted within a document and ``0 <= a < S_d``) are checked only when all three are
    on the CPU, as for :func:`check_varlen`: on a GPU it would cost a sync per call.
    """
    what = "attention_dflash"
    tensors = (("q", q), ("k_ctx", k_ctx), ("v_ctx", v_ctx), ("k_blk", k_blk), ("v_blk", v_blk))
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise AttentionConfigError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise AttentionConfigError(f"{what}: {name} has dtype {t.dtype}; use float16, bfloat16 or float32 "
                                       "(float64 on the reference backend)")
        if t.dim() != 3:
            raise AttentionConfigError(f"{what}: {name} must be [tokens, heads, D]; got {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise AttentionConfigError(f"{what}: {name} has dtype {t.dtype} but q has {q.dtype}; cast them to one dtype")
        if t.device != q.device:
            raise AttentionConfigError(f"{what}: {name} is on {t.device} but q is on {q.device}")
    rows, hq, d = q.shape
    if k_ctx.shape != v_ctx.shape or k_blk.shape != v_blk.shape:
        raise AttentionConfigError(f"{what}: k_ctx {tuple(k_ctx.shape)} / v_ctx {tuple(v_ctx.shape)} and "
                                   f"k_blk {tuple(k_blk.shape)} / v_blk {tuple(v_blk.shape)} must match pairwise")
    if k_blk.shape[0] != rows or k_blk.shape[2] != d or k_ctx.shape[2] != d or k_ctx.shape[1] != k_blk.shape[1]:
        raise AttentionConfigError(
            f"{what}: q {tuple(q.shape)}, k_blk {tuple(k_blk.shape)} and k_ctx {tuple(k_ctx.shape)} must be "
            "[sum N_d*B, Hq, D], [sum N_d*B, Hkv, D] and [sum S_d, Hkv, D]"
        )
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise AttentionConfigError(f"{what}: block_size must be a positive int, got {block_size!r}")
    if rows % block_size:
        raise AttentionConfigError(f"{what}: q has {rows} rows, not a multiple of block_size={block_size}")
    num_blocks = rows // block_size
    for name, t, n in (("cu_ctx", cu_ctx, None), ("cu_blk", cu_blk, None), ("anchors", anchors, num_blocks)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
            raise AttentionConfigError(f"{what}: {name} must be a 1-D int32 tensor (build it with torch.int32)")
        if t.device != q.device:
            raise AttentionConfigError(f"{what}: {name} is on {t.device} but q is on {q.device}")
        if n is not None and t.numel() != n:
            raise AttentionConfigError(f"{what}: anchors holds {t.numel()} entries but q has {n} blocks "
                                       f"({rows} rows / block_size {block_size}); pass one anchor per block")
    if cu_ctx.numel() < 1 or cu_ctx.numel() != cu_blk.numel():
        raise AttentionConfigError(f"{what}: cu_ctx ({cu_ctx.numel()}) and cu_blk ({cu_blk.numel()}) must both "
                                   "hold docs+1 offsets (at least the leading 0)")
    if all(t.device.type == "cpu" for t in (cu_ctx, cu_blk, anchors)):
        cc = _offsets("cu_ctx", cu_ctx, k_ctx.shape[0], what)
        cb = _offsets("cu_blk", cu_blk, rows, what)
        if bool((cb % block_size != 0).any()):
            bad = int(torch.nonzero(cb % block_size != 0)[0])
            raise AttentionInputError(f"{what}: cu_blk[{bad}]={int(cb[bad])} is not a multiple of "
                                      f"block_size={block_size}; each document holds whole blocks")
        a = anchors.to(torch.int64)
        doc = torch.repeat_interleave(torch.arange(cc.numel() - 1), (cb[1:] - cb[:-1]) // block_size)  # (blocks,)
        ctx_len = (cc[1:] - cc[:-1])[doc]
        bad = torch.nonzero((a < 0) | (a >= ctx_len))
        if bad.numel():
            i = int(bad[0])
            raise AttentionInputError(
                f"{what}: anchors[{i}]={int(a[i])} lies outside [0, S_d={int(ctx_len[i])}) of document "
                f"{int(doc[i])}; an anchor is a position within its document's context"
            )
        down = torch.nonzero((a[1:] < a[:-1]) & (doc[1:] == doc[:-1]))
        if down.numel():
            i = int(down[0])
            raise AttentionInputError(f"{what}: anchors decrease within document {int(doc[i])} at index {i} "
                                      f"({int(a[i])} -> {int(a[i + 1])}); sort each document's anchors")
    return DFlashProblem(
        num_docs=cu_ctx.numel() - 1, heads_q=hq, heads_kv=k_ctx.shape[1], head_dim=d, block_size=block_size,
        num_blocks=num_blocks, ctx_tokens=k_ctx.shape[0], scale=_scale(scale, d),
        window=check_window(window, block_size, what),
    )


# ----------------------------------------------------------------------------- EAGLE-3 TTT
@dataclass(frozen=True)
class TTTProblem(Problem):
    """Shapes of one :func:`~dflash_prep.kernels.attention.ttt_attention` call: the per-step varlen
    :class:`Problem` (``num_seqs`` = documents) plus the steps."""

    q_steps: int = 1
    """Sq: query steps in q, the last Sq of the Sk steps (q[iq] is step iq + Sk - Sq)."""
    k_steps: int = 1
    """Sk: key/value steps; step 0 holds the causal keys, steps 1..Sk-1 the diagonal keys."""
    tokens: int = 0
    """T: packed tokens per step."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.q_steps <= self.k_steps:
            raise AttentionConfigError(
                f"ttt_attention: q holds {self.q_steps} steps and k/v {self.k_steps}; need 1 <= Sq <= Sk "
                "(q holds the last Sq steps of the Sk key/value steps)"
            )

    @property
    def step_offset(self) -> int:
        """Sk - Sq: the step of q[0]."""
        return self.k_steps - self.q_steps


def check_ttt(q, k, v, cu_seqlens, max_seqlen, scale) -> TTTProblem:
    """Validate a TTT attention call (q [Sq,T,Hq,D], k/v [Sk,T,Hkv,D]); return its :class:`TTTProblem`.

    Each step is checked as one :func:`check_varlen` call would check it (dtypes, devices, D, T,
    and the values of ``cu_seqlens`` when it is on the CPU).
    """
    what = "ttt_attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise AttentionConfigError(f"{what}: {name} must be a [steps, T, heads, D] tensor, got {got}")
    if k.shape != v.shape:
        raise AttentionConfigError(f"{what}: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[0] == 0:
        raise AttentionConfigError(f"{what}: q holds no step; pass at least one")
    try:
        base = check_varlen(q[0], k[0], v[0], cu_seqlens, max_seqlen, scale)
    except AttentionConfigError as e:  # the per-step check names attention_varlen: say whose call it was
        raise AttentionConfigError(f"{what} (each step as attention_varlen): {e}") from None
    except AttentionInputError as e:
        raise AttentionInputError(f"{what} (each step as attention_varlen): {e}") from None
    return TTTProblem(**{f: getattr(base, f) for f in ("num_seqs", "heads_q", "heads_kv", "head_dim", "max_seqlen",
                                                       "scale")},
                      q_steps=q.shape[0], k_steps=k.shape[0], tokens=q.shape[1])
