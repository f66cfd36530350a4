"""The PyTorch reference (the oracle), the backend dispatch, and input checks. No Triton."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_prep.kernels.attention import attention_padded, attention_varlen, force_backend
from dflash_prep.kernels.backend import requested_backend, resolve_backend
from dflash_prep.kernels.errors import AttentionConfigError, AttentionInputError
from dflash_prep.kernels.reference import attention_padded_reference, attention_varlen_reference

from dflash_prep.tests.kernels.helpers import make_padded, make_varlen, run


@pytest.mark.parametrize("causal", [True, False])
def test_reference_matches_torch_sdpa_per_document(causal):
    """An independent oracle for the oracle: SDPA on each document, GQA via enable_gqa."""
    q, k, v, _, cu, max_len = make_varlen([5, 1, 0, 12], 4, 2, 16, torch.float64)
    out = attention_varlen_reference(q, k, v, cu, max_len, causal=causal)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if e == s:
            continue
        qi, ki, vi = (t[s:e].transpose(0, 1) for t in (q, k, v))  # (H, n, D)
        want = F.scaled_dot_product_attention(qi, ki, vi, is_causal=causal, enable_gqa=True)
        torch.testing.assert_close(out[s:e], want.transpose(0, 1))


def test_padded_reference_equals_varlen_reference_and_has_clean_padding():
    q, k, v, do, lens = make_padded([6, 0, 9], 9, 4, 1, 16, torch.float64)
    o, dq, dk, dv = run(attention_padded_reference, q, k, v, do, lens)
    for t in (o, dq, dk, dv):
        assert not torch.isnan(t).any()
    assert o[1].abs().max() == 0 and dq[1].abs().max() == 0 and dk[1].abs().max() == 0
    assert o[0, :, 6:].abs().max() == 0 and dq[0, :, 6:].abs().max() == 0
    assert dk[0, :, 6:].abs().max() == 0 and dv[0, :, 6:].abs().max() == 0  # padded keys unseen
    # the same documents packed back to back
    rows = [(0, 6), (2, 9)]
    qv, kv, vv = (torch.cat([t[b, :, :n].transpose(0, 1) for b, n in rows]) for t in (q, k, v))
    cu = torch.tensor([0, 6, 15], dtype=torch.int32)
    ov = attention_varlen_reference(qv, kv, vv, cu, 9)
    torch.testing.assert_close(ov[:6], o[0, :, :6].transpose(0, 1))
    torch.testing.assert_close(ov[6:], o[2].transpose(0, 1))


def test_documents_do_not_see_each_other():
    q, k, v, _, cu, max_len = make_varlen([4, 4], 2, 2, 16, torch.float64)
    base = attention_varlen_reference(q, k, v, cu, max_len)
    k2, v2 = k.clone(), v.clone()
    k2[:4] += 5.0
    v2[:4] -= 3.0  # change document 0 only
    moved = attention_varlen_reference(q, k2, v2, cu, max_len)
    torch.testing.assert_close(moved[4:], base[4:])
    assert not torch.allclose(moved[:4], base[:4])


def test_auto_uses_reference_on_cpu_and_env_and_context_override(monkeypatch):
    monkeypatch.delenv("DFLASH_ATTN_BACKEND", raising=False)
    cpu = torch.device("cpu")
    assert resolve_backend(cpu) == "reference"
    assert resolve_backend(torch.device("cuda")) == "triton"
    monkeypatch.setenv("DFLASH_ATTN_BACKEND", "reference")
    assert resolve_backend(torch.device("cuda")) == "reference"
    with force_backend("triton"):
        assert requested_backend() == "triton"
        with force_backend("reference"):
            assert requested_backend() == "reference"
        assert requested_backend() == "triton"
    assert requested_backend() == "reference"
    monkeypatch.setenv("DFLASH_ATTN_BACKEND", "cudnn")
    with pytest.raises(AttentionConfigError, match="DFLASH_ATTN_BACKEND"):
        requested_backend()
    with pytest.raises(AttentionConfigError, match="unknown attention backend"):
        with force_backend("fast"):
            pass


def test_forcing_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with force_backend("triton"), pytest.raises(AttentionConfigError, match="TRITON_INTERPRET"):
        resolve_backend(torch.device("cpu"))


def test_public_api_runs_reference_by_default_on_cpu(monkeypatch):
    monkeypatch.delenv("DFLASH_ATTN_BACKEND", raising=False)
    q, k, v, do, cu, max_len = make_varlen([3, 5], 2, 1, 16, torch.float32)
    torch.testing.assert_close(attention_varlen(q, k, v, cu, max_len),
                               attention_varlen_reference(q, k, v, cu, max_len))
    qp, kp, vp, _, lens = make_padded([3, 2], 3, 2, 1, 16, torch.float32)
    torch.testing.assert_close(attention_padded(qp, kp, vp, lens), attention_padded_reference(qp, kp, vp, lens))


def test_scale_is_applied():
    q, k, v, _, cu, max_len = make_varlen([6], 2, 2, 16, torch.float64)
    torch.testing.assert_close(attention_varlen_reference(q, k, v, cu, max_len, scale=0.5),
                               attention_varlen_reference(q * 2.0, k, v, cu, max_len, scale=0.25))


@pytest.mark.parametrize("cu,max_len,err,match", [
    ([1, 4], 4, AttentionInputError, "start at 0"),
    ([0, 3], 4, AttentionInputError, "end at T=4"),
    ([0, 3, 2, 4], 4, AttentionInputError, "decreases at index 1"),
    ([0, 4], 3, AttentionInputError, "exceeds max_seqlen=3"),
])
def test_bad_cu_seqlens(cu, max_len, err, match):
    q, k, v, *_ = make_varlen([4], 2, 2, 16, torch.float32)
    with pytest.raises(err, match=match):
        attention_varlen(q, k, v, torch.tensor(cu, dtype=torch.int32), max_len)


def test_bad_shapes_and_types():
    q, k, v, _, cu, max_len = make_varlen([4], 4, 2, 16, torch.float32)
    with pytest.raises(AttentionConfigError, match="int32"):
        attention_varlen(q, k, v, cu.to(torch.int64), max_len)
    with pytest.raises(AttentionConfigError, match="multiple of key/value heads"):
        attention_varlen(q[:, :3], k, v, cu, max_len)
    with pytest.raises(AttentionConfigError, match="dtypes differ"):
        attention_varlen(q.half(), k, v, cu, max_len)
    with pytest.raises(AttentionConfigError, match=r"\[T, H, D\]"):
        attention_varlen(q[None], k, v, cu, max_len)
    qp, kp, vp, _, lens = make_padded([3], 3, 2, 2, 16, torch.float32)
    with pytest.raises(AttentionInputError, match=r"lengths must lie in \[0, L=3\]"):
        attention_padded(qp, kp, vp, torch.tensor([4], dtype=torch.int32))
    with pytest.raises(AttentionConfigError, match="shape \\[B\\]"):
        attention_padded(qp, kp, vp, torch.tensor([3, 3], dtype=torch.int32))


def test_autocast_casts_inputs_like_sdpa():
    q, k, v, _, cu, max_len = make_varlen([5, 3], 2, 1, 16, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = attention_varlen(q, k, v.to(torch.bfloat16), cu, max_len)  # mixed dtypes are fine here
    assert o.dtype == torch.bfloat16
    want = attention_varlen_reference(*(t.to(torch.bfloat16) for t in (q, k, v)), cu, max_len)
    torch.testing.assert_close(o, want)
    with pytest.raises(AttentionConfigError, match="dtypes differ"):  # outside autocast they are not
        attention_varlen(q, k, v.to(torch.bfloat16), cu, max_len)


@pytest.mark.parametrize("lens", [[1, 17, 63, 130], [0, 5, 5, 0, 40, 3], [256]])
@pytest.mark.parametrize("causal", [True, False])
def test_grouped_varlen_equals_the_per_document_oracle(lens, causal):
    from dflash_prep.kernels.reference import attention_varlen_grouped

    q, k, v, do, cu, max_len = make_varlen(lens, 4, 2, 16, torch.float64)
    outs, grads = [], []
    for fn in (attention_varlen_reference, attention_varlen_grouped):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o = fn(qq, kk, vv, cu, max_len, causal=causal)
        o.backward(do)
        outs.append(o)
        grads.append((qq.grad, kk.grad, vv.grad))
    torch.testing.assert_close(outs[1], outs[0])
    for g1, g0 in zip(grads[1], grads[0]):
        torch.testing.assert_close(g1, g0)
