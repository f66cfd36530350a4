"""A small Llama-style decoder whose attention is ``kernels/``.

RMSNorm (pre-norm), rotary position embeddings, SwiGLU MLP (those three are :mod:`.layers`',
shared with the drafter; RoPE and RMSNorm run in fp32 here), grouped-query attention,
optional tied embeddings. No dropout, so a training step is a pure function of the
parameters, optimizer state and batch: that is what makes resume bitwise on CPU.

One forward serves both manifest layouts:

- padded: ``input_ids (B, L)`` with per-row ``lengths``; attention is
  ``dflash_prep.kernels.attention.attention_padded`` (rows are masked beyond their length), positions ``0..L-1``;
- varlen: ``input_ids (T,)``, samples concatenated, with ``cu_seqlens`` (int32, N+1) and
  ``position_ids (T,)`` restarting at 0 in every sample; attention is
  ``dflash_prep.kernels.attention.attention_varlen`` (block-diagonal causal: no attention across samples).

Which kernel runs is ``kernels``' dispatch (Triton on CUDA, the PyTorch reference on CPU);
the trainer wraps the forward in ``dflash_prep.kernels.attention.force_backend`` when ``--attn`` asks for one.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dflash_prep.kernels.attention import attention_padded, attention_varlen, force_backend

from dflash_prep.train.config import ModelConfig
from dflash_prep.train.layers import RMSNorm, SwiGLU, apply_rope, rope_tables


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.q = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.k = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x, cos, sin, *, lengths=None, cu_seqlens=None, max_seqlen=0):
        c = self.cfg
        lead = x.shape[:-1]  # (B, L) padded or (T,) varlen
        q = self.q(x).view(*lead, c.n_heads, c.head_dim)
        k = self.k(x).view(*lead, c.n_kv_heads, c.head_dim)
        v = self.v(x).view(*lead, c.n_kv_heads, c.head_dim)
        q, k = apply_rope(q, cos, sin, fp32=True), apply_rope(k, cos, sin, fp32=True)
        if cu_seqlens is not None:  # (T, H, D)
            o = attention_varlen(q, k, v, cu_seqlens, max_seqlen, causal=True)
        else:  # (B, L, H, D) -> (B, H, L, D)
            o = attention_padded(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         lengths, causal=True).transpose(1, 2)
        return self.o(o.reshape(*lead, c.n_heads * c.head_dim))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn_dim)

    def forward(self, x, cos, sin, **attn_kw):
        x = x + self.attn(self.attn_norm(x), cos, sin, **attn_kw)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """The decoder. ``forward`` returns logits; :func:`token_loss_sum` is the training loss."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size < 1:
            raise ValueError("ModelConfig.vocab_size must be set (the trainer takes it from the dataset)")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=self.cfg.init_std)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, input_ids, *, lengths=None, cu_seqlens=None, max_seqlen=0, position_ids=None):
        """Logits ``(B, L, V)`` (padded) or ``(T, V)`` (varlen, needs cu_seqlens and position_ids)."""
        return self.head(self.hidden(input_ids, lengths=lengths, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                     position_ids=position_ids))

    def hidden(self, input_ids, *, lengths=None, cu_seqlens=None, max_seqlen=0, position_ids=None):
        """The final-norm hidden states ``(B, L, d)`` / ``(T, d)``: logits are ``head`` of them
        (the trainer runs head + CE in chunks, :mod:`dflash_prep.train.chunked_ce`)."""
        if cu_seqlens is None:
            if lengths is None or input_ids.dim() != 2:
                raise ValueError("padded forward needs input_ids (B, L) and lengths (B,)")
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)  # (L,)
            cos, sin = rope_tables(position_ids, self.cfg.head_dim, self.cfg.rope_theta)
            cos, sin = cos[None], sin[None]  # (1, L, D/2) broadcasts over B
        else:
            if position_ids is None or input_ids.dim() != 1:
                raise ValueError("varlen forward needs input_ids (T,), cu_seqlens and position_ids (T,)")
            cos, sin = rope_tables(position_ids, self.cfg.head_dim, self.cfg.rope_theta)  # (T, D/2)
        x = self.embed(input_ids)
        for blk in self.blocks:
            x = blk(x, cos, sin, lengths=lengths, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        return self.norm(x)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropy over positions whose label is not -100.

    The caller divides by the number of real target tokens in the whole optimizer step
    (all ranks, all accumulation micro-batches), never by a per-micro-batch count.
    """
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                           ignore_index=-100, reduction="sum")
