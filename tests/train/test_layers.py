"""The shared model parts (train/layers.py) against their formulas, computed by hand element by element."""

import math

import pytest
import torch

from dflash_prep.train.layers import RMSNorm, SwiGLU, apply_rope, rope_tables


def _rms_by_hand(row, weight, eps):
    rms = math.sqrt(sum(v * v for v in row) / len(row) + eps)
    return [w * v / rms for v, w in zip(row, weight)]


@pytest.mark.parametrize("cast_before_gain", [False, True])
def test_rmsnorm_is_the_formula(cast_before_gain):
    x = torch.tensor([[3.0, 4.0, 0.0, -1.0], [0.5, -0.25, 2.0, 1.0]], dtype=torch.float64)
    norm = RMSNorm(4, eps=1e-3, cast_before_gain=cast_before_gain).double()
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([2.0, 0.5, 1.0, -3.0]))
    got = norm(x)
    want = [_rms_by_hand(row, [2.0, 0.5, 1.0, -3.0], 1e-3) for row in x.tolist()]
    # [3, 4, 0, -1]: mean square 26/4 = 6.5, so row 0 is weight * x / sqrt(6.501)
    assert want[0][0] == pytest.approx(2.0 * 3.0 / math.sqrt(6.501), rel=1e-15)
    # normalised in fp32 (a float64 input is rounded to fp32 first), so compare at fp32 precision
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=0), (got, want)


def test_rmsnorm_rounding_orders_under_bf16():
    """Gain in fp32 then one cast (decoder) vs cast then gain in the promoted dtype (HF / drafter)."""
    torch.manual_seed(0)
    x = torch.randn(3, 8).to(torch.bfloat16)
    w = torch.randn(8)
    y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)  # fp32
    dec, hf = RMSNorm(8, 1e-6), RMSNorm(8, 1e-6, cast_before_gain=True)
    with torch.no_grad():
        dec.weight.copy_(w)
        hf.weight.copy_(w)
    got_dec, got_hf = dec(x), hf(x)
    assert got_dec.dtype == torch.bfloat16 and torch.equal(got_dec, (y * w).to(torch.bfloat16))
    assert got_hf.dtype == torch.float32 and torch.equal(got_hf, w * y.to(torch.bfloat16).float())
    assert not torch.equal(got_dec.float(), got_hf)  # the two orders are different numerics


def test_rope_tables_are_the_formula():
    pos = torch.tensor([0, 1, 7, 300])
    cos, sin = rope_tables(pos, head_dim=6, theta=1000.0)
    assert cos.shape == sin.shape == (4, 3) and cos.dtype == torch.float32
    for r, p in enumerate(pos.tolist()):
        for i in range(3):
            ang = p * 1000.0 ** (-2 * i / 6)  # frequencies 1, 0.1, 0.01
            tol = 2e-7 + abs(ang) * 2.0 ** -22  # the angle is an fp32 product: |ang| * 2^-23 off, and cos/sin 2^-24
            assert cos[r, i].item() == pytest.approx(math.cos(ang), abs=tol)
            assert sin[r, i].item() == pytest.approx(math.sin(ang), abs=tol)
    cos_bf, _ = rope_tables(pos, head_dim=6, theta=1000.0, dtype=torch.bfloat16)
    assert cos_bf.dtype == torch.bfloat16 and torch.equal(cos_bf, cos.to(torch.bfloat16))


@pytest.mark.parametrize("fp32", [False, True])
def test_apply_rope_rotates_the_halves(fp32):
    """x (T=2, H=1, D=4): the pairs are (x0, x2) at frequency 1 and (x1, x3) at 1/theta^(1/2)."""
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]], [[-0.5, 0.25, 2.0, -1.0]]], dtype=torch.float64)
    pos = torch.tensor([3, 11])
    cos, sin = rope_tables(pos, head_dim=4, theta=100.0, dtype=torch.float64)
    got = apply_rope(x, cos, sin, fp32=fp32)
    assert got.dtype == torch.float64
    for t, p in enumerate(pos.tolist()):
        a, b, c, d = x[t, 0].tolist()
        f0, f1 = p * 1.0, p * 0.1
        want = [a * math.cos(f0) - c * math.sin(f0), b * math.cos(f1) - d * math.sin(f1),
                a * math.sin(f0) + c * math.cos(f0), b * math.sin(f1) + d * math.cos(f1)]
        tol = 1e-5 if fp32 else 1e-6  # fp32: rotated in fp32; else the tables' fp32 angles set it
        assert got[t, 0].tolist() == pytest.approx(want, abs=tol)


def test_apply_rope_is_hf_rotate_half_to_the_bit_and_relative():
    torch.manual_seed(1)
    q = torch.randn(5, 2, 8).to(torch.bfloat16)  # (T, H, D)
    cos, sin = rope_tables(torch.arange(5), 8, 10000.0, dtype=torch.bfloat16)  # (T, D/2)
    rot_half = torch.cat((-q[..., 4:], q[..., :4]), dim=-1)
    hf = q * torch.cat((cos, cos), -1)[:, None] + rot_half * torch.cat((sin, sin), -1)[:, None]
    assert torch.equal(apply_rope(q, cos, sin), hf)
    # rotation: <R(m) q, R(n) k> depends on m - n only
    qd, kd = torch.randn(1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 8, dtype=torch.float64)

    def score(m, n):
        cm, sm = rope_tables(torch.tensor([m]), 8, 10000.0, dtype=torch.float64)
        cn, sn = rope_tables(torch.tensor([n]), 8, 10000.0, dtype=torch.float64)
        return (apply_rope(qd, cm, sm) * apply_rope(kd, cn, sn)).sum().item()

    assert score(9, 4) == pytest.approx(score(5, 0), abs=1e-5)
    assert score(9, 4) != pytest.approx(score(9, 3), abs=1e-5)


def test_swiglu_names_and_formula():
    torch.manual_seed(2)
    m = SwiGLU(4, 6, names=("gate_proj", "up_proj", "down_proj")).double()
    assert list(m.state_dict()) == ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    assert list(SwiGLU(4, 6).state_dict()) == ["gate.weight", "up.weight", "down.weight"]
    x = torch.randn(3, 4, dtype=torch.float64)
    g, u = x @ m.gate_proj.weight.T, x @ m.up_proj.weight.T
    want = (g / (1 + torch.exp(-g)) * u) @ m.down_proj.weight.T  # silu(z) = z * sigmoid(z)
    assert torch.allclose(m(x), want, rtol=1e-12, atol=1e-12)
