"""Shared builders and the FlashAttention-style accuracy check for the kernel tests."""

from __future__ import annotations

import torch

from dflash_prep.kernels.reference import attention_padded_reference, attention_varlen_reference

# A floor on the allowed error, relative to the reference's magnitude, for outputs whose
# same-precision PyTorch error is (close to) zero, e.g. fp32 against fp32.
FLOOR = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-3}


def close_to_reference(name: str, got: torch.Tensor, ref: torch.Tensor, same: torch.Tensor, factor: float = 2.0) -> None:
    """FlashAttention's rule: |got - ref| <= factor * |same - ref| (+ a tiny floor), in max norm.

    ``ref`` is computed in fp32 from the same (rounded) inputs; ``same`` is a PyTorch
    implementation in the input precision. The failure message shows the numbers.
    """
    got, ref, same = got.float(), ref.float(), same.float()
    if torch.isnan(got).any():
        raise AssertionError(f"{name}: NaN in the output")
    err = (got - ref).abs()
    err_same = (same - ref).abs().max().item()
    floor = FLOOR[same.dtype if same.dtype in FLOOR else torch.float32] * max(1.0, ref.abs().max().item())
    bound = factor * err_same + floor
    assert err.max().item() <= bound, (
        f"{name}: max |err| {err.max().item():.3e} (mean {err.mean().item():.3e}) > bound {bound:.3e} "
        f"= {factor} x same-precision error {err_same:.3e} + floor {floor:.1e}"
    )


def make_varlen(doc_lens, hq, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = int(sum(doc_lens))
    cu = torch.zeros(len(doc_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(doc_lens, dtype=torch.int64), 0).to(torch.int32)
    q = torch.randn(total, hq, d, generator=g).to(dtype)
    k = torch.randn(total, hkv, d, generator=g).to(dtype)
    v = torch.randn(total, hkv, d, generator=g).to(dtype)
    do = torch.randn(total, hq, d, generator=g).to(dtype)
    return q, k, v, do, cu, max(doc_lens, default=0)


def make_padded(lengths, seq, hq, hkv, d, dtype, seed=0, transposed=False):
    """Padded inputs [B,H,L,D]; ``transposed`` builds them as views of [B,L,H,D] (strided)."""
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)

    def rnd(h):
        if transposed:
            return torch.randn(b, seq, h, d, generator=g).to(dtype).transpose(1, 2)  # (B, H, L, D) view
        return torch.randn(b, h, seq, d, generator=g).to(dtype)

    q, k, v, do = rnd(hq), rnd(hkv), rnd(hkv), rnd(hq)
    return q, k, v, do, torch.tensor(lengths, dtype=torch.int32)


def run(fn, q, k, v, do, *args, **kwargs):
    """Output and (dq, dk, dv) of ``fn`` for upstream gradient ``do``."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = fn(q, k, v, *args, **kwargs)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    return o.detach(), dq, dk, dv


def reference_pair(layout, q, k, v, do, meta, causal):
    """(fp32 reference, same-precision reference) results, each (o, dq, dk, dv)."""
    fn = attention_varlen_reference if layout == "varlen" else attention_padded_reference
    f32 = run(fn, q.float(), k.float(), v.float(), do.float(), *meta, causal=causal)
    same = run(fn, q, k, v, do, *meta, causal=causal, upcast=False)
    return f32, same
