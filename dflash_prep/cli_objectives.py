"""The objectives' options on the ``dflash-prep`` command line (``pack``, ``analyze``).

Each registered data-side objective declares its options once (:mod:`dflash_prep.objectives.options`);
:class:`WithObjectiveOptions` turns them into one typer option per flag, in a ``--help`` panel per
objective, and hands the command the flags given on the command line; :class:`ObjectiveCommand`
builds them only when the command is parsed or shown, so ``dflash-prep --help`` and every other
command never import the objective registry (numba behind it).
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Annotated

import typer
import typer.core
from typer.main import get_command_from_info
from typer.models import CommandInfo


class WithObjectiveOptions:
    """Command ``name``, with one option per flag that a registered objective declares for it
    (:mod:`dflash_prep.objectives.options`), in a ``--help`` panel per objective. The flags are
    read when the command is first parsed or shown (:class:`ObjectiveCommand`), so an objective
    registered after this module is imported shows too, and a run of another command, or
    ``dflash-prep --help``, never imports the objectives (numba behind them). The command function gets them as ``objective_flags`` (by flag name):
    the flags given on the command line only, so the chosen objective's own defaults fill the
    rest. Objectives may share a flag (a variant inherits its parent's, or two read the same
    model sizes): it shows once, in a panel naming every objective that declares it, with the
    first one's default and help plus any other default, e.g. ``(--objective dflash2: 8)``."""

    def __init__(self, fn, name: str):
        self._fn, self._name = fn, name
        self.__name__, self.__doc__, self.__module__ = fn.__name__, fn.__doc__, fn.__module__
        self.expanded = False
        """False while typer builds the app: the signature holds the command's own options only."""

    def _flags(self) -> list[tuple[list[str], object]]:
        """``(the objectives that declare it, the flag as shown)`` per flag name, in registration order."""
        from dflash_prep import objectives
        from dflash_prep.objectives import options

        seen: dict[str, tuple[list[str], object]] = {}
        for obj in objectives.registered():
            for fl in options.flags(obj.options_type, self._name) if obj.options_type else ():
                if fl.name not in seen:
                    seen[fl.name] = ([obj.name], fl)
                    continue
                owners, shown = seen[fl.name]
                if fl.type != shown.type:
                    raise TypeError(f"objectives {owners[0]} and {obj.name} both declare {fl.spelling}, of other types")
                owners.append(obj.name)
                if fl.default != shown.default:         # shown.default stays the first one's
                    note = f"{shown.help} (--objective {obj.name}: {fl.default})"
                    seen[fl.name] = (owners, replace(shown, help=note))
        return list(seen.values())

    @property
    def __signature__(self) -> inspect.Signature:
        own = [p for p in inspect.signature(self._fn, eval_str=True).parameters.values() if p.name != "objective_flags"]
        extra = []
        for owners, fl in self._flags() if self.expanded else ():
            decls = [fl.spelling] if fl.type is bool else []
            opt = typer.Option(*decls, help=fl.help, metavar=fl.metavar,
                               rich_help_panel=fl.panel or f"Objective {', '.join(owners)}")
            extra.append(inspect.Parameter(fl.name, inspect.Parameter.KEYWORD_ONLY, default=fl.default,
                                           annotation=Annotated[fl.type, opt]))
        ctx = inspect.Parameter("objective_ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)
        return inspect.Signature(own + extra + [ctx])      # typer passes the context: which flags were given

    @property
    def __annotations__(self) -> dict:
        return {p.name: p.annotation for p in self.__signature__.parameters.values()}

    def __call__(self, **kwargs):
        ctx = kwargs.pop("objective_ctx", None)
        chosen, flags = kwargs.get("objective"), {}
        for owners, fl in self._flags():
            value = kwargs.pop(fl.name, fl.default)
            src = ctx.get_parameter_source(fl.name) if ctx is not None else None
            given = src is not None and src.name != "DEFAULT" if ctx is not None else value != fl.default
            if not given:
                continue
            if chosen not in owners:              # another objective's flag, set: refused, not ignored
                raise typer.BadParameter(f"{fl.spelling} is an option of --objective {' or '.join(owners)}, not of "
                                         f"--objective {chosen}; pass --objective {owners[0]}, or drop {fl.spelling}")
            flags[fl.name] = value
        return self._fn(**kwargs, objective_flags=flags)


class ObjectiveCommand(typer.core.TyperCommand):
    """A typer command whose objective options are built when click first asks for its
    ``params`` or ``callback`` (parsing it, or its ``--help``), not when the app is built:
    typer builds every command for any invocation, and the objectives' flags import the
    objective registry, whose packers import numba (0.45 s of a 0.6 s ``dflash-prep --help``)."""

    def __init__(self, *args, source: WithObjectiveOptions, pretty_exceptions_short: bool, **kwargs):
        self._source, self._short, self._full = source, pretty_exceptions_short, None
        super().__init__(*args, **kwargs)

    def _built(self) -> typer.core.TyperCommand:
        if self._full is None:
            self._source.expanded = True
            self._full = get_command_from_info(
                CommandInfo(name=self.name, callback=self._source, help=self.help, epilog=self.epilog,
                            short_help=self.short_help, options_metavar=self.options_metavar,
                            add_help_option=self.add_help_option, no_args_is_help=self.no_args_is_help,
                            hidden=self.hidden, deprecated=self.deprecated, rich_help_panel=self.rich_help_panel,
                            context_settings=None),
                pretty_exceptions_short=self._short, rich_markup_mode=self.rich_markup_mode)
        return self._full

    params = property(lambda self: self._built().params, lambda self, _own: None)
    callback = property(lambda self: self._built().callback, lambda self, _own: None)
