"""EAGLE-3's data-side options: ``pack`` / ``analyze --objective eagle3``, declared once.

The cost model's target sizes come as DFlash's do, from exactly one of ``--target-config``
(a transformers config.json) or ``--target-dims`` (the flags are shared with dflash on the
command line); ``--draft-vocab-size`` and ``--ttt-steps`` complete the step cost
(:class:`~dflash_prep.objectives.drafter_cost.Eagle3CostModel`) and are recorded in the
manifest's ``eagle3`` section. The drafter itself is fixed by EAGLE-3: an fc over three
tapped target layers (3H -> H), one decoder layer, an LM head over the draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dflash_prep.errors import ConfigError
from dflash_prep.objectives.drafter_cost import Eagle3CostModel
from dflash_prep.objectives.options import Flag, option
from dflash_prep.objectives.target_sizes import TargetSizes

#: EAGLE-3's published drafter: a 32K draft vocabulary, 7 training-time-test passes.
DEFAULT_DRAFT_VOCAB = 32000
DEFAULT_TTT_STEPS = 7


def target_sizes_from_flags(target_config: Path | None, target_dims: str | None) -> TargetSizes:
    """The target's sizes from exactly one of ``--target-config`` or ``--target-dims``."""
    if (target_config is None) == (target_dims is None):
        raise ConfigError("--objective eagle3 needs the cost model's sizes from exactly one of --target-config DIR "
                          "(a transformers config.json) or --target-dims hidden=...,layers=...")
    return TargetSizes.from_config(target_config) if target_config is not None else TargetSizes.from_dims(target_dims)


def _spell_sizes(sizes: TargetSizes | None) -> dict:
    return {} if sizes is None else {"target_dims": ",".join(f"{k}={v}" for k, v in sizes.sizes().items())}


_TARGET_FLAGS = (
    Flag("target_config", Optional[Path], None, "cost model: the target's folder or config.json"),
    Flag("target_dims", Optional[str], None, "cost model, the target's sizes as name=value pairs joined by commas: "
         "hidden, layers, intermediate, heads, kv_heads, head_dim, vocab", metavar="SIZES"))


@dataclass(frozen=True)
class Eagle3Options:
    """The options of ``pack`` / ``analyze --objective eagle3``; ``cost_model`` (the target's
    sizes) is required by ``pack`` and ``analyze``."""

    cost_model: TargetSizes | None = option(None, help="the target's sizes of the step cost", flags=_TARGET_FLAGS,
                                            build=target_sizes_from_flags, spell=_spell_sizes)
    draft_vocab_size: int = option(DEFAULT_DRAFT_VOCAB, header=True, help="V_d, the draft vocabulary: the V_d ids the "
                                   "loss trains on most (a tie: the lower id), from DATA/token_counts.npy")
    ttt_steps: int = option(DEFAULT_TTT_STEPS, header=True, help="drafter passes over every position per step "
                            "(training-time test): the step cost's drafter share")

    def __post_init__(self):
        if self.draft_vocab_size < 1:
            raise ConfigError(f"--draft-vocab-size must be >= 1, got {self.draft_vocab_size}")
        if self.ttt_steps < 1:
            raise ConfigError(f"--ttt-steps must be >= 1, got {self.ttt_steps}")
        self.step_cost_model()              # the draft vocabulary fits the target's

    def step_cost_model(self) -> Eagle3CostModel | None:
        """The EAGLE-3 step cost of these sizes (None without the target's)."""
        if self.cost_model is None:
            return None
        return Eagle3CostModel(**self.cost_model.sizes(), draft_vocab=self.draft_vocab_size, ttt_steps=self.ttt_steps)

    def resolve(self) -> "Eagle3Options":
        if self.cost_model is None:
            raise ConfigError("--objective eagle3 needs the model sizes of its cost model: --target-config DIR (a "
                              "transformers config.json) or --target-dims hidden=...,layers=...")
        return self

    @classmethod
    def from_json(cls, d: dict) -> "Eagle3Options":
        d = dict(d)
        if d.get("cost_model") is not None:
            d["cost_model"] = TargetSizes(**d["cost_model"])
        return cls(**d)
