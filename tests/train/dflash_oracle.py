"""Independent oracles for the DFlash tests (plain loops, no packing, nothing shared with train/).

- :func:`public_block_forward`: one block of the drafter the way the public DFlash inference
  code runs it after a prefill of ``a`` tokens: context features ``[0, a)`` and the B block
  embeddings, positions ``0 .. a + B - 1``, no mask; RoPE from transformers' Qwen3 rotary
  embedding and attention from torch SDPA. ``window`` W > 0 runs every layer as a public
  ``sliding_attention`` layer the way transformers' flash-attention path does it (the public
  inference code passes ``sliding_window=W`` to it): ``window_size=(W-1, W-1)`` over keys and
  queries aligned on their absolute positions, applied only when there are more than W keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _rms(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate_half(x):
    d = x.shape[-1] // 2
    return torch.cat((-x[..., d:], x[..., :d]), dim=-1)


def _flash_window_mask(q_len: int, k_len: int, window: int):
    """Keep mask (q_len, k_len) of flash-attn's ``window_size=(W-1, W-1)``, non-causal, bottom-right
    aligned (query i sits at key index i + k_len - q_len); None when transformers skips it."""
    if not window or k_len <= window:
        return None
    q_at = torch.arange(q_len)[:, None] + (k_len - q_len)
    return (torch.arange(k_len)[None, :] - q_at).abs() <= window - 1


def public_block_forward(drafter, noise, feats, a: int, window: int = 0):
    """``noise [B, H]`` (block embeddings), ``feats [a, k*H]`` (context taps) -> ``[B, H]``."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    c = drafter.config
    hc = Qwen3Config(hidden_size=c.hidden, num_attention_heads=c.heads, num_key_value_heads=c.kv_heads,
                     head_dim=c.head_dim, rope_theta=c.rope_theta, max_position_embeddings=c.max_position)
    rot = Qwen3RotaryEmbedding(hc)
    B = noise.shape[0]
    pos = torch.arange(a + B)[None]
    cos, sin = rot(noise[None], pos)  # (1, a+B, D)
    cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # (a+B, 1, D)
    p = dict(drafter.named_parameters())
    ctx = _rms(feats @ p["fc.weight"].T, p["hidden_norm.weight"], c.rms_norm_eps)  # (a, H)
    x = noise
    group = c.heads // c.kv_heads
    for i in range(c.num_layers):
        w = {k[len(f"layers.{i}."):]: v for k, v in p.items() if k.startswith(f"layers.{i}.")}
        h = _rms(x, w["input_layernorm.weight"], c.rms_norm_eps)
        q = _rms((h @ w["self_attn.q_proj.weight"].T).view(B, c.heads, c.head_dim), w["self_attn.q_norm.weight"],
                 c.rms_norm_eps)
        kv_in = torch.cat([ctx, h])  # context first, then the block: the public concatenation order
        k = _rms((kv_in @ w["self_attn.k_proj.weight"].T).view(a + B, c.kv_heads, c.head_dim),
                 w["self_attn.k_norm.weight"], c.rms_norm_eps)
        v = (kv_in @ w["self_attn.v_proj.weight"].T).view(a + B, c.kv_heads, c.head_dim)
        q = q * cos[-B:] + _rotate_half(q) * sin[-B:]
        k = k * cos + _rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1),
                                           v.repeat_interleave(group, 1).transpose(0, 1),
                                           attn_mask=_flash_window_mask(B, a + B, window))  # (Hq, B, D)
        x = x + o.transpose(0, 1).reshape(B, -1) @ w["self_attn.o_proj.weight"].T
        h = _rms(x, w["post_attention_layernorm.weight"], c.rms_norm_eps)
        x = x + (F.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
    return _rms(x, p["norm.weight"], c.rms_norm_eps)
