"""Progress for long work: a live bar on a terminal, periodic plain log lines elsewhere.

On a terminal (stderr is a TTY) :func:`progress` shows a rich bar with the count, rate and
time left. Otherwise (make, CI, nohup, a log file) it writes one line to stderr at most every
``every_s`` seconds (``DFLASH_PROGRESS_EVERY``, default 10), plus a final line:

    pack: 3/10 epochs (30%), 0.4 epochs/s, 17 s left

``progress(enabled=False)`` does nothing. Every stage uses this one helper.
"""

from __future__ import annotations

import os
import sys
import time

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


def _eta(s: float) -> str:
    s = int(max(0, s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}" if s >= 60 else f"{s} s"


class _Lines:
    """Plain, throttled log lines on stderr."""

    def __init__(self, label: str, total: int, unit: str, every_s: float):
        self.label, self.total, self.unit, self.every_s = label, int(total), unit, every_s
        self.done = 0
        self.t0 = self.last = time.monotonic()

    def line(self) -> str:
        dt = max(1e-9, time.monotonic() - self.t0)
        rate = self.done / dt
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        left = f", {_eta((self.total - self.done) / rate)} left" if self.total and rate > 0 and self.done < self.total else ""
        return f"{self.label}: {self.done:,}/{self.total:,} {self.unit}{share}, {rate:,.1f} {self.unit}/s{left}"

    def advance(self, n: int = 1) -> None:
        self.done += int(n)
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            print(self.line(), file=sys.stderr, flush=True)

    def close(self) -> None:
        print(f"{self.label}: {self.done:,} {self.unit} done in {_eta(time.monotonic() - self.t0)}",
              file=sys.stderr, flush=True)


class _Bar:
    def __init__(self, label: str, total: int, unit: str):
        self.p = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
                          TimeRemainingColumn(), transient=True)
        self.t = self.p.add_task(label, total=total)
        self.p.start()

    def advance(self, n: int = 1) -> None:
        self.p.advance(self.t, n)

    def close(self) -> None:
        self.p.stop()


class _Off:
    def advance(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


class progress:  # noqa: N801 - used as a context manager, like open()
    """``with progress("pack", total=10, unit="epochs") as p: ... p.advance()``."""

    def __init__(self, label: str, total: int, unit: str = "items", *, enabled: bool = True,
                 every_s: float | None = None):
        if not enabled:
            self._impl = _Off()
        elif sys.stderr.isatty():
            self._impl = _Bar(label, total, unit)
        else:
            every = float(os.environ.get("DFLASH_PROGRESS_EVERY", "10")) if every_s is None else every_s
            self._impl = _Lines(label, total, unit, every)

    def advance(self, n: int = 1) -> None:
        self._impl.advance(n)

    def close(self) -> None:
        self._impl.close()

    def __enter__(self) -> "progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
