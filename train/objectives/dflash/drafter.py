"""The DFlash drafter: the public DFlash architecture (z-lab/dflash ``dflash/model.py``), packed.

A drafter is N Qwen3-style decoder layers that draft a block of B tokens in one pass while
reading features of a frozen target model:

- **Context feature**: the target's hidden states at layers ``target_layer_ids`` (read as
  ``hidden_states[l + 1]``, i.e. the output of decoder layer ``l``) are concatenated
  (``[S, k*H]``), projected by ``fc`` (k*H -> H, no bias) and normalised by ``hidden_norm``.
- **Draft layer** (pre-norm, residual): ``x += o_proj(attn(input_layernorm(x)))``, then
  ``x += mlp(post_attention_layernorm(x))`` with a SwiGLU MLP ``down(silu(gate(h)) * up(h))``.
  Attention: queries ``q_norm(q_proj(h))`` from the block's normed hidden states; keys and
  values are this layer's ``k_proj``/``v_proj`` applied to the fused context feature, followed by
  the same projections of ``h`` (the block tokens); ``k_norm`` normalises both key parts per
  head (values are not normed); RoPE rotates context keys at their own positions and the block's
  queries/keys at ``a_j .. a_j + B - 1``. GQA: query head ``h`` reads key head
  ``h // (heads // kv_heads)``. Scale ``1/sqrt(head_dim)``.
- **Output**: the final ``norm`` of the last layer's hidden states; the target's (frozen)
  ``lm_head`` turns it into logits outside this module.

Parameter names are exactly the public ones with no prefix (``layers.N.self_attn.q_proj.weight``,
``layers.N.mlp.gate_proj.weight``, ``norm.weight``, ``fc.weight``, ``hidden_norm.weight``, ...), and
the module registers no buffers, so ``state_dict()`` is the public checkpoint's key set.

Packed layout (training): D documents, document d with S_d context tokens and N_d anchors.
``target_feats [sum S_d, k*H]`` holds the raw concatenated taps, ``ctx_pos`` their positions
(0..S_d-1 per document), ``noise_embeds [sum N_d*B, H]`` the embedded blocks
``[x[a_j], MASK x (B-1)]`` with positions ``blk_pos``, and block j of document d attends to the
context ``[0, a_j)`` of its own document plus its own B tokens (bidirectionally): exactly what
the public inference code computes for one block after a prefill of ``a_j`` tokens
(``dflash_prep.kernels.attention.attention_dflash`` implements that mask). With ``sliding_window`` W > 0
every layer is a public ``sliding_attention`` layer: slot r keeps the context from
``a_j + r - W + 1`` on.

RoPE is the default (unscaled) rotary embedding with base ``rope_theta``, in the HF
``rotate_half`` convention; the drafter has its own config, so a target's RoPE scaling is not
inherited. RMSNorm, RoPE and the MLP are :mod:`.layers`' (shared with the LM decoder), in the HF
rounding order: norms cast before the gain, RoPE tables in the activation dtype.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from dflash_prep.errors import ConfigError
from dflash_prep.objectives.target_taps import dflash_taps

from dflash_prep.train.layers import RMSNorm, SwiGLU, apply_rope, rope_tables


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The target layers a drafter of ``num_draft_layers`` layers taps (indices into the
    target's decoder layers, 0-based; the feature is ``hidden_states[l + 1]``).

    One draft layer taps the middle layer ``L // 2``; N > 1 layers tap N layers evenly spaced
    from layer 1 to layer ``L - 3``: ``round(1 + i * (L - 4) / (N - 1))`` for i = 0..N-1
    (Python's ``round``: halves go to the even neighbour). The public DFlash rule, kept in
    :func:`dflash_prep.objectives.target_taps.dflash_taps` (the states cache reads it too).
    """
    return dflash_taps(num_target_layers, num_draft_layers)


