"""The DFlash attention reference (the oracle and the CPU path), its dispatch and input checks. No Triton."""

from __future__ import annotations

import pytest
import torch

from dflash_prep.kernels.attention import attention_dflash, force_backend
from dflash_prep.kernels.dflash_reference import attention_dflash_reference
from dflash_prep.kernels.errors import AttentionConfigError, AttentionInputError

from dflash_prep.tests.kernels.dflash_helpers import dense_mask_dflash, make_dflash, naive_dflash, run_dflash

# an empty document, anchors at 0 and S-1, a repeated anchor, several lengths
DOCS = [(9, [0, 3, 8]), (5, []), (1, [0]), (12, [2, 2, 7, 11])]


@pytest.mark.parametrize("block_size,heads", [(4, (4, 1)), (8, (8, 2)), (3, (2, 2))])
def test_reference_matches_the_naive_loop_forward_and_backward(block_size, heads):
    args = make_dflash(DOCS, block_size, *heads, 16, torch.float64, seed=block_size)
    got = run_dflash(attention_dflash_reference, *args, block_size)
    want = run_dflash(naive_dflash, *args, block_size)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("window", [4, 5, 8, 12, 64])
def test_sliding_window_matches_the_public_rule_forward_and_backward(window):
    # windows below, inside and above the longest context (12 + B); B = 4 so W >= B
    args = make_dflash(DOCS, 4, 4, 2, 16, torch.float64, seed=window)
    got = run_dflash(attention_dflash_reference, *args, 4, window=window)
    want = run_dflash(naive_dflash, *args, 4, window=window)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    if window < 12:
        full = run_dflash(attention_dflash_reference, *args, 4)
        assert not torch.allclose(got[0], full[0])  # the window changed something


def test_sliding_window_rule_position_by_position():
    """W = 6, B = 4, anchor 9: slot r sees context [9 + r - 5, 9), i.e. 5, 4, 3, 2 positions."""
    from dflash_prep.kernels.inputs import window_start

    from .dflash_helpers import public_window_keep

    keep = public_window_keep(9, 4, 6)  # (B, a + B)
    assert keep[:, 9:].all()  # the own block: whole
    for r in range(4):
        seen = torch.nonzero(keep[r, :9]).flatten().tolist()
        assert seen == list(range(4 + r, 9)), (r, seen)
        assert int(window_start(torch.tensor(9), torch.tensor(r), 6)) == 4 + r
    assert int(window_start(torch.tensor(2), torch.tensor(3), 6)) == 0  # clipped at the document start
    assert int(window_start(torch.tensor(9), torch.tensor(3), 0)) == 0  # 0 = full


def test_window_smaller_than_the_block_is_refused():
    args = make_dflash([(6, [1, 5])], 4, 2, 1, 8, torch.float32)
    for bad, match in ((2, "smaller than block_size"), (-1, ">= 0"), (2.5, ">= 0")):
        with pytest.raises(AttentionConfigError, match=match):
            attention_dflash_reference(*args[:5], *args[6:], 4, window=bad)


def test_reference_matches_a_dense_mask_through_sdpa():
    args = make_dflash(DOCS, 4, 4, 2, 16, torch.float64, seed=1)
    q, k_ctx, v_ctx, k_blk, v_blk, _, cu_ctx, cu_blk, anchors = args
    torch.testing.assert_close(attention_dflash_reference(*args[:5], *args[6:], 4, scale=0.3),
                               dense_mask_dflash(q, k_ctx, v_ctx, k_blk, v_blk, cu_ctx, cu_blk, anchors, 4, scale=0.3))


def test_mask_semantics_what_a_block_sees():
    q, k_ctx, v_ctx, k_blk, v_blk, do, cu_ctx, cu_blk, anchors = make_dflash([(6, [2, 4]), (4, [1])], 2, 2, 2, 8,
                                                                              torch.float64)
    base = attention_dflash_reference(q, k_ctx, v_ctx, k_blk, v_blk, cu_ctx, cu_blk, anchors, 2)
    k2 = k_ctx.clone()
    k2[2] += 4.0  # context position 2 of doc 0: seen by block 1 (a=4) only, not by block 0 (a=2)
    moved = attention_dflash_reference(q, k2, v_ctx, k_blk, v_blk, cu_ctx, cu_blk, anchors, 2)
    torch.testing.assert_close(moved[0:2], base[0:2])
    assert not torch.allclose(moved[2:4], base[2:4])
    torch.testing.assert_close(moved[4:], base[4:])  # doc 1 never sees doc 0
    kb = k_blk.clone()
    kb[3] -= 3.0  # a draft key of block 1: seen by block 1's two rows only
    moved = attention_dflash_reference(q, k_ctx, v_ctx, kb, v_blk, cu_ctx, cu_blk, anchors, 2)
    torch.testing.assert_close(moved[[0, 1, 4, 5]], base[[0, 1, 4, 5]])
    assert not torch.allclose(moved[2], base[2]) and not torch.allclose(moved[3], base[3])


