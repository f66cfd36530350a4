"""The DFlash objective's trainer side: a drafter trained on a frozen target (docs/dflash.md).

- :mod:`.options`: its trainer options (:class:`~.options.DFlashTrainOptions`);
- :mod:`.drafter`: the drafter (the public DFlash architecture, packed);
- :mod:`.mask`: the run's mask token, chosen once and checked against the data;
- :mod:`.objective`: anchors -> blocks -> drafter -> loss, behind the loop's protocol;
- :mod:`.export`: the public DFlash folder and :func:`~.export.load_export`.

Its split-job target rank is :func:`dflash_prep.train.split.worker.serve`.
"""

from dflash_prep.train.objectives.dflash import decode
from dflash_prep.train.objectives.dflash.export import ARCHITECTURE, export_checkpoint
from dflash_prep.train.objectives.dflash.objective import DFlashObjective, build
from dflash_prep.train.objectives.dflash.options import DFlashTrainOptions
from dflash_prep.train.objectives.registry import TrainerSpec
from dflash_prep.train.split.worker import serve

SPEC = TrainerSpec("dflash", DFlashTrainOptions, build, serve=serve, export=export_checkpoint,
                   architectures=(ARCHITECTURE,), decode=decode.load)

__all__ = ["SPEC", "DFlashObjective", "DFlashTrainOptions", "build"]
