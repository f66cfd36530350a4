"""The trainer-side objective registry: what ``--objective NAME`` trains, found by name.

An objective registers one :class:`TrainerSpec` (:func:`register`): its options type (a frozen
dataclass declared with :func:`dflash_prep.objectives.options.option`, commands ``train``:
its fields are its flags, its config-file keys and their checks), the builder of its trainer
objective, and, for an objective trained on a frozen target, the entry point of a split job's
target rank. The data side of the same name is :mod:`dflash_prep.objectives`.

The core (:mod:`dflash_prep.train.config`, the command line, :mod:`dflash_prep.train.loop`) asks
only this module; it never tests which objective runs. This module imports nothing heavy, so
the config and the command line can read the options without building anything.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from dflash_prep.errors import ConfigError
from dflash_prep.objectives import options as option_decl


@dataclass(frozen=True)
class TrainerSpec:
    """One objective's trainer side."""

    name: str
    options: type
    """Its options (a frozen dataclass; every field declared for the ``train`` command)."""
    build: Callable[..., Any]
    """``build(cfg, ds, device, manifest, place=None) -> objective`` (the loop's protocol,
    :mod:`dflash_prep.train.objectives`); ``place`` is a split job's drafter rank."""
    serve: Callable[..., Any] | None = None
    """``serve(cfg, place, dist, source) -> summary``: a split job's target rank (None: the
    objective has no frozen target to put on ranks of its own)."""
    export: Callable[..., Any] | None = None
    """``export(checkpoint, path, out, *, dtype, overwrite) -> sidecar``: the folder an inference
    engine loads, from a loaded checkpoint (:mod:`dflash_prep.train.export`; None: the objective
    saves its model itself at the end of a run)."""
    architectures: tuple[str, ...] = ()
    """The ``architectures`` its exports declare in ``config.json`` (what
    :mod:`dflash_prep.train.speculate` dispatches on)."""
    decode: Callable[..., Any] | None = None
    """``decode(drafter_dir, target, *, block_size) -> ([(name, proposer), ...], meta)``: the
    drafting half of speculative decoding for such an export (:mod:`dflash_prep.train.speculate`)."""


_SPECS: dict[str, TrainerSpec] = {}


def register(spec: TrainerSpec) -> TrainerSpec:
    """Make ``--objective spec.name`` train with ``spec`` (a second spec of a name replaces it)."""
    _SPECS[spec.name] = spec
    return spec


def get(name: str) -> TrainerSpec:
    if name not in _SPECS:
        raise ConfigError(f"--objective must be one of {', '.join(_SPECS)}, got {name!r}")
    return _SPECS[name]


def specs() -> tuple[TrainerSpec, ...]:
    return tuple(_SPECS.values())


def option_names(spec: TrainerSpec) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(spec.options))


def owners(key: str) -> list[str]:
    """The objectives whose options have a field ``key``."""
    return [s.name for s in _SPECS.values() if key in option_names(s)]


def flags() -> list[tuple[option_decl.Flag, str]]:
    """Every objective option's flag once, with its ``--help`` panel: ``Objective NAME, ...``
    naming every objective that has it (a variant that extends another's options shares the
    parent's panel and adds its own fields to a panel of its own), in registration order."""
    seen, out = set(), []
    for s in _SPECS.values():
        for fl in option_decl.flags(s.options, option_decl.TRAIN):
            if fl.name not in seen:
                seen.add(fl.name)
                out.append((fl, fl.panel or f"Objective {', '.join(owners(fl.name))}"))
    return out


def build_options(name: str, values: dict):
    """The options of objective ``name`` from ``values`` (``{field: value}``; the rest take their
    defaults). A key that is another objective's option is refused, naming whose it is."""
    spec = get(name)
    mine = set(option_names(spec))
    foreign = sorted(k for k in values if k not in mine)
    if foreign:
        k = foreign[0]
        whose = owners(k)
        flag = "--" + k.replace("_", "-")
        if not whose:
            raise ConfigError(f"unknown training option {flag} ({k}); --objective {name}'s own are "
                              f"{', '.join(sorted(mine)) or 'none'}, and `python -m dflash_prep.train --help` lists all")
        raise ConfigError(f"{flag} is an option of --objective {', '.join(whose)}, and this run is --objective "
                          f"{name}: drop {flag} or pass --objective {' or '.join(whose)}")
    try:
        return spec.options(**values)
    except TypeError as e:
        raise ConfigError(f"bad --objective {name} option ({e})") from None
