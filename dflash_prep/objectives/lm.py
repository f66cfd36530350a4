"""``pack --objective lm`` (the default): next-token training, token (or cost) budgets.

The padded layout buckets by length (:func:`dflash_prep.pack.bucketing.pack_padded`), the
varlen layout first-fits concatenated documents (:func:`dflash_prep.pack.bucketing.pack_varlen`);
ranks are balanced on the definitions' cost ``L + alpha L^2``. These are the defaults of
:class:`dflash_prep.objectives.base.DataObjective`: this objective changes none of them.
"""

from __future__ import annotations

from dflash_prep.objectives.base import DataObjective


class LMObjective(DataObjective):
    """Next-token loss on every supervised token: no options, no extra arrays or checks."""

    name = "lm"
