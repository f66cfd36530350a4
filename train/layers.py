"""The parts the LM decoder (:mod:`dflash_prep.train.objectives.lm.model`) and the DFlash drafter (:mod:`dflash_prep.train.objectives.dflash.drafter`) share.

- :class:`RMSNorm`: ``weight * x / sqrt(mean(x^2) + eps)`` over the last dim, normalised in fp32.
- RoPE: :func:`rope_tables` (cos/sin of ``position * theta^(-2i/D)``, i = 0..D/2-1) and
  :func:`apply_rope`, which rotates the halves ``(x[..., :D/2], x[..., D/2:])`` (the
  GPT-NeoX / Llama-HF ``rotate_half`` convention, not interleaved pairs).
- :class:`SwiGLU`: ``down(silu(gate(x)) * up(x))``, no biases.

The formulas are one; the two models differ only in where they round and in their parameter
names, and both are pinned by their checkpoints (the drafter's by the public DFlash format),
so those are arguments, not copies:

- RMSNorm's ``cast_before_gain``: the decoder multiplies the gain in fp32 and casts the product
  to the input dtype once; the drafter (the HF Llama/Qwen3 order) casts the normalised value to
  the input dtype, then multiplies by the gain, so the result takes the promoted dtype of the
  gain and the input (fp32 for a bf16 activation and an fp32 gain). With fp32 inputs and gains
  the two orders give the same bits.
- RoPE's precision: the decoder builds fp32 tables and rotates in fp32 (``fp32=True``), then
  casts back to the activation's dtype; the drafter builds the tables in its activation dtype
  and rotates in the promoted dtype of the activation and the tables.
- SwiGLU's ``names``: the decoder's ``gate/up/down``, the public ``gate_proj/up_proj/down_proj``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    """``weight * (x / sqrt(mean(x^2) + eps))`` over the last dim, normalised in fp32.

    ``cast_before_gain`` picks the rounding order (module docstring): False (the decoder's)
    returns ``(y * weight).to(x.dtype)`` with the product in fp32; True (HF Llama/Qwen3)
    returns ``weight * y.to(x.dtype)`` in the promoted dtype.
    """

    def __init__(self, dim: int, eps: float, *, cast_before_gain: bool = False):
        super().__init__()
        self.eps = eps
        self.cast_before_gain = cast_before_gain
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # normalise in fp32 under bf16 autocast or bf16 parameters
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.cast_before_gain:
            return self.weight * y.to(x.dtype)
        return (y * self.weight.float()).to(x.dtype)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of ``positions * theta^(-2i / head_dim)`` for i = 0..head_dim/2 - 1.

    Shape ``positions.shape + (head_dim // 2,)``: one column per rotated pair (the table is
    not repeated for the two halves). The angles are computed in fp32 and the tables cast to
    ``dtype``.
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    ang = positions.to(torch.float32)[..., None] * inv  # (..., D/2)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, fp32: bool = False) -> torch.Tensor:
    """Rotate the halves of ``x``: ``(x1 * cos - x2 * sin, x1 * sin + x2 * cos)``, x1 = ``x[..., :D/2]``.

    ``x`` is ``(..., H, D)`` and cos/sin :func:`rope_tables` of shape ``(..., D/2)``, broadcast
    over the heads. ``fp32=True`` rotates ``x`` in fp32 and returns ``x``'s dtype; otherwise the
    result is in the promoted dtype of ``x`` and the tables (the HF ``q * cos + rotate_half(q)
    * sin``, to the bit: negation is exact).
    """
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    if fp32:
        x1, x2 = x1.float(), x2.float()
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (..., 1, D/2)
    out = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return out.to(x.dtype) if fp32 else out


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``: ``dim -> hidden -> dim``, no biases.

    ``names`` are the three projections' attribute (and state_dict) names, in the order gate,
    up, down; they are registered in that order, which is also the order a module-walking init
    draws their weights in.
    """

    def __init__(self, dim: int, hidden: int, *, names: tuple[str, str, str] = ("gate", "up", "down")):
        super().__init__()
        self._names = names
        for name, (n_in, n_out) in zip(names, ((dim, hidden), (dim, hidden), (hidden, dim))):
            self.add_module(name, nn.Linear(n_in, n_out, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self._names)
        return down(F.silu(gate(x)) * up(x))
