"""An objective's options, declared once: fields of a frozen dataclass, and what is derived from them.

An objective's options type (``DataObjective.options_type``) is a frozen dataclass. Each field
that a command sets is declared with :func:`option`: its default, its help and the commands it
belongs to (``pack``, ``analyze``). From those declarations come

- the command-line flags (:func:`flags`: the CLI adds one typer option per :class:`Flag` to
  the commands, in a ``--help`` panel per objective);
- the options a command's values build (:func:`from_flags`);
- the flags that reproduce an options object (:func:`to_flags`, the inverse of
  :func:`from_flags`, e.g. for the trainer's "re-pack with" messages);
- the manifest header's section of the options (:func:`header`, the fields declared with
  ``header=True``, and :func:`from_header` back).

A field whose value comes from several flags (the DFlash cost model: a config file or sizes,
plus the drafter's layers and window) declares those :class:`Flag` s and the two conversions
(``build``: flag values -> field value; ``spell``: field value -> flag values). A field
declared with a plain ``dataclasses.field`` (or none) is not an option of any command.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Callable

from dflash_prep.errors import ConfigError

PACK, ANALYZE, TRAIN = "pack", "analyze", "train"


@dataclass(frozen=True)
class Flag:
    """One command-line option: ``--name-with-dashes``, its Python type, default and help, and
    its ``--help`` panel (None: the objective's, ``Objective NAME``)."""

    name: str
    type: Any
    default: Any
    help: str
    metavar: str | None = None
    panel: str | None = None

    @property
    def spelling(self) -> str:
        return "--" + self.name.replace("_", "-")


def option(default=MISSING, *, help: str, commands: tuple[str, ...] = (PACK, ANALYZE), flag: str | None = None,
           panel: str | None = None, header: bool = False, metavar: str | None = None, flags: tuple[Flag, ...] = (),
           build: Callable[..., Any] | None = None, spell: Callable[[Any], dict] | None = None):
    """A field of an options dataclass that ``commands`` set (module docstring).

    ``flag``: the flag's name when not the field's (``"toy_weight"`` for ``--toy-weight``);
    ``panel``: its ``--help`` panel when not the objective's;
    ``header``: the manifest header's section records the value; ``flags``/``build``/``spell``:
    a field set through several flags (all three together)."""
    if bool(flags) != (build is not None) or bool(flags) != (spell is not None):
        raise TypeError("option(): flags, build and spell go together")
    meta = {"help": help, "commands": tuple(commands), "flag": flag, "panel": panel, "header": header,
            "metavar": metavar, "flags": tuple(flags), "build": build, "spell": spell}
    return dataclasses.field(default=default, metadata={"option": meta})


def _declared(cls) -> list[tuple[dataclasses.Field, dict]]:
    return [(f, f.metadata["option"]) for f in dataclasses.fields(cls) if "option" in f.metadata]


def _plain_type(hint):
    """``X | None`` as ``Optional[X]`` (what typer reads)."""
    if isinstance(hint, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return typing.Optional[args[0]] if len(args) == 1 else hint
    return hint


def _field_flags(cls, f: dataclasses.Field, meta: dict) -> tuple[Flag, ...]:
    if meta["flags"]:
        return meta["flags"]
    hint = _plain_type(typing.get_type_hints(cls)[f.name])
    return (Flag(meta["flag"] or f.name, hint, f.default, meta["help"], meta["metavar"], meta["panel"]),)


def flags(cls, command: str) -> list[Flag]:
    """The flags of options type ``cls`` that ``command`` takes, in declaration order."""
    return [fl for f, meta in _declared(cls) if command in meta["commands"] for fl in _field_flags(cls, f, meta)]


def from_flags(cls, command: str, values: dict):
    """``cls`` from ``command``'s flag values (``{flag name: value}``; a flag left out takes its
    default); fields ``command`` does not set keep theirs."""
    kwargs = {}
    for f, meta in _declared(cls):
        if command not in meta["commands"]:
            continue
        got = {fl.name: values.get(fl.name, fl.default) for fl in _field_flags(cls, f, meta)}
        kwargs[f.name] = meta["build"](**got) if meta["build"] else got[meta["flag"] or f.name]
    return cls(**kwargs)


def to_flags(options, command: str = PACK) -> str:
    """The ``command`` flags that rebuild ``options`` (:func:`from_flags` of them gives it back);
    a None value or a False switch is left out."""
    out = []
    for f, meta in _declared(type(options)):
        if command not in meta["commands"]:
            continue
        value = getattr(options, f.name)
        spelled = meta["spell"](value) if meta["spell"] else {meta["flag"] or f.name: value}
        for fl in _field_flags(type(options), f, meta):
            v = spelled.get(fl.name)
            if v is None or v is False:
                continue
            out.append(fl.spelling if v is True else f"{fl.spelling} {v:g}" if isinstance(v, float)
                       else f"{fl.spelling} {v}")
    return "".join(" " + s for s in out)


def shared_help(cls, name: str, unset, otherwise: str | None = None) -> str:
    """The help of a trainer option that sets field ``name`` of ``cls`` (the same option, read
    from a manifest when left ``unset``): the field's help, what ``unset`` means, and the
    field's default (or ``otherwise``) when there is no manifest to read."""
    f = next(f for f, _ in _declared(cls) if f.name == name)
    shown = "unset" if unset is None else '""' if unset == "" else unset
    return (f"{f.metadata['option']['help']}; {shown} = the manifest's (pack --objective dflash), else "
            f"{otherwise or f.default}")


def header(options) -> dict:
    """The fields declared ``header=True``, by name: the options' part of the manifest header."""
    return {f.name: getattr(options, f.name) for f, meta in _declared(type(options)) if meta["header"]}


def from_header(cls, section: dict, **others):
    """``cls`` from a manifest header section (:func:`header`), plus ``others``."""
    try:
        got = {f.name: section[f.name] for f, meta in _declared(cls) if meta["header"]}
    except KeyError as e:
        raise ConfigError(f"manifest header: the objective's section lacks {e}; re-pack the epoch") from None
    return cls(**got, **others)
