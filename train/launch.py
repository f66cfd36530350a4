"""``python -m dflash_prep.train.launch [torchrun options] -m dflash_prep.train [options]``.

torchrun, with failures that read as one line. torchrun itself answers a worker that exits
1 with its agent's log lines and a ``ChildFailedError`` traceback, even when the worker
already printed a clear user error. This launcher runs the same launcher code
(``torch.distributed.run``) in-process with the elastic agent's loggers quiet, and maps a
failure to exit code 1: a worker that stopped on a user error (exit 1) has printed its
one-line message, so nothing is added; any other failure (a signal, a crash) gets one line
naming the rank, its role in a split job (``target rank 0``, ``drafter rank 1``: global ranks
``0..K-1`` are target ranks, from ``--target-ranks K`` or the ``--config`` file's
``target_ranks``), the exit code, and, when ``--out`` holds an intact checkpoint, its global
step and the command that resumes from it (this one, without ``--from-scratch``).
``make train`` launches through here.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import tomllib
from pathlib import Path

from dflash_prep.errors import DflashError

QUIET = ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets, without its banner
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode != 1:
            how = f"signal {-failure.exitcode}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
            print(f"error: {_role(rank, args.training_script_args)} failed with {how} (its output is above)"
                  f"{_resume_hint(sys.argv[1:] if argv is None else argv, args.training_script_args)}",
                  file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def _flag(args: list[str], name: str) -> str | None:
    """The last value of ``--name V`` or ``--name=V`` in the training arguments, or None."""
    val = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            val = args[i + 1]
        elif a.startswith(name + "="):
            val = a.split("=", 1)[1]
    return val


def _target_ranks(args: list[str]) -> int:
    """K from ``--target-ranks`` (which wins) or the ``--config`` file's ``target_ranks``; 0 when neither says."""
    k = _flag(args, "--target-ranks")
    if k is None and _flag(args, "--config"):
        try:
            k = tomllib.loads(Path(_flag(args, "--config")).read_text()).get("target_ranks")
        except (OSError, ValueError):
            k = None
    try:
        return int(k or 0)
    except (TypeError, ValueError):
        return 0


def _role(rank: int, args: list[str]) -> str:
    """``target rank k`` / ``drafter rank i (global rank g)`` in a split job, ``training rank g`` otherwise."""
    k = _target_ranks(args)
    if k <= 0:
        return f"training rank {rank}"
    return f"target rank {rank}" if rank < k else f"drafter rank {rank - k} (global rank {rank})"


def _resume_hint(argv: list[str], args: list[str]) -> str:
    """``; resume from global step N of OUT/checkpoint.pt with: python -m ...`` when ``--out`` holds an
    intact checkpoint (its SHA-256 trailer checked), else nothing."""
    from dflash_prep.train import checkpoint as ckpt

    out = _flag(args, "--out")
    path = Path(out) / ckpt.CKPT_FILE if out else None
    if path is None or not path.is_file():
        return ""
    try:
        step = int(ckpt.load(path)["cursor"]["global_step"])
    except (DflashError, OSError, KeyError, TypeError, ValueError):
        return ""
    again = [a for a in argv if a != "--from-scratch"]
    return f"; resume from global step {step} of {path} with: python -m dflash_prep.train.launch {shlex.join(again)}"


if __name__ == "__main__":
    sys.exit(main())
