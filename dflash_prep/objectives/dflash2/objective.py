"""``pack --objective dflash2``: DFlash's packing (:mod:`dflash_prep.objectives.dflash`), DFlash2's step cost.

Everything a dflash epoch is, a dflash2 epoch is: varlen, the token, anchor and cost budgets,
the same anchor sampler and digest, ``anchor_counts.npy``, verify's regeneration of every
anchor. Its manifest header keeps the family's ``dflash`` section (so every reader of anchors
and budgets, the trainer's included, reads it unchanged) with DFlash2's four sizes added and
the cost model it balanced ranks on: :class:`~dflash_prep.objectives.drafter_cost.DFlash2CostModel`
(DFlash's terms plus the convolutions per anchor and the selector per labelled row), which
``verify`` rebuilds from the record to recompute the rank imbalance. ``header["options"]
["objective"]`` says ``dflash2``.
"""

from __future__ import annotations

from dflash_prep.errors import ConfigError
from dflash_prep.objectives.dflash import DFlashObjective
from dflash_prep.objectives.dflash2.options import DFlash2Options
from dflash_prep.objectives.serving import Serving, block_problems


class DFlash2Objective(DFlashObjective):
    """DFlash's data objective under DFlash2's options (:class:`DFlash2Options`)."""

    name = "dflash2"
    options_type = DFlash2Options
    serving = Serving("DFlash2DraftModel", "DFlash2", block_problems, v2_runner_only=True)

    def check(self, layout, options) -> None:
        super().check(layout, options)
        if not isinstance(options, DFlash2Options):
            raise ConfigError(f"--objective dflash2 needs its options (DFlash2Options), got {type(options).__name__}")
