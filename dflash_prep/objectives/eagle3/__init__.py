"""The EAGLE-3 objective's data side: varlen packing, a step cost, and the draft vocabulary map.

- :mod:`dflash_prep.formats.token_counts`: the target-token counts of a dataset, counted once, kept in
  ``DATA/token_counts.npy``;
- :mod:`.vocab_map`: the draft vocabulary from them (``d2t``, ``t2d``); :func:`.vocab_map.load`
  reads an epoch's map for the trainer;
- :mod:`.options`: :class:`Eagle3Options` (``--draft-vocab-size``, ``--ttt-steps``, the target sizes);
- :mod:`.objective`: the plugin, :class:`Eagle3Objective`. docs/eagle3.md.
"""

from dflash_prep.objectives.eagle3.objective import Eagle3Objective
from dflash_prep.objectives.eagle3.options import Eagle3Options
from dflash_prep.objectives.eagle3.vocab_map import VocabMap, load as load_vocab_map

__all__ = ["Eagle3Objective", "Eagle3Options", "VocabMap", "load_vocab_map"]
