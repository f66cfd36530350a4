"""Triton DFlash attention (under TRITON_INTERPRET=1) against the fp32 PyTorch reference.

Each case checks the forward and all five gradients with FlashAttention's rule: the error
against an fp32 reference is at most 2x that of a same-precision PyTorch implementation.
Together the default cases cover issue 15's list: documents without anchors, anchors at 0
and S-1, anchors and blocks crossing key/query tile borders, B in {4, 8, 16}, GQA (4,1) and
(8,2), several documents of different lengths, D in {32, 64, 128}, fp32/fp16/bf16.
"""

from __future__ import annotations

import math

import pytest
import torch

from dflash_prep.kernels.attention import attention_dflash, force_backend
from dflash_prep.kernels.dflash_reference import attention_dflash_reference
from dflash_prep.kernels.errors import AttentionConfigError

from dflash_prep.tests.kernels.dflash_helpers import NAMES, make_dflash, run_dflash
from dflash_prep.tests.kernels.helpers import close_to_reference


def _check(docs, block_size, hq, hkv, d, dtype, seed=0, window=0):
    args = make_dflash(docs, block_size, hq, hkv, d, dtype, seed=seed)
    with force_backend("triton"):
        got = run_dflash(attention_dflash, *args, block_size, window=window)
    wide = [t.float() if t.is_floating_point() else t for t in args]
    ref = run_dflash(attention_dflash_reference, *wide, block_size, window=window)
    same = run_dflash(attention_dflash_reference, *args, block_size, upcast=False, window=window)
    for name, g, r, s in zip(NAMES, got, ref, same):
        assert g.dtype == dtype and g.shape == s.shape, name
        assert torch.isfinite(g.float()).all(), name
        close_to_reference(f"dflash {docs} B={block_size} ({hq},{hkv}) D={d} {dtype} W={window} {name}", g, r, s)
    return got


# Under the interpreter fwd/dQ tile 16 query rows x 8 keys, dK/dV_ctx 16 context keys x 16 rows
# and dK/dV_blk 16 own-block keys x 8 rows: the anchors below fall inside key tiles, on tile
# borders (8, 16, 32), at 0 and at S-1, and the row ranges of dK/dV_ctx start mid-tile.
def test_mixed_documents_empty_doc_anchor_0_and_last_gqa_8_2_bf16_b4():
    docs = [(40, [0, 1, 8, 16, 23, 39]), (17, []), (3, [2]), (70, [5, 5, 31, 32, 33, 64, 69])]
    _check(docs, 4, 8, 2, 32, torch.bfloat16)


def test_b8_gqa_4_1_fp16_d64_blocks_across_tiles():
    # 5 blocks of 8 rows = 40 rows: the last query tile is partial; anchors cross key tiles
    _check([(50, [3, 9, 17, 30, 49]), (9, [0, 8])], 8, 4, 1, 64, torch.float16)


def test_b16_mha_fp32_d32_one_block_per_query_tile():
    _check([(24, [0, 23]), (0, []), (60, [15, 16, 47])], 16, 2, 2, 32, torch.float32)


def test_d128_bf16_b4_gqa_4_1():
    _check([(20, [2, 7, 11, 19])], 4, 4, 1, 128, torch.bfloat16)


# Sliding windows: below the context (the first key tiles of late query tiles are skipped and the
# masked band crosses key tiles), W = B (slot B-1 sees no context at all: a fully masked context
# row), and W equal to the longest context + B (nothing cut, the same as full attention).
@pytest.mark.parametrize("window", [4, 11, 24, 70 + 4])
def test_sliding_window_bf16_b4_gqa(window):
    docs = [(40, [0, 1, 8, 16, 23, 39]), (17, []), (3, [2]), (70, [5, 5, 31, 32, 33, 64, 69])]
    got = _check(docs, 4, 4, 2, 32, torch.bfloat16, window=window)
    if window == 74:
        with force_backend("triton"):
            full = run_dflash(attention_dflash, *make_dflash(docs, 4, 4, 2, 32, torch.bfloat16), 4)
        for name, a, b in zip(NAMES, got, full):
            assert torch.equal(a, b), name


def test_sliding_window_b8_fp32_wide_tiles(monkeypatch):
    from dflash_prep.kernels import dflash

    monkeypatch.setattr(dflash, "INTERPRET_BLOCKS", {"fwd": (16, 32, 4, 1), "dq": (16, 32, 4, 1),
                                                     "dkdv_blk": (16, 32, 4, 1), "dkdv_ctx": (64, 16, 4, 1)})
    _check([(100, [3, 9, 40, 41, 77, 99]), (9, [0, 8])], 8, 2, 1, 32, torch.float32, seed=2, window=16)


def test_sliding_window_skips_the_key_tiles_outside_every_window():
    """Context keys no window reaches are never loaded, not just masked: NaN there (which a
    masked load-and-multiply would spread, 0 * NaN) leaves every output and gradient finite
    and equal to the clean run. Block at 60, W = 8: rows see [53, 64); fwd/dq key tiles of 8
    start at 48, dK/dV_ctx tiles of 16 below 48 find no block."""
    args = list(make_dflash([(64, [60]), (20, [3, 19])], 4, 2, 1, 32, torch.float32, seed=5))
    with force_backend("triton"):
        clean = run_dflash(attention_dflash, *args, 4, window=8)
        for i in (1, 2):  # k_ctx, v_ctx
            args[i] = args[i].clone()
            args[i][:48] = float("nan")
        dirty = run_dflash(attention_dflash, *args, 4, window=8)
    for name, a, b in zip(NAMES, clean, dirty):
        if name in ("dk_ctx", "dv_ctx"):
            assert torch.equal(b[:48], torch.zeros_like(b[:48])), name
        assert torch.equal(a, b), name


