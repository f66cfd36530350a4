"""DFlash objective pieces on a real tiny Qwen3 target: taps, anchors/blocks, packed == unpacked, chunked CE."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dflash_prep.objectives.anchors import sample_anchors
from dflash_prep.train.chunked_ce import weighted_ce
from dflash_prep.train.objectives.dflash.drafter import Drafter, DrafterConfig
from dflash_prep.train.objectives.dflash.objective import dflash_loss
from dflash_prep.train.objectives.dflash.batch import AnchorSpec, build_dflash_batch, default_gamma, slot_weights
from dflash_prep.train.target import FrozenTarget

from dflash_prep.tests.train.dflash_fixtures import MASK_ID, tiny_target
from dflash_prep.tests.train.train_fakes import FakeDataset, FakeMB

B = 4
SPEC = AnchorSpec(seed=5, max_anchors=5, policy="cap", block_size=B)


@pytest.fixture(scope="module")
def target():
    return FrozenTarget(tiny_target(), [0, 2], device=torch.device("cpu"))


def _mb(ids, step=0):
    return FakeMB(step, 0, 0, 0, np.asarray(ids, np.int64), 0, 0, 0)


def _batch(ds, ids, epoch=0):
    return build_dflash_batch(ds, _mb(ids), epoch=epoch, spec=SPEC, gamma=default_gamma(B), mask_token_id=MASK_ID,
                              vocab_size=300)


def test_taps_equal_the_models_hidden_states(target):
    """Packed taps == hidden_states[l+1] of a plain (sdpa) forward over each document alone, and the
    layers above the last tap never run."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    lens = [7, 12, 5]
    ids = torch.randint(4, 290, (sum(lens),))
    pos = torch.cat([torch.arange(n) for n in lens])
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    ran = []
    h = target.layers[3].register_forward_hook(lambda *a: ran.append(3))
    try:
        feats = target.features(ids, pos, cu, max(lens))
    finally:
        h.remove()
    assert feats.shape == (sum(lens), 2 * 64) and not feats.requires_grad
    assert ran == [], "layer 3 is above the last tap (2) and must not run"
    ref = AutoModelForCausalLM.from_pretrained(tiny_target(), attn_implementation="sdpa").eval()
    for d in range(3):
        s, e = int(cu[d]), int(cu[d + 1])
        with torch.no_grad():
            hs = ref(ids[None, s:e], output_hidden_states=True).hidden_states
        want = torch.cat([hs[1][0], hs[3][0]], dim=-1)
        err = (feats[s:e] - want).abs().max().item()
        assert err < 1e-5, f"document {d}: taps differ from hidden_states by {err:.3g}"


