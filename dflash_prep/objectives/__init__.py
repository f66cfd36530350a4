"""What each training objective needs from the data side, found by name.

:mod:`.base` holds the protocol (:class:`~.base.DataObjective`) and the registry; one module
per objective implements it: :mod:`.lm` (next-token) and :mod:`.dflash` (a DFlash drafter:
anchors :mod:`.anchors` and their digest :mod:`.anchor_digest`, step cost
:mod:`.drafter_cost`). An objective's options are one frozen dataclass whose fields are
declared with :func:`.options.option`; the ``pack`` / ``analyze`` flags, ``cli_flags`` and
the manifest header section follow from it. Importing this package registers both; a new
objective calls :func:`register` with its own instance.
"""

from dflash_prep.objectives.base import DataObjective, get, names, of_header, register, registered
from dflash_prep.objectives.dflash import DFlashObjective
from dflash_prep.objectives.lm import LMObjective

register(LMObjective())
register(DFlashObjective())

__all__ = ["DataObjective", "get", "names", "of_header", "register", "registered"]
