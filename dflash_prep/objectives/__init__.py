"""What each training objective needs from the data side, found by name.

:mod:`.base` holds the protocol (:class:`~.base.DataObjective`) and the registry; one module
per objective implements it: :mod:`.lm` (next-token), :mod:`.dflash` (a DFlash drafter:
anchors :mod:`.anchors` and their digest :mod:`.anchor_digest`, step cost
:mod:`.drafter_cost`), :mod:`.dflash2` (DFlash's variant: its options and cost extended) and
:mod:`.eagle3` (an EAGLE-3 drafter: varlen, its step cost, the draft vocabulary map). An objective's options are one frozen dataclass whose fields are
declared with :func:`.options.option`; the ``pack`` / ``analyze`` flags, ``cli_flags`` and
the manifest header section follow from it. Importing this package registers all four; a new
objective calls :func:`register` with its own instance.
"""

from dflash_prep.objectives.base import (DataObjective, get, names, of_header, register, registered, served,
                                         state_readers)
from dflash_prep.objectives.dflash import DFlashObjective
from dflash_prep.objectives.dflash2 import DFlash2Objective
from dflash_prep.objectives.eagle3 import Eagle3Objective
from dflash_prep.objectives.lm import LMObjective

register(LMObjective())
register(DFlashObjective())
register(DFlash2Objective())
register(Eagle3Objective())

__all__ = ["DataObjective", "get", "names", "of_header", "register", "registered", "served", "state_readers"]