@dataclass(frozen=True)
class DrafterConfig:
    """Shape of a DFlash drafter; the fields the public ``config.json`` needs."""

    hidden: int
    """Residual width H (the target's hidden_size: the drafter reads the target's embeddings)."""
    heads: int
    """Query heads."""
    kv_heads: int
    """Key/value heads (GQA); divides ``heads``."""
    head_dim: int
    """Per-head width (even, for RoPE)."""
    intermediate: int
    """SwiGLU hidden width."""
    num_layers: int
    """Draft layers N."""
    rms_norm_eps: float
    """RMSNorm epsilon (every norm)."""
    rope_theta: float
    """RoPE base."""
    max_position: int
    """Largest position + 1 the drafter is meant for (max_position_embeddings)."""
    block_size: int
    """Block size B: one anchor token plus B - 1 masked slots."""
    num_target_layers: int
    """The target's decoder layers L."""
    target_layer_ids: tuple[int, ...]
    """Tapped target layers (0-based); usually :func:`build_target_layer_ids` (L, N)."""
    mask_token_id: int
    """Embedding row of the mask token (an id the target never produces in the data)."""
    vocab_size: int
    """The target's vocabulary (rows of its embed_tokens / lm_head)."""
    attention_bias: bool = False
    """Biases on q/k/v/o projections (Qwen3: False; taken from the target's config)."""
    sliding_window: int = 0
    """Sliding-window attention W of every draft layer, 0 = full: the query of slot r of block j
    sees the context positions ``>= a_j + r - W + 1`` only (the public code's rule for a
    ``sliding_attention`` layer, :func:`dflash_prep.kernels.inputs.window_start`); at least B."""

    def __post_init__(self):
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "num_layers", "max_position",
                     "num_target_layers", "vocab_size"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"drafter.{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size < 2:
            raise ConfigError(f"--block-size must be >= 2 (one anchor plus at least one drafted slot), "
                              f"got {self.block_size}")
        if self.heads % self.kv_heads:
            raise ConfigError(f"drafter.kv_heads ({self.kv_heads}) must divide drafter.heads ({self.heads})")
        if self.head_dim % 2:
            raise ConfigError(f"drafter.head_dim must be even for RoPE, got {self.head_dim}")
        if not self.target_layer_ids:
            raise ConfigError("drafter.target_layer_ids is empty; the drafter taps at least one target layer")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ConfigError(f"drafter.target_layer_ids {bad} are outside the target's layers "
                              f"0..{self.num_target_layers - 1}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"drafter.mask_token_id {self.mask_token_id} is outside the vocabulary "
                              f"(0..{self.vocab_size - 1})")
        if self.sliding_window < 0 or 0 < self.sliding_window < self.block_size:
            raise ConfigError(f"--sliding-window must be 0 (full attention) or at least the block size "
                              f"{self.block_size}, got {self.sliding_window}")
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise ConfigError("drafter.rms_norm_eps and drafter.rope_theta must be positive")

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        return cls(**d)

    @classmethod
    def from_target_config(cls, hf_config, num_layers: int, block_size: int, mask_token_id: int,
                           target_layer_ids=None, sliding_window: int = 0) -> "DrafterConfig":
        """A drafter shaped like one layer of the target (HF ``PretrainedConfig``: Qwen3, Llama,
        Mistral): same hidden size, heads, head_dim, MLP width, norm eps and RoPE base; taps
        :func:`build_target_layer_ids` unless ``target_layer_ids`` is given; its own
        ``sliding_window`` (the target's is not inherited)."""
        c = hf_config
        heads = int(c.num_attention_heads)
        head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
        L = int(c.num_hidden_layers)
        ids = build_target_layer_ids(L, num_layers) if target_layer_ids is None else list(target_layer_ids)
        theta = getattr(c, "rope_theta", None)
        if theta is None:  # newer transformers keep it in rope_parameters
            theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        return cls(hidden=int(c.hidden_size), heads=heads, kv_heads=int(getattr(c, "num_key_value_heads", heads) or heads),
                   head_dim=head_dim, intermediate=int(c.intermediate_size), num_layers=int(num_layers),
                   rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)), rope_theta=float(theta),
                   max_position=int(getattr(c, "max_position_embeddings", 4096)), block_size=int(block_size),
                   num_target_layers=L, target_layer_ids=tuple(ids), mask_token_id=int(mask_token_id),
                   vocab_size=int(c.vocab_size), attention_bias=bool(getattr(c, "attention_bias", False)),
                   sliding_window=int(sliding_window))


