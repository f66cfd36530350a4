"""No leak, ever (issue 23 item 6; SpecForge #470): when anchors sit closer than B or side by
side, block j's loss must not reach any context key at or past its anchor, nor any other
block's draft keys. Checked exactly (== 0, not close) on the gradients, for the reference and
the Triton kernels (the interpreter on CPU), with and without a sliding window."""

from __future__ import annotations

import pytest
import torch

from dflash_prep.kernels.attention import attention_dflash, force_backend

from .dflash_helpers import make_dflash

B = 4
# doc 0: adjacent anchors (3, 4, 5), one 2 apart (7), a repeat (7), one at S-1; doc 1: anchor 0, 1
DOCS = [(24, [3, 4, 5, 7, 7, 23]), (6, [0, 1])]


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("window", [0, 4, 6])
def test_block_loss_never_reaches_context_at_or_past_its_anchor(backend, window):
    q, k_ctx, v_ctx, k_blk, v_blk, _, cu_ctx, cu_blk, anchors = make_dflash(DOCS, B, 4, 2, 32, torch.float32, seed=7)
    starts = cu_ctx.tolist()
    doc_of_block = [d for d, (_, a) in enumerate(DOCS) for _ in a]
    g = torch.Generator().manual_seed(3)
    for j in range(anchors.numel()):
        leaves = [t.clone().requires_grad_() for t in (q, k_ctx, v_ctx, k_blk, v_blk)]
        with force_backend(backend):
            o = attention_dflash(*leaves, cu_ctx, cu_blk, anchors, B, window=window)
        loss = (o[j * B:(j + 1) * B] * torch.randn(o[j * B:(j + 1) * B].shape, generator=g)).sum()  # block j only
        _, dkc, dvc, dkb, dvb = torch.autograd.grad(loss, leaves)
        d, a = doc_of_block[j], int(anchors[j])
        lo = max(0, a - (window - 1)) if window else 0  # slot 0's window start: the widest view
        seen = torch.zeros(k_ctx.shape[0], dtype=torch.bool)
        seen[starts[d] + lo:starts[d] + a] = True  # what block j may see: [lo, a_j) of its own document
        for name, grad in (("dk_ctx", dkc), ("dv_ctx", dvc)):
            assert torch.equal(grad[~seen], torch.zeros_like(grad[~seen])), \
                f"{backend} W={window}: block {j} (a={a}) leaks into {name} at {torch.nonzero(grad[~seen].abs().sum((1, 2)))}"
            if a > lo:
                assert grad[seen].abs().sum(dim=(1, 2)).gt(0).all(), f"{name}: a visible key got no gradient"
        own = torch.zeros(k_blk.shape[0], dtype=torch.bool)
        own[j * B:(j + 1) * B] = True
        for name, grad in (("dk_blk", dkb), ("dv_blk", dvb)):
            assert torch.equal(grad[~own], torch.zeros_like(grad[~own])), f"{backend}: block {j} leaks into {name}"
