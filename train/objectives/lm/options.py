"""The LM objective's trainer options, declared once (:func:`dflash_prep.objectives.options.option`):
each field gives its flag (``--init-from``, panel ``Objective lm``) and its config-file key."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_prep.objectives.options import TRAIN, option


@dataclass(frozen=True)
class LMTrainOptions:
    """Next-token training of the small decoder (``--model``) or of a local transformers LM."""

    init_from: str = option("", commands=(TRAIN,), help="start from this local transformers causal-LM folder "
                            "instead of --model; the result is saved with save_pretrained (and its tokenizer) to "
                            "OUT/hf")

    #: the optimizer of the recipe when ``--optimizer`` is left empty
    optimizer = "adamw"
