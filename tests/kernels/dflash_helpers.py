"""Builders and oracles for the DFlash attention tests."""

from __future__ import annotations

import math

import torch

NAMES = ("o", "dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk")


def make_dflash(docs, block_size, hq, hkv, d, dtype, seed=0):
    """Inputs for documents ``docs = [(S_d, [a_0, a_1, ...]), ...]`` (anchors sorted).

    Returns ``(q, k_ctx, v_ctx, k_blk, v_blk, do, cu_ctx, cu_blk, anchors)``, all on CPU.
    """
    g = torch.Generator().manual_seed(seed)
    ctx_lens = [s for s, _ in docs]
    blk_lens = [len(a) * block_size for _, a in docs]

    def cu(lens):
        out = torch.zeros(len(lens) + 1, dtype=torch.int32)
        out[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0).to(torch.int32)
        return out

    rows, ctx = sum(blk_lens), sum(ctx_lens)
    q = torch.randn(rows, hq, d, generator=g).to(dtype)
    k_ctx = torch.randn(ctx, hkv, d, generator=g).to(dtype)
    v_ctx = torch.randn(ctx, hkv, d, generator=g).to(dtype)
    k_blk = torch.randn(rows, hkv, d, generator=g).to(dtype)
    v_blk = torch.randn(rows, hkv, d, generator=g).to(dtype)
    do = torch.randn(rows, hq, d, generator=g).to(dtype)
    anchors = torch.tensor([a for _, anc in docs for a in anc], dtype=torch.int32)
    return q, k_ctx, v_ctx, k_blk, v_blk, do, cu(ctx_lens), cu(blk_lens), anchors


def run_dflash(fn, q, k_ctx, v_ctx, k_blk, v_blk, do, cu_ctx, cu_blk, anchors, block_size, **kwargs):
    """(o, dq, dk_ctx, dv_ctx, dk_blk, dv_blk) of ``fn`` for upstream gradient ``do``."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k_ctx, v_ctx, k_blk, v_blk)]
    o = fn(*leaves, cu_ctx, cu_blk, anchors, block_size, **kwargs)
    grads = torch.autograd.grad(o, leaves, do, allow_unused=True)
    return (o.detach(), *[torch.zeros_like(x) if gr is None else gr for x, gr in zip(leaves, grads)])


def public_window_keep(a: int, block_size: int, window: int) -> torch.Tensor:
    """(B, a + B) keep mask of one block the way the public inference code runs a
    ``sliding_attention`` layer: keys are [context 0..a-1 | block a..a+B-1] at their absolute
    positions, the block's B queries at a..a+B-1, and transformers' flash-attention path passes
    ``window_size=(W-1, W-1)`` (only when there are more than W keys): keep ``|q_pos - k_pos| <= W-1``."""
    q_pos = torch.arange(a, a + block_size)[:, None]
    k_pos = torch.arange(a + block_size)[None, :]
    if window == 0 or a + block_size <= window:
        return torch.ones(block_size, a + block_size, dtype=torch.bool)
    return (q_pos - k_pos).abs() <= window - 1


def naive_dflash(q, k_ctx, v_ctx, k_blk, v_blk, cu_ctx, cu_blk, anchors, block_size, *, scale=None, window=0):
    """The definition, one block and one head at a time: softmax over cat(k_ctx[:a_j], own block),
    under :func:`public_window_keep` when ``window`` > 0."""
    rows, hq, d = q.shape
    group = hq // k_ctx.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = []
    for doc in range(cu_ctx.numel() - 1):
        s0 = int(cu_ctx[doc])
        r0, r1 = int(cu_blk[doc]), int(cu_blk[doc + 1])
        for j, r in enumerate(range(r0, r1, block_size)):
            a = int(anchors[r // block_size])
            heads = []
            for h in range(hq):
                hk = h // group
                keys = torch.cat([k_ctx[s0:s0 + a, hk], k_blk[r:r + block_size, hk]])  # (a + B, D)
                vals = torch.cat([v_ctx[s0:s0 + a, hk], v_blk[r:r + block_size, hk]])
                scores = (q[r:r + block_size, h] @ keys.T * scale).masked_fill(
                    ~public_window_keep(a, block_size, window), float("-inf"))  # (B, a + B)
                p = torch.softmax(scores, dim=-1)
                heads.append(p @ vals)  # (B, D)
            out.append(torch.stack(heads, dim=1))  # (B, Hq, D)
    return torch.cat(out) if out else q.new_zeros(q.shape)


def dense_mask_dflash(q, k_ctx, v_ctx, k_blk, v_blk, cu_ctx, cu_blk, anchors, block_size, *, scale=None):
    """The public formulation: per document, SDPA over [context | all draft keys] with a dense
    boolean mask of N_d·B x (S_d + N_d·B) entries."""
    out = []
    for doc in range(cu_ctx.numel() - 1):
        s0, s1 = int(cu_ctx[doc]), int(cu_ctx[doc + 1])
        r0, r1 = int(cu_blk[doc]), int(cu_blk[doc + 1])
        if r1 == r0:
            continue
        seq, rows = s1 - s0, r1 - r0
        blk = torch.arange(rows) // block_size  # (rows,)
        a = anchors[r0 // block_size:r1 // block_size].to(torch.int64)[blk]  # (rows,)
        mask = torch.cat([torch.arange(seq)[None, :] < a[:, None], blk[None, :] == blk[:, None]], dim=1)
        keys = torch.cat([k_ctx[s0:s1], k_blk[r0:r1]]).transpose(0, 1)  # (Hkv, S + rows, D)
        vals = torch.cat([v_ctx[s0:s1], v_blk[r0:r1]]).transpose(0, 1)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[r0:r1].transpose(0, 1), keys, vals, attn_mask=mask, scale=scale, enable_gqa=True)
        out.append(o.transpose(0, 1))
    return torch.cat(out) if out else q.new_zeros(q.shape)
