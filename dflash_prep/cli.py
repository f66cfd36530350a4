"""The ``dflash-prep`` command line: parse options, call one library function, print.

Each command imports its stage lazily so that ``dflash-prep --help`` starts fast and no
command that does not train imports torch or triton. Domain errors (:class:`DflashError`)
become a one-line red message and exit code 1, never a traceback.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from .errors import DflashError

app = typer.Typer(
    name="dflash-prep",
    help="Offline batching for LLM/drafter training: synth -> tokenize -> analyze -> pack -> inspect/verify.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _friendly(fn):
    """Turn DflashError into a clear message and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DflashError as e:
            typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
            raise typer.Exit(1) from None

    return wrapper


def command(*args, **kwargs):
    """``@app.command`` plus friendly errors."""

    def deco(fn):
        return app.command(*args, **kwargs)(_friendly(fn))

    return deco


# --- synth / tokenize (dflash_prep.synth, dflash_prep.tokenize) -----------------------


# --- analyze (dflash_prep.analyze) ---------------------------------------------------


# --- pack / inspect / verify (dflash_prep.pack, dflash_prep.manifest) ----------------


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
