"""The LM objective's trainer side: next-token loss on the model being trained.

- :mod:`.options`: its trainer options (``--init-from``);
- :mod:`.model`: the small Llama-style :class:`~.model.Decoder` (``--model tiny`` / ``100m``);
- :mod:`.objective`: :class:`~.objective.LMObjective` (the loop's protocol) and its builder.
"""

from dflash_prep.train.objectives.lm.objective import LMObjective, build_lm
from dflash_prep.train.objectives.lm.options import LMTrainOptions
from dflash_prep.train.objectives.registry import TrainerSpec

SPEC = TrainerSpec("lm", LMTrainOptions, build_lm)

__all__ = ["SPEC", "LMObjective", "LMTrainOptions", "build_lm"]