def test_only_empty_documents():
    args = make_dflash([(5, []), (0, []), (7, [])], 4, 2, 1, 32, torch.float32)
    with force_backend("triton"):
        o, *grads = run_dflash(attention_dflash, *args, 4)
    assert o.shape == (0, 2, 32)
    assert all(g.numel() == 0 or g.abs().max() == 0 for g in grads)  # context nobody sees: exactly 0


@pytest.mark.parametrize("blocks", [
    # query tiles of 8 blocks, own-block key tiles of 2 blocks queried 4 rows at a time
    {"fwd": (32, 16, 4, 1), "dq": (32, 16, 4, 1), "dkdv_blk": (4, 8, 4, 1), "dkdv_ctx": (32, 8, 4, 1)},
    # key tiles wider than the query tiles and than most anchor gaps
    {"fwd": (16, 32, 4, 1), "dq": (16, 32, 4, 1), "dkdv_blk": (16, 32, 4, 1), "dkdv_ctx": (64, 16, 4, 1)},
])
def test_other_tile_shapes(monkeypatch, blocks):
    from dflash_prep.kernels import dflash

    monkeypatch.setattr(dflash, "INTERPRET_BLOCKS", blocks)
    _check([(45, [0, 7, 8, 20, 21, 22, 44]), (12, [11]), (30, [3, 15, 29])], 4, 4, 2, 32, torch.float32, seed=4)


def test_bitwise_deterministic_across_runs():
    args = make_dflash([(30, [0, 9, 16, 29]), (11, [4, 10])], 4, 4, 2, 32, torch.bfloat16, seed=3)
    with force_backend("triton"):
        first = run_dflash(attention_dflash, *args, 4)
        second = run_dflash(attention_dflash, *args, 4)
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), f"{name} differs between two identical runs"


def test_lse_is_the_natural_log_sum_exp_over_what_each_row_sees():
    from dflash_prep.kernels import dflash
    from dflash_prep.kernels.inputs import check_dflash

    q, k_ctx, v_ctx, k_blk, v_blk, _, cu_ctx, cu_blk, anchors = make_dflash([(13, [0, 5, 12])], 4, 2, 1, 32,
                                                                             torch.float32, seed=1)
    prob = check_dflash(q, k_ctx, v_ctx, k_blk, v_blk, cu_ctx, cu_blk, anchors, 4, None)
    _, lse = dflash.flash_dflash(q, k_ctx, v_ctx, k_blk, v_blk, cu_ctx, cu_blk, anchors, prob, return_lse=True)
    for row in range(q.shape[0]):
        j, a = row // 4, int(anchors[row // 4])
        keys = torch.cat([k_ctx[:a, 0], k_blk[4 * j:4 * j + 4, 0]])  # (a + B, D)
        want = torch.logsumexp(q[row] @ keys.T / math.sqrt(32), dim=-1)  # (Hq,)
        torch.testing.assert_close(lse[:, row], want, rtol=1e-5, atol=1e-5)


def test_triton_path_refuses_what_it_does_not_support():
    args = make_dflash([(9, [1, 8])], 3, 2, 1, 32, torch.float32)
    with force_backend("triton"), pytest.raises(AttentionConfigError, match="power of two"):
        attention_dflash(*args[:5], *args[6:], 3)
    args = make_dflash([(9, [1, 8])], 4, 2, 1, 24, torch.float32)
    with force_backend("triton"), pytest.raises(AttentionConfigError, match="head dims"):
        attention_dflash(*args[:5], *args[6:], 4)
    args = make_dflash([(9, [1, 8])], 4, 2, 1, 32, torch.float64)
    with force_backend("triton"), pytest.raises(AttentionConfigError, match="float16, bfloat16 or float32"):
        attention_dflash(*args[:5], *args[6:], 4)


def _random_docs(seed: int, n_docs: int, max_ctx: int, max_blocks: int):
    g = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(n_docs):
        s = int(torch.randint(1, max_ctx + 1, (1,), generator=g))
        n = int(torch.randint(0, min(s, max_blocks) + 1, (1,), generator=g))
        docs.append((s, sorted(torch.randperm(s, generator=g)[:n].tolist())))
    return docs


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [4, 8, 16])
@pytest.mark.parametrize("heads", [(2, 2), (4, 1), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [32, 64, 128])
def test_sweep_random_documents(block_size, heads, dtype, d):
    seed = block_size * 1000 + heads[0] * 100 + d + {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[dtype]
    _check(_random_docs(seed, 3, 80, 64 // block_size), block_size, *heads, d, dtype, seed=seed)


def test_grids_over_cudas_limit_are_refused_with_a_fix():
    from dflash_prep.kernels import dflash

    assert dflash._grid(8, 1000, 16, 3) == (8, 63 + 3)
    with pytest.raises(AttentionConfigError, match="split the batch"):
        dflash._grid(8, 16 * 65535, 16, 1)
