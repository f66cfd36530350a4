"""The DFlash2 objective's data side: DFlash plus convolutions and a candidate selector.

:mod:`.options` extends :class:`~dflash_prep.objectives.dflash.DrafterOptions` (four sizes;
the released checkpoint's block size, layers and window as defaults), :mod:`.objective`
subclasses the DFlash objective; the step cost is
:class:`~dflash_prep.objectives.drafter_cost.DFlash2CostModel`. docs/dflash.md#dflash2.
"""

from dflash_prep.objectives.dflash2.objective import DFlash2Objective
from dflash_prep.objectives.dflash2.options import (RELEASED_BLOCK_SIZE, RELEASED_DRAFT_LAYERS,
                                                    RELEASED_SLIDING_WINDOW, DFlash2Options)

__all__ = ["DFlash2Objective", "DFlash2Options", "RELEASED_BLOCK_SIZE", "RELEASED_DRAFT_LAYERS",
           "RELEASED_SLIDING_WINDOW"]