def test_anchors_are_eligible_and_batch_invariant():
    ds = FakeDataset(n=12)
    big = _batch(ds, [0, 3, 5, 7])
    alone = {s: _batch(ds, [s]) for s in (0, 3, 5, 7)}
    reordered = _batch(ds, [7, 5, 0, 3])
    offs = np.concatenate([[0], np.cumsum(np.diff(big.cu_blk.numpy()) // B)])
    g = default_gamma(B)
    for i, s in enumerate([0, 3, 5, 7]):
        ids, mask = ds._ids[s], ds._mask[s]
        anc = big.anchors.numpy()[offs[i]:offs[i + 1]]
        assert np.array_equal(anc, alone[s].anchors.numpy()), f"sample {s}: anchors depend on the batch"
        assert np.array_equal(anc, sample_anchors(mask, seed=5, epoch=0, sample_id=s, max_anchors=5))
        assert len(anc) == min(5, int((mask[:-1] * mask[1:]).sum()))
        assert np.all(mask[anc] == 1) and np.all(mask[anc + 1] == 1) and np.all(np.diff(anc) > 0)
        j = list(reordered.sample_ids).index(s)
        ro = np.concatenate([[0], np.cumsum(np.diff(reordered.cu_blk.numpy()) // B)])
        assert np.array_equal(anc, reordered.anchors.numpy()[ro[j]:ro[j + 1]])
        # blocks: [x[a], MASK x (B-1)] at a..a+B-1; slot r predicts x[a+r] with weight exp(-(r-1)/g) * lm[a+r]
        rows = slice(offs[i] * B, offs[i + 1] * B)
        noise = big.noise_ids.numpy()[rows].reshape(-1, B)
        tgt, w = big.targets.numpy()[rows].reshape(-1, B), big.weights.numpy()[rows].reshape(-1, B)
        assert np.array_equal(noise[:, 0], ids[anc]) and np.all(noise[:, 1:] == MASK_ID)
        assert np.array_equal(big.blk_pos.numpy()[rows].reshape(-1, B), anc[:, None] + np.arange(B))
        for j, a in enumerate(anc):
            for r in range(1, B):
                inside = a + r < len(ids)
                assert tgt[j, r] == (ids[a + r] if inside else 0)
                want = np.exp(-(r - 1) / g) * (mask[a + r] if inside else 0)
                assert w[j, r] == pytest.approx(want, rel=1e-6)
            assert w[j, 0] == 0
    assert big.weight_sum == pytest.approx(float(big.weights.double().sum()), rel=1e-12)
    assert _batch(ds, [3], epoch=1).anchors.tolist() != alone[3].anchors.tolist() or len(alone[3].anchors) < 2


def test_gamma_rule():
    assert default_gamma(16) == 7.0 and default_gamma(8) == 3.0 and default_gamma(2) == 0.5
    w = slot_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1 and w[15] == pytest.approx(np.exp(-2))


def _restrict(b, doc):
    """The same packed batch with loss weights only on document ``doc``'s blocks."""
    w = torch.zeros_like(b.weights)
    s, e = int(b.cu_blk[doc]), int(b.cu_blk[doc + 1])
    w[s:e] = b.weights[s:e]
    return type(b)(**{**b.__dict__, "weights": w, "weight_sum": float(w.double().sum())})


def test_packed_equals_unpacked_per_document(target):
    """Loss and drafter gradients of each document inside a packed batch == that document alone."""
    ds = FakeDataset(n=12)
    cfg = DrafterConfig.from_target_config(target.config, 2, B, MASK_ID, target_layer_ids=[0, 2])
    torch.manual_seed(0)
    drafter = Drafter(cfg)
    sids = [2, 6, 9]
    packed = _batch(ds, sids)

    def run(b):
        drafter.zero_grad(set_to_none=True)
        loss, stats = dflash_loss(drafter, target, b, block_size=B, ce_chunk=7, autocast=contextlib.nullcontext)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters()}, stats

    for d, s in enumerate(sids):
        lp, gp, _ = run(_restrict(packed, d))
        lu, gu, su = run(_batch(ds, [s]))
        assert float(lu) > 0 and su[1] == len(_batch(ds, [s]).anchors)
        assert torch.allclose(lp, lu, rtol=1e-5, atol=1e-6), f"doc {d}: loss {lp.item()} vs alone {lu.item()}"
        for n in gu:
            err = (gp[n] - gu[n]).abs().max().item()
            assert err <= 1e-5 * max(1.0, gu[n].abs().max().item()), f"doc {d} {n}: grad max |diff| {err:.3g}"


def test_chunked_ce_matches_full_cross_entropy():
    torch.manual_seed(0)
    h = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    W = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    t, w = torch.randint(0, 50, (37,)), torch.rand(37, dtype=torch.float64)
    loss, pred = weighted_ce(h, W, t, w, chunk=8)
    (2.5 * loss).backward()
    h2, W2 = h.detach().clone().requires_grad_(), W.detach().clone().requires_grad_()
    logits = h2 @ W2.T
    ref = (F.cross_entropy(logits, t, reduction="none") * w).sum()
    (2.5 * ref).backward()
    assert torch.allclose(loss, ref, rtol=1e-12) and torch.equal(pred, logits.argmax(-1))
    assert torch.allclose(h.grad, h2.grad, rtol=1e-10, atol=1e-12)
    assert torch.allclose(W.grad, W2.grad, rtol=1e-10, atol=1e-12)
    l1, _ = weighted_ce(h.detach().float(), W.detach().float(), t, w.float(), chunk=5)
    l2, _ = weighted_ce(h.detach().float(), W.detach().float(), t, w.float(), chunk=37)
    assert abs(l1.item() - l2.item()) < 1e-4


def test_anchor_options_come_from_a_dflash_manifest():
    """A `pack --objective dflash` header fixes B, cap, policy and seed; the batch's anchors are the
    ones dflash_anchors.microbatch_anchors regenerates from it; a contradicting flag is refused."""
    from types import SimpleNamespace

    from dflash_prep.errors import ConfigError
    from dflash_prep.objectives.anchors import SAMPLER_VERSION
    from dflash_prep.objectives.dflash_anchors import microbatch_anchors
    from dflash_prep.train.config import build as build_config
    from dflash_prep.train.objectives.dflash.batch import anchor_spec

    header = {"epoch": 2, "dflash": {"block_size": 4, "max_anchors": 3, "anchor_policy": "cap", "anchor_seed": 11,
                                     "sampler_version": SAMPLER_VERSION}}
    m = SimpleNamespace(header=header, epoch=2)
    spec, where = anchor_spec(build_config(objective="dflash", target="t"), m)
    assert spec == AnchorSpec(seed=11, max_anchors=3, policy="cap", block_size=4) and where == "the manifest"
    ds = FakeDataset(n=12)
    sids = [1, 4, 8]
    b = build_dflash_batch(ds, _mb(sids), epoch=2, spec=spec, gamma=1.0, mask_token_id=MASK_ID, vocab_size=300)
    mask = np.concatenate([ds._mask[s] for s in sids])
    cu = np.concatenate([[0], np.cumsum([len(ds._mask[s]) for s in sids])])
    pos, _ = microbatch_anchors(header, mask, cu, np.asarray(sids, np.int64))
    assert np.array_equal(b.anchors.numpy(), pos)
    with pytest.raises(ConfigError, match="--block-size 8 contradicts"):
        anchor_spec(build_config(objective="dflash", target="t", block_size=8), m)
    with pytest.raises(ConfigError, match="--anchor-seed 3 contradicts"):
        anchor_spec(build_config(objective="dflash", target="t", anchor_seed=3), m)
    bad = SimpleNamespace(header={"epoch": 0, "dflash": {**header["dflash"], "sampler_version": 0}}, epoch=0)
    with pytest.raises(ConfigError, match="sampler"):
        anchor_spec(build_config(objective="dflash", target="t"), bad)
    plain, where = anchor_spec(build_config(objective="dflash", target="t", seed=4), SimpleNamespace(header={}))
    assert plain == AnchorSpec(seed=4, max_anchors=512, policy="cap", block_size=16) and "--seed" in where
