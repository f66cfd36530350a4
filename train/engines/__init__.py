"""Where a drafter's target hidden states come from when a serving engine computes them.

:mod:`.registry` holds the protocol (:class:`~.registry.TrainerEngine`) and the registry; one
module per engine fills it in: :mod:`.vllm`. Importing this package registers them; a second
engine is one more module here and one line below, beside its data side in
:mod:`dflash_prep.engine.backends` (docs/engines.md#adding-an-engine).
"""

from dflash_prep.train.engines.registry import BUILTIN, TrainerEngine, flags, get, labels, names, register
from dflash_prep.train.engines.vllm import VLLM

register(VLLM)

__all__ = ["BUILTIN", "TrainerEngine", "flags", "get", "labels", "names", "register"]
