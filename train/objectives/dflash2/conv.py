"""DFlash2's grouped dynamic depthwise convolution, on the drafter's packed block layout.

DFlash2 wraps each sublayer (attention, MLP) of every draft layer in two convolutions over the
block's slots, both driven by one projection of the sublayer's normalised input ``u``
(the public ``attention_conv`` / ``mlp_conv``; ``/work/notes/dflash2_contract.md`` section 3)::

    d = kernel_projection(u).view(Q, 2, T, G)       # side 0 drives the in-conv, side 1 the out-conv
    x = x + conv(sublayer(conv(u, d[:, 0], base_kernel[0])), d[:, 1], base_kernel[1])

    conv(z, δ, b)[i, c] = sum_{t < T} (b[t, c] + δ[i, t, c // group_size]) * z[i - t, c] * [pos(i) >= t]

``pos(i)`` is row i's slot in its block (0 = the anchor). Tap 0 is the row itself, tap t the
row t slots earlier in the same block; a row with ``pos < t`` reads zero, so nothing crosses a
block boundary and slot r sees slots ``r - T + 1 .. r`` only (causal inside the block). The base
kernel is per channel, the dynamic delta per group of ``group_size`` contiguous channels. The
out-conv's delta at row i comes from ``u[i]`` (the sublayer's input), not from its output.

Layout: the drafter's packed block rows, ``z [Q, H]`` with ``Q = n_blocks * B`` and block j on
rows ``j*B .. j*B + B - 1`` (``noise_embeds`` of :mod:`dflash_prep.train.drafter`). The context
features are never convolved: they reach attention through ``fc``/``hidden_norm`` and the
layer's ``k_proj``/``v_proj`` only. Every function takes the block size explicitly.

Rounding: the coefficient is formed first, ``(base + δ) * z``, in z's dtype (the serving
order of vLLM and SpecForge; the z-lab torch file adds ``base*z`` and ``δ*z`` separately).

Init: ``base_kernel[:, 0] = 1``, other taps 0, ``kernel_projection`` zero. Both convolutions are
then the identity: ``1 * z + 0 * shifted``, equal to z bit for bit except that an input -0.0
comes out +0.0, so a DFlash2 layer with fresh convolutions computes the DFlash layer's states.

Parameter names are the checkpoint's relative to the module: attach an instance as
``layers.N.attention_conv`` / ``layers.N.mlp_conv`` and ``state_dict()`` gives
``layers.N.attention_conv.base_kernel`` [2, T, H] and
``layers.N.attention_conv.kernel_projection.weight`` [2*T*G, H] (G = H / group_size).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from dflash_prep.errors import ConfigError


def check_conv_shape(hidden: int, taps: int, group_size: int, block_size: int | None = None) -> None:
    """Reject a convolution shape the checkpoint contract does not allow (ConfigError, with the fix)."""
    if taps < 1:
        raise ConfigError(f"conv_kernel_size must be >= 1 (tap 0 is the slot itself), got {taps}")
    if group_size < 1 or hidden % group_size:
        raise ConfigError(f"conv_group_size ({group_size}) must be a positive divisor of the hidden "
                          f"size ({hidden}); 16 is the released value")
    if block_size is not None and taps > block_size:
        raise ConfigError(f"conv_kernel_size ({taps}) must not exceed the block size ({block_size}): "
                          f"taps past the block read nothing")


def grouped_conv(z: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int) -> torch.Tensor:
    """One side of the convolution: ``z [Q, H]``, ``delta [Q, T, G]``, ``base [T, H]`` -> ``[Q, H]``.

    ``Q`` is a whole number of blocks of ``block_size`` rows (module docstring for the formula).
    The result is in z's dtype (base and delta are cast to it first).
    """
    if z.dim() != 2:
        raise ValueError(f"grouped_conv: z must be packed block rows [Q, H], got {tuple(z.shape)}")
    Q, H = z.shape
    T = base.shape[0]
    G = delta.shape[-1]
    B = int(block_size)
    if G < 1 or H % G:
        raise ValueError(f"grouped_conv: {G} groups do not divide the hidden size {H}")
    check_conv_shape(H, T, H // G, B)
    if Q % B:
        raise ValueError(f"grouped_conv: {Q} rows are not whole blocks of {B}")
    if base.shape != (T, H) or delta.shape != (Q, T, G):
        raise ValueError(f"grouped_conv: base must be [{T}, {H}] and delta [{Q}, {T}, {G}], "
                         f"got {tuple(base.shape)} and {tuple(delta.shape)}")
    gs = H // G
    zb = z.view(Q // B, B, G, gs)                                        # (N, B, G, gs)
    coef = (base.to(z.dtype).view(1, 1, T, G, gs)
            + delta.to(z.dtype).view(Q // B, B, T, G, 1))                # (N, B, T, G, gs)
    out = coef[:, :, 0] * zb
    for t in range(1, T):
        shifted = F.pad(zb[:, : B - t], (0, 0, 0, 0, t, 0))              # slot r reads r - t; 0 for r < t
        out = out + coef[:, :, t] * shifted
    return out.reshape(Q, H)


class GroupedDynamicConv(nn.Module):
    """The convolution pair around one sublayer (``attention_conv`` or ``mlp_conv``).

    ``prepare(u, B)`` -> ``(conv_in(u), delta_out)``; ``finish(y, delta_out, B)`` -> ``conv_out(y)``;
    ``forward(u, sublayer, B)`` = ``finish(sublayer(prepare(u)))`` for a sublayer that maps the
    block rows ``[Q, H] -> [Q, H]`` (bind its other arguments, e.g. the context, in a closure).
    """

    def __init__(self, hidden: int, taps: int, group_size: int):
        super().__init__()
        check_conv_shape(int(hidden), int(taps), int(group_size))
        self.hidden, self.taps, self.group_size = int(hidden), int(taps), int(group_size)
        self.groups = self.hidden // self.group_size
        self.base_kernel = nn.Parameter(torch.empty(2, self.taps, self.hidden))  # (side, tap, H)
        self.kernel_projection = nn.Linear(self.hidden, 2 * self.taps * self.groups, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The identity: unit tap 0, zero other taps, zero dynamic projection (module docstring)."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def deltas(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``u [Q, H]`` -> the in- and out-side deltas, each ``[Q, T, G]``."""
        d = self.kernel_projection(u).view(u.shape[0], 2, self.taps, self.groups)  # (Q, side, T, G)
        return d[:, 0], d[:, 1]

    def prepare(self, u: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """In-conv of the sublayer's normalised input ``u [Q, H]``; also returns the out-side delta."""
        d_in, d_out = self.deltas(u)
        return grouped_conv(u, d_in, self.base_kernel[0], block_size), d_out

    def finish(self, y: torch.Tensor, delta_out: torch.Tensor, block_size: int) -> torch.Tensor:
        """Out-conv of the sublayer's output ``y [Q, H]`` with the delta :meth:`prepare` returned."""
        return grouped_conv(y, delta_out, self.base_kernel[1], block_size)

    def forward(self, u: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor],
                block_size: int) -> torch.Tensor:
        z, d_out = self.prepare(u, block_size)
        return self.finish(sublayer(z), d_out, block_size)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, taps={self.taps}, group_size={self.group_size}"
