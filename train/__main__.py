"""``python -m dflash_prep.train``: parse options, build a :class:`TrainConfig`, call :func:`dflash_prep.train.loop.train`.

Launch one process per GPU with torchrun (``make train`` does, through
:mod:`dflash_prep.train.launch`, so a user error reads as one line)::

    torchrun --nproc_per_node 8 -m dflash_prep.train --data D --plan P --manifests M --model 100m
    # multi-node: the same on every node, plus torchrun's rendezvous flags, e.g.
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 \\
        --rdzv_id RUN -m dflash_prep.train ...

Options override a TOML ``--config`` file, which overrides the defaults.
"""

from __future__ import annotations

import inspect
import os
import re
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Annotated, Optional, Union, get_origin, get_type_hints

import typer
from rich.markup import escape

from dflash_prep.errors import DflashError
from dflash_prep.kernels.errors import AttentionError

from dflash_prep.train import config as config_mod
from dflash_prep.train.config import TrainConfig
from dflash_prep.train.loop import PeerStopped, train

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

#: command-line types of the TrainConfig field types that are not plain (a tuple of ints is
#: a repeated option); the dict of model overrides is the config file's [model] table only
_CLI_TYPES = {tuple[int, ...]: list[int], tuple[str, ...]: list[str]}


def _plain(doc: str) -> str:
    """A docstring as --help text: reST roles and literals unwrapped (``x`` and :mod:`x` -> x)."""
    return re.sub(r"(?::\w+:)?`+([^`]+)`+", lambda m: m.group(1).lstrip("~"), doc)


def _show(v) -> str:
    if isinstance(v, tuple):
        return " ".join(map(str, v)) or "none"
    return '""' if v == "" else str(v)


def _parameters() -> list[inspect.Parameter]:
    """One keyword parameter per TrainConfig field with a flag, typed and documented from the
    field (its docstring, default and panel): the flags are derived, never written here."""
    hints, docs = get_type_hints(TrainConfig), config_mod.field_help(TrainConfig)
    config = Annotated[Optional[Path], typer.Option(
        help=escape("A TOML file of TrainConfig fields and the objective's options, a [model] table for the "
                    "model; the flags override it."),
        rich_help_panel=config_mod.DATA)]
    out = [inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=config)]
    for f in fields(TrainConfig):
        if not f.metadata.get("cli", True):
            continue
        default = f.default if f.default is not MISSING else f.default_factory()
        t = _CLI_TYPES.get(hints[f.name], hints[f.name])
        decls = [f.metadata["flag"]] if f.metadata.get("flag") else []
        option = typer.Option(*decls, help=escape(f"{_plain(docs.get(f.name, ''))} [default: {_show(default)}]"),
                              rich_help_panel=f.metadata["panel"], show_default=False, metavar=f.metadata.get("metavar"))
        out.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                     annotation=Annotated[Optional[t], option]))
    for fl, panel in config_mod.registry().flags():     # each objective's own options, in its panel
        t = _CLI_TYPES.get(fl.type, fl.type)
        t = t if get_origin(t) is Union else Optional[t]
        shown = "unset" if fl.default is None else _show(fl.default)
        option = typer.Option(fl.spelling, help=escape(f"{_plain(fl.help)} [default: {shown}]"), metavar=fl.metavar,
                              rich_help_panel=panel, show_default=False)
        out.append(inspect.Parameter(fl.name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                     annotation=Annotated[t, option]))
    return out


def main(**options):
    """Train on the manifests, exactly in manifest order: the small decoder or a transformers LM
    (``--objective lm``), or a DFlash drafter on a frozen target (``--objective dflash``)."""
    config = options.pop("config", None)
    cli = {k: (tuple(v) if isinstance(v, list) else v) for k, v in options.items() if v not in (None, [], ())}
    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = config_mod.build(config, **cli)
        s = train(cfg)
    except (DflashError, AttentionError) as e:
        # one line per error: the rank that hit it speaks; ranks that only followed it stay quiet
        if not isinstance(e, PeerStopped):
            msg = " ".join(str(e).split("\n")) if len(str(e).splitlines()) <= 1 else str(e)
            saved = getattr(e, "dflash_saved", None)
            note = f" (progress saved in {saved}; rerun to resume)" if saved else ""
            typer.secho(f"error (rank {rank}): {msg}{note}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    except OSError as e:  # disk full, permission denied: the environment, not a bug
        typer.secho(f"error (rank {rank}): {e.filename + ': ' if e.filename else ''}{e.strerror or e}",
                    fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:  # SIGINT (Ctrl-C); engines it started are already stopped (engine/lifetime.py)
        typer.secho(f"interrupted (rank {rank}); rerun the same command to resume from the run's last checkpoint",
                    err=True)
        raise typer.Exit(130) from None
    if s.get("role") == "target":   # a split job's target rank (--target-ranks)
        typer.echo(f"target rank {s['rank']}: served drafter rank(s) {s['served']} for {s['steps']} steps, busy "
                   f"{100 * s['busy_share']:.1f}% of {s['time_s']:.1f} s, {s['bytes_sent'] / 2**20:,.1f} MiB sent")
    elif rank == cfg.target_ranks:   # drafter rank 0
        tau = f", tau {s['tau_first']:.3f} -> {s['tau_last']:.3f}" if s.get("tau_last") is not None else ""
        tau += f", {s['anchors_per_s']:,.0f} anchors/s" if s.get("anchors_per_s") is not None else ""
        typer.echo(f"done: {s['steps']} steps (global {s['global_step']}), loss {s['loss_first']:.4f} -> "
                   f"{s['loss_last']:.4f} ({'fell' if s['loss_fell'] else 'did NOT fall'}){tau}, "
                   f"{s['tokens_per_s']:,.0f} real tok/s, efficiency {s['efficiency']:.3f}, "
                   f"data wait {100 * s['data_wait_share']:.1f}%, summary in {Path(cfg.out) / 'summary.json'}"
                   if s["steps"] else f"nothing to do: the run is already at epoch {s['cursor']['epoch']} "
                   f"(global step {s['global_step']}); raise --epochs/--max-steps or pass --from-scratch")


main.__signature__ = inspect.Signature(_parameters())
main.__annotations__ = {p.name: p.annotation for p in main.__signature__.parameters.values()}
app.command()(main)

if __name__ == "__main__":
    app()
