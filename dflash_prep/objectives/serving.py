"""How an inference engine serves an objective's exports: what ``dflash-prep evaluate`` asks of it.

An objective whose exports an engine serves as a drafter sets ``DataObjective.serving`` to a
:class:`Serving`. The engine side asks it, never the objective's name: the export's
``architectures`` finds the objective (:func:`dflash_prep.objectives.base.served`), whose
:class:`Serving` says how many tokens a step drafts by default (:mod:`dflash_prep.engine.method`),
whether vLLM serves it only on its V2 model runner, and what in an export contradicts the target
(:mod:`dflash_prep.engine.load_check`); the report's table names it by :attr:`Serving.label`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Serving:
    """How an engine serves one objective's exports."""

    architecture: str
    """The ``architectures`` entry of its exports' ``config.json`` (what the engines dispatch on)."""
    label: str
    """Its name in the evaluation report's table (``DFlash``, ``EAGLE-3``)."""
    problems: Callable[[dict, int, Callable[[], dict]], list[str]]
    """``problems(config, num_target_layers, shapes)``: what in an export's ``config.json``
    contradicts an ``L``-layer target or the export itself (``shapes()``: tensor name -> shape of
    its ``model.safetensors``, read only when asked); said beside an engine's refusal, never a
    reason to refuse by itself."""
    chain_k: int | None = None
    """Chain drafting: ``num_speculative_tokens`` when none is asked (EAGLE-3: 7). None: block
    drafting, ``k = B - 1`` from the export's block size (vLLM runs one query for the bonus token
    and k mask queries)."""
    v2_runner_only: bool = False
    """vLLM serves it on its V2 model runner only (Triton; a GPU): DFlash2."""


def block_problems(c: dict, L: int, shapes: Callable[[], dict]) -> list[str]:
    """:attr:`Serving.problems` of a DFlash-format export: its ``dflash_config.target_layer_ids``
    (our ids, 0..L-1), each distinct."""
    ids = (c.get("dflash_config") or {}).get("target_layer_ids") or []
    out = []
    bad = [j for j in ids if not 0 <= int(j) < L]
    if bad:
        out.append(f"dflash_config.target_layer_ids {ids} reach outside the target's {L} layers (0..{L - 1})")
    if len(set(map(int, ids))) < len(ids):
        out.append(f"dflash_config.target_layer_ids {ids} repeat a layer: vLLM captures each layer once, so its "
                   f"fc gets fewer features than the drafter was trained on (train with distinct "
                   f"--target-layer-ids)")
    return out
