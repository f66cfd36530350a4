"""The recipe's loss pieces: D-PACE slot weights, the chunked per-row CE / KL, and the DFlash loss
under ``dpace`` and ``kl`` against plain references on a real tiny Qwen3 target."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dflash_prep.train.chunked_kl import row_losses
from dflash_prep.train.objectives.dflash.drafter import Drafter, DrafterConfig
from dflash_prep.train.objectives.dflash.objective import LossSpec, dflash_loss, dpace_weights
from dflash_prep.train.objectives.dflash.batch import AnchorSpec, build_dflash_batch, slot_weights
from dflash_prep.train.target import FrozenTarget

from dflash_prep.tests.train.dflash_fixtures import MASK_ID, tiny_target
from dflash_prep.tests.train.train_fakes import FakeDataset, FakeMB


def _hand_dpace(ce, mask, alpha):
    """D-PACE by the definition, one block at a time, in Python floats."""
    out = []
    for ce_row, m_row in zip(ce, mask):
        qs = [(1 - alpha) * math.exp(-c) + alpha if m else 1.0 for c, m in zip(ce_row, m_row)]
        prefix = [math.prod(qs[:i + 1]) for i in range(len(qs))]
        out.append([sum(prefix[k] for k in range(r, len(qs)) if m_row[k]) if m_row[r] else 0.0
                    for r in range(len(qs))])
    return out


def test_dpace_weights_equal_a_hand_computation():
    ce = [[9.0, 0.1, 0.7, 2.0, 0.3], [5.0, 1.2, 0.4, 0.05, 3.0], [1.0, 0.2, 0.9, 1.5, 0.6]]
    mask = [[0, 1, 1, 1, 1], [0, 1, 0, 1, 1], [0, 1, 1, 0, 0]]  # full, a hole mid-block, cut by the document end
    w = dpace_weights(torch.tensor(ce), torch.tensor(mask, dtype=torch.float32), 0.5)
    want = torch.tensor(_hand_dpace(ce, mask, 0.5))
    torch.testing.assert_close(w, want, rtol=1e-6, atol=1e-7)
    # spelled out for the first block: w_1 = q1 + q1 q2 + q1 q2 q3 + q1 q2 q3 q4, slot 0 ignored
    q = [0.5 * math.exp(-c) + 0.5 for c in ce[0][1:]]
    assert w[0, 1].item() == pytest.approx(q[0] + q[0] * q[1] + q[0] * q[1] * q[2] + q[0] * q[1] * q[2] * q[3])
    assert w[0, 4].item() == pytest.approx(q[0] * q[1] * q[2] * q[3])


def test_dpace_weights_non_increasing_masked_zero_no_grad():
    g = torch.Generator().manual_seed(3)
    ce = (torch.rand(64, 16, generator=g) * 6).requires_grad_()
    mask = (torch.rand(64, 16, generator=g) > 0.2).float()
    mask[:, 0] = 0
    for alpha in (0.1, 0.5, 1.0):
        w = dpace_weights(ce, mask, alpha)
        assert not w.requires_grad
        assert torch.all(w[mask == 0] == 0) and torch.all(w[mask > 0] > 0)
        for row, m in zip(w, mask):
            kept = row[m > 0]
            assert torch.all(kept[1:] <= kept[:-1]), row
    # alpha = 1: every q~ is 1, so w_r = number of labelled slots from r on
    full = torch.ones(2, 5)
    full[:, 0] = 0
    torch.testing.assert_close(dpace_weights(torch.zeros(2, 5), full, 1.0), torch.tensor([[0., 4, 3, 2, 1]] * 2))
    with pytest.raises(ValueError, match="alpha"):
        dpace_weights(ce, mask, 0.0)


def _ref_logits(h, W):
    return h.double() @ W.double().T


@pytest.mark.parametrize("chunk", [3, 64])
def test_row_ce_and_its_weighted_gradient_match_autograd(chunk):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(20, 8, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(30, 8, generator=g, dtype=torch.float64)
    tg = torch.randint(0, 30, (20,), generator=g)
    w = torch.rand(20, generator=g, dtype=torch.float64)
    loss, ce, pred = row_losses(h, W, tg, chunk=chunk)
    z = _ref_logits(h, W)
    ref = F.cross_entropy(z, tg, reduction="none")
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(ce, ref.detach())
    assert torch.equal(pred, z.argmax(-1))
    (gh,) = torch.autograd.grad((w * loss).sum(), h)
    (want,) = torch.autograd.grad((w * ref).sum(), h)
    torch.testing.assert_close(gh, want)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_row_kl_and_its_gradient_match_autograd(temperature):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(17, 8, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(17, 8, generator=g, dtype=torch.float64)
    W = torch.randn(30, 8, generator=g, dtype=torch.float64)
    tg = torch.randint(0, 30, (17,), generator=g)
    w = torch.rand(17, generator=g, dtype=torch.float64)
    loss, ce, _ = row_losses(h, W, tg, teacher=t, temperature=temperature, chunk=5)
    lpd = torch.log_softmax(_ref_logits(h, W) / temperature, -1)
    lpt = torch.log_softmax(_ref_logits(t, W) / temperature, -1)
    ref = F.kl_div(lpd, lpt, log_target=True, reduction="none").sum(-1)  # KL(p_t || p_d) per row
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(ce, F.cross_entropy(_ref_logits(h, W), tg, reduction="none").detach())
    (gh,) = torch.autograd.grad((w * loss).sum(), h)
    (want,) = torch.autograd.grad((w * ref).sum(), h)
    torch.testing.assert_close(gh, want)
    same, _, _ = row_losses(t, W, tg, teacher=t, temperature=temperature)
    assert same.abs().max().item() < 1e-12


# ----------------------------------------------------------------------------- the DFlash loss
B = 4
SPEC = AnchorSpec(seed=5, max_anchors=5, policy="cap", block_size=B)


@pytest.fixture(scope="module")
def parts():
    from transformers import AutoConfig

    path = tiny_target()
    target = FrozenTarget(path, [0, 2], device=torch.device("cpu"))
    torch.manual_seed(0)
    dcfg = DrafterConfig.from_target_config(AutoConfig.from_pretrained(path), 2, B, MASK_ID, target_layer_ids=[0, 2])
    ds = FakeDataset(n=12, lo=8, hi=20, seed=4)
    mb = FakeMB(0, 0, 0, 0, np.array([0, 3, 7], np.int64), 0, 0, 0)
    return target, Drafter(dcfg), ds, mb


def _drafter_rows(target, drafter, b):
    feats = target.features(b.input_ids, b.position_ids, b.cu_seqlens, b.max_seqlen)
    hid = drafter(target.embed_tokens(b.noise_ids), feats, b.position_ids, b.blk_pos, b.cu_seqlens, b.cu_blk,
                  b.anchors, B)
    return hid @ target.lm_head.weight.T  # (Q, V)


def test_dpace_loss_and_gradient_match_the_definition(parts):
    target, drafter, ds, mb = parts
    b = build_dflash_batch(ds, mb, epoch=0, spec=SPEC, gamma=None, mask_token_id=MASK_ID, vocab_size=300)
    assert torch.equal(b.weights.view(-1, B)[:, 0], torch.zeros(b.n_anchors))  # the loss mask, slot 0 off
    assert set(b.weights.unique().tolist()) <= {0.0, 1.0}
    loss, stats = dflash_loss(drafter, target, b, block_size=B, ce_chunk=7, autocast=contextlib.nullcontext,
                              spec=LossSpec(slot_weights="dpace", dpace_alpha=0.5))
    g = torch.autograd.grad(loss, drafter.fc.weight)[0]
    ce = F.cross_entropy(_drafter_rows(target, drafter, b), b.targets, reduction="none")  # (Q,)
    w = dpace_weights(ce.view(-1, B), b.weights.view(-1, B), 0.5).view(-1)
    ref = (w * ce).sum()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert stats[-1].item() == pytest.approx(w.double().sum().item(), rel=1e-6)  # the deferred normaliser
    torch.testing.assert_close(g, torch.autograd.grad(ref, drafter.fc.weight)[0], rtol=1e-4, atol=1e-6)


def test_kl_loss_teaches_the_targets_next_token_distribution(parts):
    """Slot r of block j learns the target's distribution at a_j + r - 1 of its own document (a
    plain forward over each document alone), weighted by the decay weights."""
    from transformers import AutoModelForCausalLM

    target, drafter, ds, mb = parts
    gamma = 1.5
    b = build_dflash_batch(ds, mb, epoch=0, spec=SPEC, gamma=gamma, mask_token_id=MASK_ID, vocab_size=300)
    loss, stats = dflash_loss(drafter, target, b, block_size=B, ce_chunk=5, autocast=contextlib.nullcontext,
                              spec=LossSpec(loss="kl", kl_temperature=2.0))
    ref_lm = AutoModelForCausalLM.from_pretrained(tiny_target(), attn_implementation="sdpa").eval()
    cu, cb = b.cu_seqlens.tolist(), b.cu_blk.tolist()
    teacher = torch.zeros(b.n_anchors * B, 300)
    with torch.no_grad():
        for d in range(len(cu) - 1):
            logits = ref_lm(b.input_ids[cu[d]:cu[d + 1]][None]).logits[0]                 # (S_d, V)
            rows = torch.arange(cb[d], cb[d + 1])
            teacher[rows] = logits[(b.blk_pos[rows] - 1).clamp(0, cu[d + 1] - cu[d] - 1)]
    lpd = torch.log_softmax(_drafter_rows(target, drafter, b) / 2.0, -1)
    lpt = torch.log_softmax(teacher / 2.0, -1)
    kl = F.kl_div(lpd, lpt, log_target=True, reduction="none").sum(-1)
    w = torch.from_numpy(np.tile(slot_weights(B, gamma), b.n_anchors)) * (b.weights > 0)
    ref = (w * kl).sum()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-4)
    assert stats[-1].item() == pytest.approx(b.weight_sum, rel=1e-6)
