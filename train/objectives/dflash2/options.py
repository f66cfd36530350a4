"""The DFlash2 objective's trainer options: DFlash's (:class:`~dflash_prep.train.objectives.dflash.options.DFlashTrainOptions`),
extended by inheritance with the convolutions, the candidate selector and its loss.

The defaults follow the released DFlash2 checkpoint (z-lab's Qwen3.8-27B-DFlash2: B = 8 when no
manifest says otherwise, 5 draft layers, window 2048, 2-tap convolutions in groups of 16
channels, a rank-256 selector over the top 16) and, where the public trainers disagree, the
choice docs/dflash.md#dflash2 explains: a missing gold token's slot is dropped from the selector
loss (SpecForge, NeMo Automodel, verl-SpeCo; ``inject`` is speculators'), the successor codebook
starts at zero (SpecForge, NeMo: a fresh DFlash2 proposes exactly DFlash's tokens), and the
selector's inputs keep their gradient (SpecForge's default; ``--selector-detach`` is verl's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dflash_prep.errors import ConfigError
from dflash_prep.objectives.dflash2 import DFlash2Options
from dflash_prep.objectives.options import TRAIN, option
from dflash_prep.train.objectives.dflash.options import DFlashTrainOptions
from dflash_prep.train.objectives.dflash2.selector import INIT_MODES, MISSING_MODES

_SIZES = DFlash2Options()     # the data side's declared defaults: one source for both sides


def _train(default, help: str):
    return option(default, help=help, commands=(TRAIN,))


@dataclass(frozen=True)
class DFlash2TrainOptions(DFlashTrainOptions):
    """A DFlash2 drafter on a frozen target: DFlash's options, the two modules, the selector loss."""

    conv_kernel_size: int = _train(_SIZES.conv_kernel_size, help="taps of every convolution around the attention "
                                   "and MLP sublayers (<= B; the released checkpoint's)")
    conv_group_size: int = _train(_SIZES.conv_group_size, help="channels sharing one dynamic tap (divides the "
                                  "hidden size; the released checkpoint's)")
    selector_rank: int = _train(_SIZES.selector_rank, help="width of the selector's projection and codebooks (the "
                                "released checkpoint's)")
    selector_top_k: int = _train(_SIZES.selector_top_k, help="candidates per slot: the unary top-K of the target "
                                 "head's logits (the released checkpoint's)")
    selector_loss_alpha: float = _train(1.0, help="weight of the selector's K-way cross-entropy beside the unary "
                                        "DFlash loss (both weighted like the unary loss, over the step's sum w)")
    selector_missing: str = _train("drop", help="a slot whose gold token is not in the unary top-K: drop (no "
                                   "selector loss; SpecForge, NeMo, verl) or inject (the gold replaces candidate "
                                   "K-1; speculators)")
    selector_init: str = _train("zero", help="successor codebook at the start: zero (a fresh drafter proposes "
                                "DFlash's argmax; SpecForge, NeMo) or normal (N(0, 0.02); speculators)")
    selector_detach: bool = _train(False, help="stop the selector loss's gradient into the drafter's hidden states "
                                   "and unary logits (verl-SpeCo; default: they learn from it, SpecForge)")
    init_from_drafter: str = _train("", help="warm start from an exported DFlash (v1) drafter folder of the same "
                                    "target, taps and shape: its weights, identity convolutions and a "
                                    "--selector-init selector; at step 0 it proposes exactly that drafter's tokens")

    #: block size when neither the flag nor a manifest sets it: the released checkpoint's
    default_block_size = _SIZES.block_size

    def __post_init__(self):
        super().__post_init__()
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        a = self.selector_loss_alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a) or a < 0:
            raise ConfigError(f"--selector-loss-alpha must be a finite number >= 0, got {a!r}")
        if self.selector_missing not in MISSING_MODES:
            raise ConfigError(f"--selector-missing must be one of {', '.join(MISSING_MODES)}, "
                              f"got {self.selector_missing!r}")
        if self.selector_init not in INIT_MODES:
            raise ConfigError(f"--selector-init must be one of {', '.join(INIT_MODES)}, got {self.selector_init!r}")
        if self.init_from_drafter and self.init_layers != "random":
            raise ConfigError("--init-from-drafter and --init-layers target both set the starting weights; pass one")

    @classmethod
    def objective_name(cls) -> str:
        return "dflash2"
