"""The EAGLE-3 objective's trainer side (docs/eagle3.md).

- :mod:`.options`: :class:`~.options.Eagle3TrainOptions`;
- :mod:`.model`: :class:`~.model.Eagle3Drafter` (fc over three taps, one decoder layer on
  ``[embedding, hidden]``, a head over the draft vocabulary) and its training-time test;
- :mod:`.objective`: micro-batches, the TTT loss and metrics, the builder;
- :mod:`.export`: the folder vLLM and SGLang load (``LlamaForCausalLMEagle3``);
- :mod:`.decode`: chain drafting at temperature 0 for :mod:`dflash_prep.train.speculate`.

A split job's target rank is DFlash's worker with this objective's plan (the three taps and the
final hidden states; the head runs on the drafter rank).
"""

from functools import partial

from dflash_prep.train.objectives.eagle3 import decode
from dflash_prep.train.objectives.eagle3.objective import Eagle3Objective, build, export_checkpoint, plan
from dflash_prep.train.objectives.eagle3.options import Eagle3TrainOptions
from dflash_prep.train.objectives.registry import TrainerSpec
from dflash_prep.train.split.worker import serve

SPEC = TrainerSpec("eagle3", Eagle3TrainOptions, build, serve=partial(serve, plan=plan), export=export_checkpoint,
                   architectures=("LlamaForCausalLMEagle3",), decode=decode.load)

__all__ = ["SPEC", "Eagle3Objective", "Eagle3TrainOptions", "build"]
