"""A toy objective, registered from the test folder only: the seam core modules never name.

Data side: varlen only, one option (``weight``: ``pack --toy-weight``, declared with
:func:`dflash_prep.objectives.options.option`), a ``toy`` header section with the weight
and the rows' token total, a summary entry, and a verify check of that section. Trainer
side: the LM objective on the small decoder, its per-token loss scaled by ``weight``, and a
log field of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash_prep.errors import ConfigError
from dflash_prep.objectives import DataObjective, options, register
from dflash_prep.objectives.options import PACK, option


@dataclass(frozen=True)
class ToyOptions:
    """Its one option, declared as the built-in objectives declare theirs: ``pack --toy-weight``,
    recorded in the manifest header's ``toy`` section."""

    weight: float = option(1.0, commands=(PACK,), flag="toy_weight", header=True,
                           help="scales the toy loss (recorded in the manifest header)")

    def __post_init__(self):
        if not self.weight > 0:
            raise ConfigError(f"toy weight must be > 0, got {self.weight}")

    @classmethod
    def from_json(cls, d: dict) -> "ToyOptions":
        return cls(**d)


class ToyObjective(DataObjective):
    name = "toy"
    layouts = ("varlen",)
    options_type = ToyOptions

    def finish_epoch(self, state, cfg, epoch, arrays, header, summary, rows, dataset) -> None:
        header[self.name] = {**options.header(cfg.options), "tokens": int(np.sum(rows.real))}
        summary["toy_rows"] = int(len(rows.start))

    def verify(self, m, lens, ids, offsets, src):
        got = int(np.asarray(lens)[ids].sum())
        recorded = m.header[self.name]["tokens"]
        problems = [] if recorded == got else [f"toy header says {recorded} tokens, the rows hold {got}"]
        return problems, {"toy_rows": int(len(offsets) - 1)}, None


def register_toy() -> None:
    """Both sides under the name ``toy`` (idempotent; the trainer side needs torch)."""
    from dflash_prep.train.objectives.lm.model import Decoder
    from dflash_prep.train.objectives import LMObjective, TrainerSpec, register as register_trainer
    from dflash_prep.train.objectives.lm import LMTrainOptions
    from dflash_prep.train.source import tokenizer_field

    register(ToyObjective())       # the data side

    class ToyTrainer(LMObjective):
        name = "toy"

        def __init__(self, model, cfg, weight: float):
            super().__init__(model, cfg)
            self.weight = weight

        def loss(self, b, autocast):
            ls, st = super().loss(b, autocast)
            return ls * self.weight, st * self.weight

        def log_fields(self, st, dt):
            return {"toy_weight": self.weight}

        def contract(self):
            return {"objective": "toy", "weight": self.weight}

    def build(cfg, ds, device, manifest=None, place=None):
        weight = float(manifest.header["toy"]["weight"]) if manifest is not None else 1.0
        model = Decoder(cfg.model_config(int(tokenizer_field(ds, "vocab_size", 0)))).to(device)
        obj = ToyTrainer(model, cfg, weight)
        obj.pad_id = int(tokenizer_field(ds, "pad_id", 0))
        return obj

    register_trainer(TrainerSpec("toy", LMTrainOptions, build))      # the trainer side
