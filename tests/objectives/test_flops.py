"""The DFlash FLOP count, term by term against hand computations.

One count (:func:`dflash_prep.objectives.drafter_cost.flops`) serves pack's rank balance (with
the anchor positions and labelled rows at their expectations, :func:`sample_cost`) and the
trainer's MFU (:func:`dflash_prep.train.objectives.dflash.objective.step_flops`, with what a micro-batch
holds). The LM head is frozen: forward and input gradient, ``4 H V`` per row with a loss weight.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from dflash_prep.objectives.drafter_cost import DrafterCostModel, flops, mean_labelled, sample_cost

DIMS = dict(hidden=8, layers=3, intermediate=12, heads=2, kv_heads=1, head_dim=4, vocab=50)
H, h, hkv, d, I, V, L_t = 8, 2, 1, 4, 12, 50, 3
LAYER = H * h * d * 2 + H * hkv * d * 2 + 3 * H * I            # q, o + k, v + SwiGLU


def _by_hand(N, B, T, sq, k, seen, rows, layers=L_t):
    target = 2 * layers * LAYER * T + 2 * h * d * layers * sq       # frozen forward + causal attention
    context = 6 * (N * H * H + N * 2 * H * hkv * d) * T             # fc over the taps + draft k/v, fwd + bwd
    blocks = 6 * N * LAYER * k * B                                  # block tokens through the draft layers
    attn = 12 * h * d * B * N * (seen + k * B)                       # each block over its prefix and itself
    head = 4 * rows * H * V                                          # frozen head, labelled rows only
    return target + context + blocks + attn + head


def test_coefficients_by_hand():
    m = DrafterCostModel(**DIMS, draft_layers=2)
    assert m.layer_params == LAYER == 128 + 64 + 288
    assert m.target_params == L_t * LAYER and m.draft_params == 2 * LAYER + 2 * H * H
    c = m.coefficients(4)
    assert c == {"tokens": 2 * L_t * LAYER + 6 * (2 * H * H + 2 * 2 * H * hkv * d), "tokens_sq": 2 * h * d * L_t,
                 "anchors": 6 * 2 * LAYER * 4 + 12 * h * d * 4 * 2 * 4, "anchor_pos": 12 * h * d * 4 * 2,
                 "head_rows": 4 * H * V}
    assert flops(m.coefficient_array(4), 10.0, 100.0, 2.0, 7.0, 5.0) == _by_hand(2, 4, 10, 100, 2, 7, 5)


def test_mean_labelled_by_enumeration():
    for S in range(0, 30):
        for B in (2, 4, 8, 16):
            m = np.arange(1, S)                     # L - 1 - a over the candidates a in [L - S, L - 2]
            want = float(np.minimum(B - 1, m).mean()) if len(m) else 0.0
            assert mean_labelled(float(S), float(B)) == pytest.approx(want, rel=1e-12), (S, B)


def test_pack_sample_cost_by_hand():
    # L = 10, S = 6 supervised, k = 2 anchors: sum a_j at k (L - S/2 - 1), rows at k E[min(B-1, m)], m in 1..5
    m, B, L, S, k = DrafterCostModel(**DIMS, draft_layers=2), 4, 10, 6, 2
    want = _by_hand(2, B, L, L * L, k, k * (L - S / 2 - 1), k * (1 + 2 + 3 + 3 + 3) / 5)
    assert sample_cost(m, B, np.array([L]), np.array([S]), np.array([k]))[0] == pytest.approx(want, rel=1e-12)


def test_trainer_step_flops_by_hand():
    pytest.importorskip("torch")
    import torch

    from dflash_prep.train.objectives.dflash.objective import flops_coefficients, step_flops

    B = 4
    cfg = SimpleNamespace(hidden=H, intermediate=I, heads=h, kv_heads=hkv, head_dim=d, vocab_size=V, num_layers=2,
                          sliding_window=0, block_size=B, target_layer_ids=(0, 1))
    weights = torch.tensor([0, 1, 1, 0.5, 0, 1, 0.2, 0], dtype=torch.float32)      # 2 blocks, 5 rows with loss
    b = SimpleNamespace(weights=weights, anchors=torch.tensor([0, 5], dtype=torch.int32), real_tokens=10,
                        n_anchors=2, cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32))
    # ce: the target runs to its last tap (layer 1: 2 layers); kl: all 3
    assert step_flops(flops_coefficients(cfg, 3, "ce"), b) == _by_hand(2, B, 10, 16 + 36, 2, 0 + 5, 5, layers=2)
    assert step_flops(flops_coefficients(cfg, 3, "kl"), b) == _by_hand(2, B, 10, 16 + 36, 2, 0 + 5, 5, layers=3)
    windowed = flops_coefficients(SimpleNamespace(**{**vars(cfg), "sliding_window": 3}), 3, "ce")
    assert step_flops(windowed, b) == _by_hand(2, B, 10, 16 + 36, 2, 0 + 3, 5, layers=2)
