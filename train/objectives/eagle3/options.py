"""The EAGLE-3 objective's trainer options, declared once (:func:`dflash_prep.objectives.options.option`):
each field is its flag (panel ``Objective eagle3``), its config-file key and its check.

The draft vocabulary and the number of TTT steps are the manifest's (``pack --objective eagle3``
chose the vocabulary map and balanced ranks on that many passes); a value given here must agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dflash_prep.errors import ConfigError
from dflash_prep.objectives.options import TRAIN, option


def _train(default, help: str):
    return option(default, help=help, commands=(TRAIN,))


@dataclass(frozen=True)
class Eagle3TrainOptions:
    """An EAGLE-3 drafter on a frozen target (docs/eagle3.md)."""

    target: str = _train("", help="the frozen target, a local transformers causal-LM folder with its tokenizer "
                         "(required)")
    target_layer_ids: tuple[int, ...] = _train((), help="the three tapped target layers (0-based; the feature is "
                                               "each layer's output); empty = 1, N/2 - 1, N - 4 of an N-layer target "
                                               "(the engines' default); two equal ids are refused, so a small target "
                                               "needs explicit ids")
    ttt_steps: int | None = _train(None, help="training-time-test steps: drafter passes per position, each fed the "
                                   "previous pass's output; unset = the manifest's (pack --objective eagle3 --ttt-steps, "
                                   "default 7)")
    ttt_decay: float = _train(0.8, help="weight of step i is decay**i")
    draft_vocab_size: int | None = _train(None, help="the draft vocabulary's size; unset = the manifest's map (pack "
                                          "--objective eagle3 --draft-vocab-size); a value that contradicts it is "
                                          "refused")

    #: the optimizer of the recipe when ``--optimizer`` is left empty (SpecForge's)
    optimizer = "adamw"

    def __post_init__(self):
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if not self.target:
            raise ConfigError("--objective eagle3 needs --target DIR (a local transformers causal-LM folder)")
        if self.target_layer_ids and len(self.target_layer_ids) != 3:
            raise ConfigError(f"--target-layer-ids: EAGLE-3 taps exactly three layers, got {list(self.target_layer_ids)}")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise ConfigError(f"--target-layer-ids {list(self.target_layer_ids)}: two taps coincide; pass three "
                              "distinct layers")
        if self.ttt_steps is not None and self.ttt_steps < 1:
            raise ConfigError(f"--ttt-steps must be >= 1, got {self.ttt_steps}")
        d = self.ttt_decay
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not math.isfinite(d) or not 0 < d <= 1:
            raise ConfigError(f"--ttt-decay must be in (0, 1], got {d!r}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ConfigError(f"--draft-vocab-size must be >= 1, got {self.draft_vocab_size}")
