"""The DFlash2 drafter: the DFlash drafter with two convolutions around every sublayer and a
candidate selector on top (the public ``DFlash2DraftModel``; docs/dflash.md#dflash2).

Each draft layer is DFlash's (:class:`~dflash_prep.train.objectives.dflash.drafter.DraftLayer`)
with its attention and its MLP wrapped, on the normalised branch, in a
:class:`~.conv.GroupedDynamicConv` pair (``attention_conv``, ``mlp_conv``): the in-conv of the
sublayer's normalised input feeds the sublayer (its queries and its block keys/values), the
out-conv of the sublayer's output joins the residual; both are driven by one projection of the
normalised input and never cross a block boundary; the context features are never convolved.
Identity-initialised, so a fresh DFlash2 layer computes the DFlash layer's states.

The drafter's output (after ``norm``) is DFlash's; the target's head turns it into the unary
logits, and :attr:`DFlash2Drafter.candidate_selector` (:class:`~.selector.CandidateSelector`)
picks the block's path through their top-K. Its parameter names are the checkpoint's:
``layers.N.{attention_conv,mlp_conv}.{base_kernel,kernel_projection.weight}`` and
``candidate_selector.{hidden_projection.weight,predecessor_codebook,successor_codebook}``.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_prep.errors import ConfigError
from dflash_prep.train.objectives.dflash.drafter import DraftLayer, Drafter, DrafterConfig
from dflash_prep.train.objectives.dflash2.conv import GroupedDynamicConv, check_conv_shape
from dflash_prep.train.objectives.dflash2.selector import INIT_MODES, CandidateSelector


@dataclass(frozen=True)
class DFlash2Config(DrafterConfig):
    """A DFlash drafter's shape plus the convolutions' and the selector's sizes."""

    conv_kernel_size: int = 2
    """Taps T of every convolution (<= B)."""
    conv_group_size: int = 16
    """Channels sharing one dynamic tap (divides H)."""
    selector_rank: int = 256
    """Width R of the selector's projection and codebooks."""
    selector_top_k: int = 16
    """Candidates K per slot (<= V)."""
    selector_init: str = "zero"
    """``zero``: the successor codebook starts at 0 (a fresh drafter proposes DFlash's argmax);
    ``normal``: N(0, 0.02). Not part of the exported checkpoint."""

    def __post_init__(self):
        super().__post_init__()
        check_conv_shape(self.hidden, self.conv_kernel_size, self.conv_group_size, self.block_size)
        if self.selector_rank < 1 or not 1 <= self.selector_top_k <= self.vocab_size:
            raise ConfigError(f"--selector-rank must be >= 1 and --selector-top-k in [1, {self.vocab_size}], got "
                              f"{self.selector_rank} and {self.selector_top_k}")
        if self.selector_init not in INIT_MODES:
            raise ConfigError(f"--selector-init must be one of {', '.join(INIT_MODES)}, got {self.selector_init!r}")


class DFlash2Layer(DraftLayer):
    """A DFlash layer whose attention and MLP sit inside convolution pairs (module docstring)."""

    def __init__(self, cfg: DFlash2Config):
        super().__init__(cfg)
        self.attention_conv = GroupedDynamicConv(cfg.hidden, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = GroupedDynamicConv(cfg.hidden, cfg.conv_kernel_size, cfg.conv_group_size)

    def init_extra(self) -> None:
        self.attention_conv.reset_parameters()     # the identity (the drafter's init drew its projection)
        self.mlp_conv.reset_parameters()

    def forward(self, x, ctx, rope_ctx, rope_blk, cu_ctx, cu_blk, anchors, block_size):
        B = block_size
        u, d = self.attention_conv.prepare(self.input_layernorm(x), B)                       # (Q, H), (Q, T, G)
        x = x + self.attention_conv.finish(self.self_attn(u, ctx, rope_ctx, rope_blk, cu_ctx, cu_blk, anchors, B),
                                           d, B)
        u, d = self.mlp_conv.prepare(self.post_attention_layernorm(x), B)
        return x + self.mlp_conv.finish(self.mlp(u), d, B)


class DFlash2Drafter(Drafter):
    """DFlash's drafter with :class:`DFlash2Layer` s and a candidate selector (module docstring)."""

    config_type = DFlash2Config
    layer_type = DFlash2Layer

    def __init__(self, cfg: DFlash2Config, *, init_std: float = 0.02):
        super().__init__(cfg, init_std=init_std)
        self.candidate_selector = CandidateSelector(cfg.hidden, cfg.vocab_size, cfg.selector_rank, cfg.selector_top_k,
                                                    init=cfg.selector_init, init_std=init_std)
