"""PyTorch reference of EAGLE-3 training-time-test (TTT) attention: the CPU path and the oracle
the Triton kernels are tested against.

Semantics (SpecForge's ``LlamaAttention`` with ``cache_hidden``, speculators' TTT). The drafter
runs ``Sk`` steps over the same packed tokens; step ``j`` has keys/values ``k[j]``, ``v[j]``
``[T, Hkv, D]``. The query of step ``i`` at token ``t`` of document ``d`` attends to

- the step-0 keys/values of every token ``s`` of document ``d`` with ``s <= t`` (causal), and
- the keys/values of steps ``1..i`` at token ``t`` itself (the "diagonal" keys; none for step 0),

one softmax over all of them, scale ``1/sqrt(D)`` by default. GQA: query head ``h`` reads key/value
head ``h // (Hq // Hkv)``. ``q`` ``[Sq, T, Hq, D]`` holds the *last* ``Sq`` of the ``Sk`` steps
(``Sq = Sk``: all steps in one call; ``Sq = 1``: the newest step, the way a TTT loop calls it
step by step): ``q[iq]`` is step ``iq + Sk - Sq``. Every row sees at least its own step-0 key, so
no row is ever fully masked.

Per document of ``n`` tokens this builds, per query step and head, the ``n x n`` causal scores
against ``k[0]`` and the ``n x (Sk-1)`` diagonal scores ``q[t] . k[j][t]`` (masked to ``j <=
step``), and takes one softmax over their concatenation: ``Sq * Hq * n * (n + Sk - 1)`` scores,
so memory is O(Sq Hq n^2) per document: for CPU runs and tests, not long documents.
:func:`ttt_mask` builds the same rule as one dense boolean mask over the flattened ``(step,
token)`` axes, for SDPA. ``upcast=True`` (what the "reference" backend runs) computes in fp32
(fp64 stays fp64) and returns the input dtype; ``upcast=False`` computes in the input dtype: the
"same-precision PyTorch implementation" the kernels' error is compared with.
"""

from __future__ import annotations

import torch

from .inputs import check_ttt


def ttt_attention_reference(q, k, v, cu_seqlens, max_seqlen, *, sm_scale: float | None = None,
                            upcast: bool = True) -> torch.Tensor:
    """TTT attention by a per-document masked softmax. q [Sq,T,Hq,D], k/v [Sk,T,Hkv,D] -> o [Sq,T,Hq,D]."""
    prob = check_ttt(q, k, v, cu_seqlens, max_seqlen, sm_scale)
    dtype, group, sq, sk = q.dtype, prob.group, prob.q_steps, prob.k_steps
    if upcast:
        wide = torch.promote_types(dtype, torch.float32)
        q, k, v = q.to(wide), k.to(wide), v.to(wide)
    step = torch.arange(sq, device=q.device) + prob.step_offset  # (Sq,) true step of each query step
    diag_seen = torch.arange(1, sk, device=q.device)[None, :] <= step[:, None]  # (Sq, Sk-1): step j <= i
    bounds = cu_seqlens.tolist()
    pieces = []
    with torch.autocast(q.device.type, enabled=False):  # the precision chosen above, not autocast's
        for start, end in zip(bounds[:-1], bounds[1:]):
            n = end - start
            if n == 0:
                continue
            qd = q[:, start:end].permute(0, 2, 1, 3)  # (Sq, Hq, n, D)
            k0, v0 = (t[0, start:end].transpose(0, 1).repeat_interleave(group, 0) for t in (k, v))  # (Hq, n, D)
            kd, vd = (t[1:, start:end].permute(0, 2, 1, 3).repeat_interleave(group, 1) for t in (k, v))  # (Sk-1, Hq, n, D)
            causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()  # (n, n): s <= t
            s_causal = (qd @ k0.transpose(-1, -2) * prob.scale).masked_fill(~causal, float("-inf"))  # (Sq, Hq, n, n)
            s_diag = torch.einsum("ihtd,jhtd->ihtj", qd, kd) * prob.scale  # (Sq, Hq, n, Sk-1): q_i[t] . k_j[t]
            s_diag = s_diag.masked_fill(~diag_seen[:, None, None, :], float("-inf"))
            probs = torch.softmax(torch.cat([s_causal, s_diag], dim=-1), dim=-1).to(v0.dtype)  # (Sq, Hq, n, n+Sk-1)
            o = probs[..., :n] @ v0 + torch.einsum("ihtj,jhtd->ihtd", probs[..., n:], vd)  # (Sq, Hq, n, D)
            pieces.append(o.permute(0, 2, 1, 3))  # (Sq, n, Hq, D)
    if not pieces:  # no tokens: stay on the autograd graph
        return (q * 0).to(dtype)
    return torch.cat(pieces, dim=1).to(dtype)  # documents are contiguous and in order: (Sq, T, Hq, D)


def ttt_mask(cu_seqlens: torch.Tensor, q_steps: int, k_steps: int) -> torch.Tensor:
    """The TTT rule as a dense boolean mask ``[Sq*T, Sk*T]`` (True = attend), on ``cu_seqlens``' device.

    Rows are queries flattened ``(step, token)`` (row ``iq*T + t`` is ``q[iq, t]``, step ``iq +
    Sk - Sq``), columns keys flattened the same way (column ``j*T + s`` is ``k[j, s]``). Row
    ``(i, t)`` keeps column ``(0, s)`` when ``s`` is in ``t``'s document and ``s <= t``, and
    column ``(j, t)`` when ``1 <= j <= i``; nothing else. So ``SDPA(q.permute(2,0,1,3).reshape(Hq,
    Sq*T, D), k..., attn_mask=ttt_mask(...))`` equals :func:`ttt_attention_reference` (tested).
    ``(Sq*T) x (Sk*T)`` booleans: for tests and per-document baselines only.
    """
    cu = cu_seqlens.to(torch.int64)
    total = int(cu[-1])
    tok = torch.arange(total, device=cu.device)
    doc = torch.searchsorted(cu[1:], tok, right=True)  # (T,) document of each token
    causal = (doc[:, None] == doc[None, :]) & (tok[None, :] <= tok[:, None])  # (T, T)
    same = tok[:, None] == tok[None, :]  # (T, T) the diagonal
    step = torch.arange(q_steps, device=cu.device) + (k_steps - q_steps)  # (Sq,)
    key_step = torch.arange(k_steps, device=cu.device)  # (Sk,)
    diag = (key_step[None, :] >= 1) & (key_step[None, :] <= step[:, None])  # (Sq, Sk)
    mask = torch.where((key_step == 0)[None, :, None, None], causal[None, None], diag[:, :, None, None] & same)
    return mask.permute(0, 2, 1, 3).reshape(q_steps * total, k_steps * total)  # (Sq, T, Sk, T) -> rows, cols
