"""``python -m dflash_prep.train.launch [torchrun options] -m dflash_prep.train [options]``.

torchrun, with failures that read as one line. torchrun itself answers a worker that exits
1 with its agent's log lines and a ``ChildFailedError`` traceback, even when the worker
already printed a clear user error. This launcher runs the same launcher code
(``torch.distributed.run``) in-process with the elastic agent's loggers quiet, and maps a
failure to exit code 1: a worker that stopped on a user error (exit 1) has printed its
one-line message, so nothing is added; any other failure (a signal, a crash) gets one line
naming the rank and the exit code. ``make train`` launches through here.
"""

from __future__ import annotations

import logging
import os
import sys

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
            print(f"error: training rank {rank} failed with {how} (its output is above)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
