"""PyTorch reference attention: the CPU path and the oracle the Triton kernels are tested against.

Plain differentiable torch ops, no custom backward. Semantics, shared with the kernels:

- scores ``S = scale * q k^T`` per head; a query head ``h`` reads key/value head
  ``h // (Hq // Hkv)`` (GQA via ``repeat_interleave``);
- ``causal``: query ``i`` sees keys ``j <= i`` of its own sequence only;
- varlen: documents never see each other (block-diagonal), computed by a loop over the
  documents of ``cu_seqlens``; zero-length documents contribute nothing;
- padded: keys at positions ``>= length`` are never seen; query rows at positions
  ``>= length`` output exactly 0 and get exactly 0 gradient. Such rows are given a
  non-empty dummy mask before the softmax (then zeroed), so no NaN appears even for
  ``length == 0``.

``upcast=True`` (the default, and what the "reference" backend runs) computes in fp32 and
returns the input dtype. ``upcast=False`` computes in the input dtype: the
"same-precision PyTorch implementation" the kernels' error is compared with.
Memory is O(H L^2) per sequence, so this path is for CPU runs and tests, not for long
sequences.
"""

from __future__ import annotations

import torch

from .inputs import check_padded, check_varlen


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None,
            scale: float, upcast: bool) -> torch.Tensor:
    """softmax(scale q k^T masked by ``allowed``) v over the last two dims; heads at dim -3."""
    dtype = q.dtype
    if upcast:  # fp32 for 16-bit inputs; float64 stays float64
        wide = torch.promote_types(dtype, torch.float32)
        q, k, v = q.to(wide), k.to(wide), v.to(wide)
    group = q.shape[-3] // k.shape[-3]
    if group > 1:  # GQA: (.., Hkv, L, D) -> (.., Hq, L, D)
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
    with torch.autocast(q.device.type, enabled=False):  # the precision chosen above, not autocast's
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # (.., Hq, Lq, Lk)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        return torch.matmul(probs, v).to(dtype)


def attention_varlen_reference(q, k, v, cu_seqlens, max_seqlen, causal: bool = True,
                               scale: float | None = None, *, upcast: bool = True) -> torch.Tensor:
    """Block-diagonal (causal) attention over packed documents. q [T,Hq,D], k/v [T,Hkv,D] -> [T,Hq,D]."""
    prob = check_varlen(q, k, v, cu_seqlens, max_seqlen, scale)
    bounds = cu_seqlens.tolist()
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        n = end - start
        if n == 0:
            continue
        # (n, H, D) -> (H, n, D)
        qi, ki, vi = (t[start:end].transpose(0, 1) for t in (q, k, v))
        allowed = torch.ones(n, n, dtype=torch.bool, device=q.device).tril() if causal else None
        pieces.append(_attend(qi, ki, vi, allowed, prob.scale, upcast).transpose(0, 1))
    if not pieces:
        return q.new_zeros(q.shape)
    return torch.cat(pieces, dim=0)


def attention_varlen_grouped(q, k, v, cu_seqlens, max_seqlen, causal: bool = True,
                             scale: float | None = None, *, slack: float = 0.8) -> torch.Tensor:
    """:func:`attention_varlen_reference`, fast on CPU: documents are grouped by length.

    The per-document loop above launches ~10 small matmuls per document: with ~50 short
    documents per micro-batch its overhead outweighs the padding that varlen saves (the CPU
    trainer benchmark ranked varlen below padded layouts). Here documents are sorted by length
    and cut into groups whose shortest member is at least ``slack`` x the group's longest;
    each group is gathered into a right-padded ``[B, H, Lg, D]`` batch and run by
    :func:`attention_padded_reference` (padding waste <= 1 - slack per group), then the rows
    are scattered back. Same semantics and values (up to summation order) as the oracle;
    tested against it, forward and backward.
    """
    prob = check_varlen(q, k, v, cu_seqlens, max_seqlen, scale)
    cu = cu_seqlens.to(torch.int64).cpu()
    lens = cu[1:] - cu[:-1]
    order = torch.argsort(lens, descending=True, stable=True).tolist()
    order = [d for d in order if lens[d] > 0]
    groups, cur = [], []
    for d in order:  # lengths descending: cur[0] is the group's longest
        if cur and int(lens[d]) < slack * int(lens[cur[0]]):
            groups.append(cur)
            cur = []
        cur.append(d)
    if cur:
        groups.append(cur)
    rows, vals = [], []
    for g in groups:
        g_lens = lens[g]  # (B,)
        width = int(g_lens[0])
        pos = torch.arange(width)
        valid = pos[None, :] < g_lens[:, None]  # (B, Lg)
        idx = torch.where(valid, cu[g][:, None] + pos[None, :], cu[g][:, None]).to(q.device)  # (B, Lg)
        # (B, Lg, H, D) -> (B, H, Lg, D)
        qg, kg, vg = (t[idx].transpose(1, 2) for t in (q, k, v))
        og = attention_padded_reference(qg, kg, vg, g_lens.to(q.device, torch.int32), causal, prob.scale)
        og = og.transpose(1, 2)  # (B, Lg, H, D)
        vmask = valid.to(q.device)
        rows.append(idx[vmask])
        vals.append(og[vmask])
    out = q.new_zeros(q.shape)
    if not rows:
        return out
    return out.index_put((torch.cat(rows),), torch.cat(vals))


def attention_padded_reference(q, k, v, lengths, causal: bool = True, scale: float | None = None,
                               *, upcast: bool = True) -> torch.Tensor:
    """Attention over right-padded rows. q [B,Hq,L,D], k/v [B,Hkv,L,D], lengths [B] -> [B,Hq,L,D]."""
    prob = check_padded(q, k, v, lengths, scale)
    seq = q.shape[2]
    pos = torch.arange(seq, device=q.device)
    valid = pos[None, :] < lengths.to(torch.int64)[:, None]  # (B, L)
    allowed = valid[:, None, None, :]  # keys: (B, 1, 1, L)
    if causal:
        allowed = allowed & (pos[None, :] <= pos[:, None])  # (B, 1, L, L)
    query_valid = valid[:, None, :, None]  # (B, 1, L, 1)
    allowed = allowed | ~query_valid  # padded query rows: any finite softmax, zeroed below
    out = _attend(q, k, v, allowed, prob.scale, upcast)
    return out * query_valid.to(out.dtype)
