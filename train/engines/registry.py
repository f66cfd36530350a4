"""The trainer side of a serving engine: what ``--target-engine NAME`` trains from, found by name.

An engine registers one :class:`TrainerEngine` (:func:`register`): the taps provider it builds for
a drafter rank (a states cache it wrote, or the target running in it online) and the section of a
``dflash-prep evaluate`` report its counters are in (what ``--eval-every`` logs). The data side of
the same name is :mod:`dflash_prep.engine.backends` (its venv, server, worker, version).

``hf`` (:data:`BUILTIN`) is no engine: the transformers target in this process or on a split
job's target ranks (:mod:`dflash_prep.train.target`). The core (:mod:`dflash_prep.train.config`,
:func:`dflash_prep.train.target.target_provider`, :mod:`dflash_prep.train.engine_eval`) asks only
this module; it never tests which engine runs. Importing it imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from dflash_prep.engine import backends
from dflash_prep.engine.backends.base import Registry

BUILTIN = "hf"
"""``--target-engine hf``: the transformers target, no serving engine."""


@dataclass(frozen=True)
class TrainerEngine:
    """One engine's trainer side."""

    name: str
    """``--target-engine NAME``; the data side's :class:`~dflash_prep.engine.backends.base.Backend`
    of the same name gives its label, venv and worker."""
    taps: Callable[..., Any]
    """``taps(cfg, ds, layer_ids, *, final, identity, device) -> provider``: this drafter rank's
    target hidden states (the ``taps(b, *, epoch, final)`` seam of :mod:`dflash_prep.train.split.taps`),
    read from ``--states`` when the run names a cache, else computed by the engine online."""
    report_section: str
    """The key of a ``dflash-prep evaluate`` report holding the engine's counters (``tau``)."""

    @property
    def label(self) -> str:
        return backends.get(self.name).label


REGISTRY = Registry(lambda name, known: f"--target-engine must be one of {', '.join((BUILTIN, *known))}, "
                                        f"got {name!r}")
register, get, names = REGISTRY.register, REGISTRY.get, REGISTRY.names


def flags() -> str:
    """``--target-engine vllm`` (joined with `` or `` when several engines are registered)."""
    return " or ".join(f"--target-engine {n}" for n in names())


def labels() -> str:
    """``vLLM`` (joined with `` or `` when several engines are registered)."""
    return " or ".join(get(n).label for n in names())