def test_no_blocks_at_all_and_gradients_stay_finite():
    q, k_ctx, v_ctx, k_blk, v_blk, do, cu_ctx, cu_blk, anchors = make_dflash([(7, []), (3, [])], 4, 2, 1, 8,
                                                                              torch.float32)
    o, *grads = run_dflash(attention_dflash_reference, q, k_ctx, v_ctx, k_blk, v_blk, do, cu_ctx, cu_blk, anchors, 4)
    assert o.shape == (0, 2, 8)
    assert all(g.abs().max() == 0 if g.numel() else True for g in grads)
    args = make_dflash([(5, [0, 0, 4])], 4, 2, 1, 8, torch.bfloat16)
    for t in run_dflash(attention_dflash_reference, *args, 4):
        assert torch.isfinite(t.float()).all()


def test_upcast_false_is_the_same_precision_implementation():
    args = make_dflash(DOCS, 4, 2, 1, 16, torch.bfloat16, seed=2)
    wide = attention_dflash_reference(*args[:5], *args[6:], 4)
    narrow = attention_dflash_reference(*args[:5], *args[6:], 4, upcast=False)
    exact = attention_dflash_reference(*(t.double() for t in args[:5]), *args[6:], 4)
    assert wide.dtype == narrow.dtype == torch.bfloat16
    assert (wide.double() - exact).abs().max() <= (narrow.double() - exact).abs().max()


def test_public_api_dispatches_to_the_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("DFLASH_ATTN_BACKEND", raising=False)
    args = make_dflash(DOCS, 4, 4, 2, 16, torch.float32)
    call = (*args[:5], *args[6:], 4)
    torch.testing.assert_close(attention_dflash(*call), attention_dflash_reference(*call))
    with force_backend("reference"):
        torch.testing.assert_close(attention_dflash(*call, scale=0.5), attention_dflash_reference(*call, scale=0.5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attention_dflash(*call).dtype == torch.bfloat16


def _call(**changes):
    q, k_ctx, v_ctx, k_blk, v_blk, _, cu_ctx, cu_blk, anchors = make_dflash([(6, [1, 5]), (3, [0])], 2, 2, 1, 8,
                                                                             torch.float32)
    kw = dict(q=q, k_ctx=k_ctx, v_ctx=v_ctx, k_blk=k_blk, v_blk=v_blk, cu_ctx=cu_ctx, cu_blk=cu_blk,
              anchors=anchors, block_size=2)
    kw.update(changes)
    return attention_dflash(**kw)


I32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731


@pytest.mark.parametrize("changes,err,match", [
    (dict(cu_ctx=I32([0, 6, 8])), AttentionInputError, "cu_ctx must start at 0 and end at 9"),
    (dict(cu_ctx=I32([0, 7, 6, 9])), AttentionConfigError, "docs\\+1 offsets"),
    (dict(cu_blk=I32([0, 3, 6])), AttentionInputError, "not a multiple of block_size=2"),
    (dict(cu_blk=I32([0, 6, 4])), AttentionInputError, "cu_blk must start at 0 and end at 6"),
    (dict(anchors=I32([5, 1, 0])), AttentionInputError, "anchors decrease within document 0"),
    (dict(anchors=I32([1, 6, 0])), AttentionInputError, r"anchors\[1\]=6 lies outside \[0, S_d=6\)"),
    (dict(anchors=I32([1, 5, -1])), AttentionInputError, "outside"),
    (dict(anchors=I32([1, 5])), AttentionConfigError, "one anchor per block"),
    (dict(anchors=torch.tensor([1, 5, 0])), AttentionConfigError, "anchors must be a 1-D int32"),
    (dict(block_size=4), AttentionConfigError, "not a multiple of block_size=4"),
    (dict(block_size=0), AttentionConfigError, "positive int"),
])
def test_bad_offsets_and_anchors(changes, err, match):
    with pytest.raises(err, match=match):
        _call(**changes)


def test_bad_shapes_and_dtypes():
    q, k_ctx, v_ctx, k_blk, v_blk, _, cu_ctx, cu_blk, anchors = make_dflash([(6, [1, 5])], 2, 4, 2, 8, torch.float32)
    with pytest.raises(AttentionConfigError, match="k_blk has dtype"):
        _call(k_blk=k_blk.half())
    with pytest.raises(AttentionConfigError, match="multiple of key/value heads"):
        attention_dflash(q[:, :3], k_ctx, v_ctx, k_blk, v_blk, cu_ctx, cu_blk, anchors, 2)
    with pytest.raises(AttentionConfigError, match="must match pairwise"):
        attention_dflash(q, k_ctx, v_ctx[:5], k_blk, v_blk, cu_ctx, cu_blk, anchors, 2)
    with pytest.raises(AttentionConfigError, match=r"\[tokens, heads, D\]"):
        attention_dflash(q[None], k_ctx, v_ctx, k_blk, v_blk, cu_ctx, cu_blk, anchors, 2)
    with pytest.raises(AttentionConfigError, match=r"\[sum N_d\*B, Hq, D\]"):
        attention_dflash(q, k_ctx[..., :4], v_ctx[..., :4], k_blk, v_blk, cu_ctx, cu_blk, anchors, 2)
