"""The DFlash2 objective's trainer side: DFlash's, extended (docs/dflash.md#dflash2).

- :mod:`.options`: :class:`~.options.DFlash2TrainOptions`, DFlash's trainer options plus the
  convolutions, the selector and its loss;
- :mod:`.conv`: the grouped dynamic depthwise convolution around every sublayer;
- :mod:`.selector`: the candidate selector (unary top-K, edge scores, the greedy walk, its loss);
- :mod:`.drafter`: :class:`~.drafter.DFlash2Drafter`, DFlash's drafter with both;
- :mod:`.objective`: DFlash's objective plus the selector loss and metrics;
- :mod:`.export`: the ``DFlash2DraftModel`` folder vLLM, SGLang and z-lab's code load;
- :mod:`.decode`: the selector walk (and the plain argmax beside it) for :mod:`dflash_prep.train.speculate`.

Anchors, packing, manifests, target ranks (DFlash's target worker serves it unchanged), D-PACE,
KL, the window and Muon are DFlash's.
"""

from dflash_prep.train.objectives.dflash2 import decode
from dflash_prep.train.objectives.dflash2.export import ARCHITECTURE, export_checkpoint
from dflash_prep.train.objectives.dflash2.objective import DFlash2Objective, build_dflash2
from dflash_prep.train.objectives.dflash2.options import DFlash2TrainOptions
from dflash_prep.train.objectives.registry import TrainerSpec
from dflash_prep.train.split.worker import serve

SPEC = TrainerSpec("dflash2", DFlash2TrainOptions, build_dflash2, serve=serve, export=export_checkpoint,
                   architectures=(ARCHITECTURE,), decode=decode.load)

__all__ = ["SPEC", "DFlash2Objective", "DFlash2TrainOptions", "build_dflash2"]
