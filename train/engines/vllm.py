"""``--target-engine vllm``: a drafter trained on the target's hidden states computed by vLLM.

With ``--states CACHE``: the cache ``dflash-prep extract`` built once with vLLM
(:func:`dflash_prep.train.cached_taps.cached_taps`; the target's layers are never loaded);
without: the target in vLLM beside each drafter rank, online
(:func:`dflash_prep.train.engine_taps.engine_taps`). ``--eval-every`` reads vLLM's tau from the
``vllm`` section of the evaluation report. vLLM's data side (venv, server, worker) is
:mod:`dflash_prep.engine.backends.vllm`.
"""

from __future__ import annotations

import os

from dflash_prep.train.engines.registry import TrainerEngine


def taps(cfg, ds, layer_ids, *, final: bool, identity: dict, device):
    """The cached or the online provider (module docstring)."""
    if cfg.states:
        from dflash_prep.train.cached_taps import cached_taps

        return cached_taps(cfg, ds, layer_ids, final=final, identity=identity, device=device)
    from dflash_prep.train.engine_taps import engine_taps

    return engine_taps(cfg, ds, layer_ids, final=final, identity=identity, device=device,
                       rank=int(os.environ.get("RANK", "0")))


VLLM = TrainerEngine(name="vllm", taps=taps, report_section="vllm")
