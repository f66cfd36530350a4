"""PyTorch reference of DFlash attention: the CPU path and the oracle of the Triton kernels.

Semantics (docs/definitions.md "Mask"). Document ``d`` holds ``S_d`` context rows
(``k_ctx``/``v_ctx[cu_ctx[d]:cu_ctx[d+1]]``) and ``N_d`` blocks of ``B`` draft rows
(``q``/``k_blk``/``v_blk[cu_blk[d]:cu_blk[d+1]]``); block ``j`` has anchor ``a_j``. Each of
block ``j``'s B queries attends to

- context positions ``[0, a_j)`` of its own document (strictly before the anchor), and
- all B draft keys of its own block, in both directions,

and to nothing else. With a sliding window ``W > 0`` the query of slot ``r`` (position
``a_j + r``) keeps only the context positions ``c >= a_j + r - W + 1`` of those
(:func:`~dflash_prep.kernels.inputs.window_start`: the public code's rule); its own block
stays whole, since W >= B. The own block is always visible, so no row is ever fully masked; a
document with ``N_d = 0`` contributes no rows.

Per document this is one softmax over the concatenation ``[context scores (masked to
col < a_j) | own-block scores]``, i.e. ``N_d·B x (S_d + B)`` scores: the dense
``N_d·B x (S_d + N_d·B)`` mask of public implementations with the always-masked other-block
columns dropped (same values, ``N_d·B x N_d·B`` fewer entries). Plain differentiable torch
ops, no custom backward; memory is O(Hq · N_d·B · S_d) per document, so this path is for CPU
runs and tests. ``upcast=True`` (what the "reference" backend runs) computes in fp32 (fp64
stays fp64) and returns the input dtype; ``upcast=False`` computes in the input dtype: the
"same-precision PyTorch implementation" the kernels' error is compared with.
"""

from __future__ import annotations

import torch

from .inputs import check_dflash, window_start


def attention_dflash_reference(q, k_ctx, v_ctx, k_blk, v_blk, cu_ctx, cu_blk, anchors, block_size: int, *,
                               scale: float | None = None, upcast: bool = True, window: int = 0) -> torch.Tensor:
    """DFlash attention by a per-document masked softmax. Shapes as in ``attention_dflash``; -> [sum N_d·B, Hq, D]."""
    prob = check_dflash(q, k_ctx, v_ctx, k_blk, v_blk, cu_ctx, cu_blk, anchors, block_size, scale, window=window)
    dtype, bsz, group = q.dtype, prob.block_size, prob.group
    if upcast:
        wide = torch.promote_types(dtype, torch.float32)
        q, k_ctx, v_ctx, k_blk, v_blk = (t.to(wide) for t in (q, k_ctx, v_ctx, k_blk, v_blk))
    ctx_bounds, blk_bounds = cu_ctx.tolist(), cu_blk.tolist()
    anchors = anchors.to(torch.int64)
    pieces = []
    with torch.autocast(q.device.type, enabled=False):  # the precision chosen above, not autocast's
        for d in range(prob.num_docs):
            (s0, s1), (r0, r1) = ctx_bounds[d:d + 2], blk_bounds[d:d + 2]
            n = (r1 - r0) // bsz
            if n == 0:
                continue
            hq, rows, seq = prob.heads_q, r1 - r0, s1 - s0
            qd = q[r0:r1].transpose(0, 1)  # (Hq, n*B, D)
            kc, vc = (t[s0:s1].transpose(0, 1).repeat_interleave(group, 0) for t in (k_ctx, v_ctx))  # (Hq, S, D)
            kb, vb = (t[r0:r1].transpose(0, 1).repeat_interleave(group, 0).reshape(hq, n, bsz, -1)
                      for t in (k_blk, v_blk))  # (Hq, n, B, D)
            row_anchor = anchors[r0 // bsz:r1 // bsz].repeat_interleave(bsz)  # (n*B,)
            row_start = window_start(row_anchor, torch.arange(rows, device=q.device) % bsz, prob.window)  # (n*B,)
            cols = torch.arange(seq, device=q.device)[None, :]
            seen = (cols < row_anchor[:, None]) & (cols >= row_start[:, None])  # (n*B, S)
            s_ctx = (qd @ kc.transpose(1, 2) * prob.scale).masked_fill(~seen, float("-inf"))  # (Hq, n*B, S)
            s_blk = qd.reshape(hq, n, bsz, -1) @ kb.transpose(2, 3) * prob.scale  # (Hq, n, B, B)
            probs = torch.softmax(torch.cat([s_ctx, s_blk.reshape(hq, rows, bsz)], dim=-1), dim=-1)
            probs = probs.to(vc.dtype)  # (Hq, n*B, S + B)
            o_blk = probs[..., seq:].reshape(hq, n, bsz, bsz) @ vb  # (Hq, n, B, D)
            o = probs[..., :seq] @ vc + o_blk.reshape(hq, rows, -1)  # (Hq, n*B, D)
            pieces.append(o.transpose(0, 1))  # (n*B, Hq, D)
    if not pieces:  # no blocks at all: q is empty; stay on the autograd graph
        return (q * 0).to(dtype)
    return torch.cat(pieces).to(dtype)  # documents' draft rows are contiguous and in order: [sum N_d*B, Hq, D]