def _norm(cfg: DrafterConfig, dim: int) -> RMSNorm:
    """The drafter's RMSNorm: the HF Qwen3 rounding order (cast, then gain), as the public model."""
    return RMSNorm(dim, cfg.rms_norm_eps, cast_before_gain=True)


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        H, D, b = cfg.hidden, cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(H, cfg.heads * D, bias=b)
        self.k_proj = nn.Linear(H, cfg.kv_heads * D, bias=b)
        self.v_proj = nn.Linear(H, cfg.kv_heads * D, bias=b)
        self.o_proj = nn.Linear(cfg.heads * D, H, bias=b)
        self.q_norm = _norm(cfg, D)
        self.k_norm = _norm(cfg, D)

    def forward(self, h, ctx, rope_ctx, rope_blk, cu_ctx, cu_blk, anchors, block_size):
        """h ``[Q, H]`` (normed block states), ctx ``[S, H]`` (fused context) -> ``[Q, H]``."""
        from dflash_prep.kernels.attention import attention_dflash

        c = self.cfg
        Q, S = h.shape[0], ctx.shape[0]
        q = self.q_norm(self.q_proj(h).view(Q, c.heads, c.head_dim))           # (Q, Hq, D)
        k_ctx = self.k_norm(self.k_proj(ctx).view(S, c.kv_heads, c.head_dim))  # (S, Hkv, D)
        k_blk = self.k_norm(self.k_proj(h).view(Q, c.kv_heads, c.head_dim))    # (Q, Hkv, D)
        v_ctx = self.v_proj(ctx).view(S, c.kv_heads, c.head_dim)
        v_blk = self.v_proj(h).view(Q, c.kv_heads, c.head_dim)
        q, k_blk = apply_rope(q, *rope_blk), apply_rope(k_blk, *rope_blk)
        k_ctx = apply_rope(k_ctx, *rope_ctx)
        o = attention_dflash(q, k_ctx, v_ctx, k_blk, v_blk, cu_ctx, cu_blk, anchors, block_size,
                                     scale=1.0 / math.sqrt(c.head_dim), window=c.sliding_window)  # (Q, Hq, D)
        return self.o_proj(o.reshape(Q, c.heads * c.head_dim))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = SwiGLU(cfg.hidden, cfg.intermediate, names=("gate_proj", "up_proj", "down_proj"))
        self.input_layernorm = _norm(cfg, cfg.hidden)
        self.post_attention_layernorm = _norm(cfg, cfg.hidden)

    def forward(self, x, ctx, rope_ctx, rope_blk, cu_ctx, cu_blk, anchors, block_size):
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_ctx, rope_blk, cu_ctx, cu_blk, anchors, block_size)
        return x + self.mlp(self.post_attention_layernorm(x))

    def init_extra(self) -> None:
        """Initialise what a variant's layer adds (after the drafter's normal init); none here."""


class Drafter(nn.Module):
    """N draft layers + ``fc``/``hidden_norm`` (context fusion) + final ``norm`` (module docstring)."""

    #: the config class a checkpoint's ``model_config`` is read with, and the layer class
    config_type = DrafterConfig
    layer_type = DraftLayer

    def __init__(self, cfg: DrafterConfig, *, init_std: float = 0.02):
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(self.layer_type(cfg) for _ in range(cfg.num_layers))
        self.norm = _norm(cfg, cfg.hidden)
        self.fc = nn.Linear(cfg.num_taps * cfg.hidden, cfg.hidden, bias=False)
        self.hidden_norm = _norm(cfg, cfg.hidden)
        for m in self.modules():  # the public init: N(0, 0.02) linears, zero biases, unit norms
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=init_std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        for layer in self.layers:
            layer.init_extra()

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.config.target_layer_ids)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, noise_embeds: torch.Tensor, target_feats: torch.Tensor, ctx_pos: torch.Tensor,
                blk_pos: torch.Tensor, cu_ctx: torch.Tensor, cu_blk: torch.Tensor, anchors: torch.Tensor,
                block_size: int | None = None) -> torch.Tensor:
        """Packed forward: ``noise_embeds [Q, H]``, ``target_feats [S, k*H]`` -> ``[Q, H]`` (after ``norm``).

        ``ctx_pos [S]`` / ``blk_pos [Q]``: RoPE positions of context tokens and block slots;
        ``cu_ctx``/``cu_blk`` int32 ``[D + 1]``: document offsets into the context and block
        rows (``cu_blk`` multiples of B); ``anchors`` int32 ``[Q / B]``: each block's anchor,
        sorted within its document, ``0 <= a < S_d``. See the module docstring for the mask.
        """
        c = self.config
        B = c.block_size if block_size is None else int(block_size)
        kH = c.num_taps * c.hidden
        if noise_embeds.dim() != 2 or noise_embeds.shape[1] != c.hidden:
            raise ValueError(f"noise_embeds must be [Q, {c.hidden}], got {tuple(noise_embeds.shape)}")
        if target_feats.dim() != 2 or target_feats.shape[1] != kH:
            raise ValueError(f"target_feats must be [S, {kH}] ({c.num_taps} taps x {c.hidden}), "
                             f"got {tuple(target_feats.shape)}")
        if noise_embeds.shape[0] != blk_pos.shape[0] or target_feats.shape[0] != ctx_pos.shape[0]:
            raise ValueError("blk_pos must have one entry per block row and ctx_pos one per context row")
        ctx = self.hidden_norm(self.fc(target_feats))  # (S, H)
        x = noise_embeds
        rope_ctx = rope_tables(ctx_pos, c.head_dim, c.rope_theta, ctx.dtype)  # (S, D/2) each
        rope_blk = rope_tables(blk_pos, c.head_dim, c.rope_theta, x.dtype)    # (Q, D/2) each
        for layer in self.layers:
            x = layer(x, ctx, rope_ctx, rope_blk, cu_ctx, cu_blk, anchors, B)
        return self.norm(x)
