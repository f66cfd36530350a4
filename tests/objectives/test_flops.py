"""The DFlash FLOP counts, term by term against hand computations.

The two counts differ in their LM-head term. Pack's cost model
(:mod:`dflash_prep.objectives.drafter_cost`) prices the frozen head at ``6 k B H V``: every
block row, forward and both gradients. The trainer's MFU count
(:func:`dflash_prep.train.objective_dflash.step_flops`) prices it at ``4 n H V``: only the
``n <= k (B - 1)`` rows with a loss weight, forward and input gradient (a frozen head has no
weight gradient). The trainer's is what runs; correcting pack's moves every dflash manifest
(its rank balance), so it is a deliberate change of its own. These tests pin both as they are.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from dflash_prep.objectives.drafter_cost import DrafterCostModel, sample_cost

DIMS = dict(hidden=8, layers=3, intermediate=12, heads=2, kv_heads=1, head_dim=4, vocab=50)


def test_pack_cost_model_terms_by_hand():
    m = DrafterCostModel(**DIMS, draft_layers=2)
    H, h, hkv, d, I, V, L_t, N, B = 8, 2, 1, 4, 12, 50, 3, 2, 4
    layer = H * h * d * 2 + H * hkv * d * 2 + 3 * H * I            # q, o + k, v + SwiGLU
    assert m.layer_params == layer == 128 + 64 + 288
    assert m.target_params == L_t * layer and m.draft_params == N * layer + N * H * H
    c = m.coefficients(B)
    assert c["tokens"] == 2 * L_t * layer + 6 * (N * H * H + N * 2 * H * hkv * d)   # target fwd + drafter context
    assert c["tokens_sq"] == 2 * h * d * L_t                                        # causal attention, per L^2
    head = 6 * B * H * V                                                            # LM head per anchor
    assert c["anchors"] == 6 * m.draft_params * B + head + 12 * h * d * B * N * B   # blocks + head + attn over B
    assert c["anchor_pos"] == 12 * h * d * B * N                                    # attn over the prefix a_j
    # one sample: L = 10, S = 6 supervised, k = 2 anchors; sum a_j at its expectation k (L - S/2 - 1)
    L, S, k = 10, 6, 2
    want = c["tokens"] * L + c["tokens_sq"] * L * L + c["anchors"] * k + c["anchor_pos"] * k * (L - S / 2 - 1)
    assert sample_cost(m, B, np.array([L]), np.array([S]), np.array([k]))[0] == pytest.approx(want, rel=1e-12)


def test_trainer_step_flops_terms_by_hand():
    torch = pytest.importorskip("torch")
    from dflash_prep.train.objective_dflash import step_flops

    B = 4
    weights = torch.tensor([0, 1, 1, 0.5, 0, 1, 0.2, 0], dtype=torch.float32)      # 2 blocks, 5 rows with loss
    b = SimpleNamespace(weights=weights, anchors=torch.tensor([0, 5], dtype=torch.int32), real_tokens=10, n_anchors=2)
    P_t, P_d, V, H, heads, hd, layers = 1000, 100, 50, 8, 2, 4, 1
    target = 2 * P_t * 10                                   # frozen forward over the tapped layers
    drafter = 6 * P_d * 2 * B                               # blocks through the draft layers, fwd + bwd
    attn = 3 * 4 * heads * hd * B * ((0 + B) + (5 + B)) * layers
    head = 4 * 5 * V * H                                    # rows with a loss only; frozen: no weight gradient
    assert step_flops(P_t, P_d, V * H, b, heads, hd, layers, B) == target + drafter + attn + head == 37792
