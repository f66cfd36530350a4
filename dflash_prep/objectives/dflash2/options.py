"""DFlash2's data-side options: DFlash's (:class:`~dflash_prep.objectives.dflash.DrafterOptions`), extended.

:class:`DFlash2Options` inherits every DFlash field (cost model sizes, anchors, budgets) and
adds the four sizes of DFlash2's extra drafter work, each a ``pack`` / ``analyze`` flag
recorded in the manifest header: ``--conv-kernel-size``, ``--conv-group-size``,
``--selector-rank``, ``--selector-top-k``. Three inherited fields default to the released
DFlash2 checkpoint: ``--block-size 8``, ``--draft-layers 5`` and ``--sliding-window 2048``
(the fields are the parent's declarations with those defaults, :func:`_inherited`).
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, replace

from dflash_prep.errors import ConfigError
from dflash_prep.objectives.dflash import DrafterOptions
from dflash_prep.objectives.drafter_cost import DFlash2CostModel, DrafterCostModel
from dflash_prep.objectives.options import option

#: The released DFlash2 checkpoint's drafter: the defaults of its inherited fields.
RELEASED_BLOCK_SIZE = 8
RELEASED_DRAFT_LAYERS = 5
RELEASED_SLIDING_WINDOW = 2048
_RELEASED = "the released DFlash2 checkpoint's"


def _inherited(name: str, default=MISSING, **flag_defaults):
    """Field ``name`` of :class:`DrafterOptions` as the parent declares it (help, commands,
    header, flags), with DFlash2's default: ``default`` for a one-flag field, ``flag_defaults``
    (by flag name) for the flags of a field set through several."""
    meta = dict(DrafterOptions.__dataclass_fields__[name].metadata["option"])
    if meta["flags"]:
        meta["flags"] = tuple(replace(fl, default=flag_defaults[fl.name],
                                      help=f"{fl.help} (dflash2: {flag_defaults[fl.name]}, {_RELEASED})")
                              if fl.name in flag_defaults else fl for fl in meta["flags"])
    else:
        meta["help"] = f"{meta['help']} (dflash2: {default}, {_RELEASED})"
    return option(default, **{k: meta[k] for k in ("help", "commands", "flag", "panel", "header", "metavar", "flags",
                                                    "build", "spell")})


@dataclass(frozen=True)
class DFlash2Options(DrafterOptions):
    """The options of ``pack`` / ``analyze --objective dflash2``: DFlash's, plus the drafter's
    convolutions and candidate selector (their step cost: :class:`DFlash2CostModel`).

    Every draft layer wraps its attention and its MLP sublayer in grouped dynamic depthwise
    convolutions over the block's slots (on the sublayer's input and on its output); the
    candidate selector takes each slot's top-K of the target head's logits and scores adjacent
    candidates ``score(p -> c) = unary[c] + <A[p] * P h, B[c]>`` with codebooks ``A, B`` of
    shape ``[V, selector_rank]`` and ``P: H -> selector_rank``.
    """

    cost_model: DrafterCostModel | None = _inherited("cost_model", None, draft_layers=RELEASED_DRAFT_LAYERS,
                                                     sliding_window=RELEASED_SLIDING_WINDOW)
    block_size: int = _inherited("block_size", RELEASED_BLOCK_SIZE)
    conv_kernel_size: int = option(2, header=True, help="taps K_c (<= B) of the dynamic depthwise convolutions on the "
                                   "input and output of each attention and MLP sublayer of every draft layer "
                                   f"({_RELEASED})")
    conv_group_size: int = option(16, header=True, help="channels per convolution group: one projection (H -> 2 K_c "
                                  "x H / this) gives each group its taps per token; must divide H")
    selector_rank: int = option(256, header=True, help="rank r of the candidate selector: P (H -> r) and the "
                                "codebooks A, B (V x r)")
    selector_top_k: int = option(16, header=True, help="candidates K per slot, the top-K of the target head's "
                                 "logits; the selector scores K x K adjacent pairs")

    def __post_init__(self):
        super().__post_init__()
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.conv_kernel_size > self.block_size:
            raise ConfigError(f"--conv-kernel-size {self.conv_kernel_size} exceeds --block-size {self.block_size}: "
                              "taps past the block read nothing")
        self.step_cost_model()              # its own checks: the group size divides H, K <= V

    def step_cost_model(self) -> DFlash2CostModel | None:
        """:attr:`cost_model` with the convolution and selector sizes: DFlash2's step cost."""
        if self.cost_model is None:
            return None
        return DFlash2CostModel(**asdict(self.cost_model), conv_kernel_size=self.conv_kernel_size,
                                conv_group_size=self.conv_group_size, selector_rank=self.selector_rank,
                                selector_top_k=self.selector_top_k)
