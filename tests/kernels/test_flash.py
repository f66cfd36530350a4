"""Triton kernels (under TRITON_INTERPRET=1) against the fp32 PyTorch reference.

Each case checks the forward and all three gradients with FlashAttention's rule (error at
most 2x a same-precision PyTorch implementation's). The default cases form a minimal
matrix that still covers every item of issue 5's list; the cartesian sweep is ``slow``.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from dflash_prep.kernels.attention import attention_padded, attention_varlen, force_backend
from dflash_prep.kernels.errors import AttentionConfigError

from dflash_prep.tests.kernels.helpers import close_to_reference, make_padded, make_varlen, reference_pair, run

NAMES = ("o", "dq", "dk", "dv")


def _check_varlen(doc_lens, hq, hkv, d, dtype, causal=True):
    q, k, v, do, cu, max_len = make_varlen(doc_lens, hq, hkv, d, dtype)
    with force_backend("triton"):
        got = run(attention_varlen, q, k, v, do, cu, max_len, causal=causal)
    f32, same = reference_pair("varlen", q, k, v, do, (cu, max_len), causal)
    for name, g, r, s in zip(NAMES, got, f32, same):
        assert g.dtype == dtype
        close_to_reference(f"varlen {doc_lens} {name}", g, r, s)
    return got


def _check_padded(lengths, seq, hq, hkv, d, dtype, causal=True, transposed=False):
    q, k, v, do, lens = make_padded(lengths, seq, hq, hkv, d, dtype, transposed=transposed)
    with force_backend("triton"):
        got = run(attention_padded, q, k, v, do, lens, causal=causal)
    f32, same = reference_pair("padded", q, k, v, do, (lens,), causal)
    for name, g, r, s in zip(NAMES, got, f32, same):
        close_to_reference(f"padded {lengths} {name}", g, r, s)
    for b, n in enumerate(lengths):  # padding is exactly zero: outputs and all gradients
        for name, t in zip(NAMES, got):
            pad = t[b, :, n:]
            assert pad.numel() == 0 or pad.abs().max().item() == 0, f"{name}: row {b} is not zero past length {n}"
    return got


# Minimal matrix: every length (1, 17, 63, 130, 256), zero-length and length-1 documents,
# a document boundary inside a tile (17 | 0 | 1 | 63 ...), fully padded rows (length 0),
# every (Hq, Hkv) in {(2,2), (4,1), (8,2)}, every D in {32, 64, 128}, fp32/fp16/bf16.
def test_varlen_mixed_docs_gqa_8_2_bf16_d64():
    _check_varlen([17, 0, 1, 63, 130], 8, 2, 64, torch.bfloat16)


def test_padded_256_and_fully_padded_row_gqa_4_1_fp32_d32_strided():
    _check_padded([256, 0, 63], 256, 4, 1, 32, torch.float32, transposed=True)


def test_varlen_mha_2_2_fp16_d128():
    _check_varlen([130, 40], 2, 2, 128, torch.float16)


def test_padded_non_causal_bf16_d64():
    _check_padded([17, 1, 24], 24, 2, 2, 64, torch.bfloat16, causal=False)


def test_varlen_non_causal_fp32_gqa():
    _check_varlen([5, 0, 33], 4, 1, 32, torch.float32, causal=False)


@pytest.mark.parametrize("blocks", [
    {"fwd": (16, 16), "dkdv": (16, 16), "dq": (16, 16)},  # square tiles: diagonal band = one tile
    {"fwd": (64, 32), "dkdv": (32, 64), "dq": (64, 32)},  # a tile wider than most documents
])
def test_other_tile_shapes(monkeypatch, blocks):
    from dflash_prep.kernels import flash

    monkeypatch.setattr(flash, "INTERPRET_BLOCKS", blocks)
    _check_varlen([17, 0, 1, 40], 4, 1, 32, torch.float32)


def test_bitwise_deterministic_across_runs():
    q, k, v, do, cu, max_len = make_varlen([40, 1, 23], 4, 2, 32, torch.bfloat16, seed=3)
    with force_backend("triton"):
        first = run(attention_varlen, q, k, v, do, cu, max_len)
        second = run(attention_varlen, q, k, v, do, cu, max_len)
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), f"{name} differs between two identical runs"


def test_lse_is_saved_in_natural_log_units():
    from dflash_prep.kernels import flash
    from dflash_prep.kernels.inputs import check_varlen

    q, k, v, _, cu, max_len = make_varlen([9, 30], 2, 1, 32, torch.float32, seed=1)
    prob = check_varlen(q, k, v, cu, max_len, None)
    _, lse = flash.flash_varlen(q, k, v, cu, prob, causal=True, return_lse=True)  # (Hq, T)
    for s, e in ((0, 9), (9, 39)):
        qi, ki = q[s:e].transpose(0, 1), k[s:e].transpose(0, 1).repeat_interleave(2, 0)
        scores = (qi @ ki.transpose(1, 2)) / math.sqrt(32)
        scores = scores.masked_fill(~torch.ones(e - s, e - s, dtype=torch.bool).tril(), float("-inf"))
        torch.testing.assert_close(lse[:, s:e], torch.logsumexp(scores, -1), rtol=1e-5, atol=1e-5)


def test_varlen_equals_padded_on_same_documents():
    docs = [33, 7]
    q, k, v, _, cu, max_len = make_varlen(docs, 2, 2, 32, torch.float32, seed=5)
    qp, kp, vp = (torch.zeros(2, t.shape[1], max_len, 32) for t in (q, k, v))
    for b, (s, e) in enumerate(((0, 33), (33, 40))):
        qp[b, :, : e - s], kp[b, :, : e - s], vp[b, :, : e - s] = (t[s:e].transpose(0, 1) for t in (q, k, v))
    with force_backend("triton"):
        ov = attention_varlen(q, k, v, cu, max_len)
        op = attention_padded(qp, kp, vp, torch.tensor(docs, dtype=torch.int32))
    torch.testing.assert_close(ov[:33], op[0].transpose(0, 1))
    torch.testing.assert_close(ov[33:], op[1, :, :7].transpose(0, 1))


def test_unsupported_head_dim_is_a_clear_error():
    q, k, v, _, cu, max_len = make_varlen([8], 2, 2, 48, torch.float32)
    with force_backend("triton"), pytest.raises(AttentionConfigError, match="head dims"):
        attention_varlen(q, k, v, cu, max_len)


def test_empty_batch():
    q, k, v, do, cu, _ = make_varlen([0, 0], 2, 1, 32, torch.float32)
    with force_backend("triton"):
        o, dq, dk, dv = run(attention_varlen, q, k, v, do, cu, 0)
    assert o.shape == (0, 2, 32) and dk.shape == (0, 1, 32)


SWEEP = list(itertools.product(
    ["varlen", "padded"], [(2, 2), (4, 1), (8, 2)], [32, 64, 128],
    [torch.float32, torch.float16, torch.bfloat16], [True, False],
))


@pytest.mark.slow
@pytest.mark.parametrize("layout,heads,d,dtype,causal", SWEEP)
def test_sweep(layout, heads, d, dtype, causal):
    if layout == "varlen":
        _check_varlen([1, 17, 0, 63, 130], *heads, d, dtype, causal)
    else:
        _check_padded([130, 0, 1, 17], 130, *heads, d, dtype, causal)


@pytest.mark.slow
def test_varlen_256():
    _check_varlen([256], 2, 2, 64, torch.bfloat16)
