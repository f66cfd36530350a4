"""The run folder's own files: ``log.jsonl`` (:class:`RunLog`) and the ownership check.

``log.jsonl``: a header record (format ``dflash-prep/train-log`` version 1, the config, the
model, the run key) then one record per logged step; ``summary.json`` (format
``dflash-prep/train-summary``) is written by the loop at the end of a call.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from dflash_prep.errors import ConfigError
from dflash_prep.formats.fileio import atomic_write_bytes, strict_dumps

from dflash_prep.train import checkpoint as ckpt

LOG_FORMAT = "dflash-prep/train-log"
SUMMARY_FORMAT = "dflash-prep/train-summary"
TARGET_SUMMARY_FORMAT = "dflash-prep/train-target-summary"
"""``OUT/target-rank<global rank>.json``: a split job's target rank's summary (what it printed)."""
FORMAT_VERSION = 1


class RunLog:
    """Append-only JSONL on rank 0: a header record (format, version, config) then one per step.

    Each line is written and flushed whole, so a crash loses at most the line in flight.
    Records are strict JSON: a NaN/Infinity (the loss of a step with no targets) is written
    as null. A resumed run first drops, by an atomic rewrite, every record past the
    checkpoint's ``global_step`` (steps a killed run did after its last checkpoint, which the
    resumed run does again) and any torn last line, then appends below; so each global
    step appears once. ``--from-scratch`` starts a new file.
    """

    def __init__(self, path: Path, header: dict, *, fresh: bool, enabled: bool, keep_through: int | None = None):
        self.f = None
        self.dropped = 0
        if not enabled:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        if fresh or not path.exists():
            atomic_write_bytes(path, (strict_dumps({"format": LOG_FORMAT, "version": FORMAT_VERSION, **header})
                                      + "\n").encode())
        elif keep_through is not None:
            self.dropped = _trim_log(path, keep_through)
        self.f = open(path, "a")

    def write(self, rec: dict) -> None:
        if self.f:
            self.f.write(strict_dumps(finite(rec)) + "\n")
            self.f.flush()

    def close(self) -> None:
        if self.f:
            self.f.close()


def finite(rec: dict) -> dict:
    """``rec`` with every NaN / infinity replaced by None (strict JSON)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}


def _trim_log(path: Path, keep_through: int) -> int:
    """Keep the header and the records with ``global_step <= keep_through``; returns how many were dropped."""
    lines = path.read_bytes().split(b"\n")
    kept, dropped = [], 0
    for i, ln in enumerate(lines):
        if not ln.strip():
            continue
        try:
            rec = json.loads(ln)
        except ValueError:       # a line torn by a kill
            dropped += 1
            continue
        if i == 0 or not isinstance(rec, dict) or int(rec.get("global_step", -1)) <= keep_through:
            kept.append(ln)
        else:
            dropped += 1
    if dropped:
        atomic_write_bytes(path, b"\n".join(kept) + b"\n")
    return dropped


def check_run_folder(out: Path) -> None:
    """Refuse a run folder holding checkpoint.pt / log.jsonl / summary.json that this trainer did not write.

    ``log.jsonl`` (its first record carries our format) is the folder's ownership marker: a
    folder with our log is ours, and a corrupt checkpoint in it is reported by the loader."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder; it was left untouched. Choose another --out")
    lg = out / "log.jsonl"
    ours = False
    if lg.is_file():
        with open(lg, "rb") as f:
            first = f.readline()
        try:
            ours = json.loads(first).get("format") == LOG_FORMAT
        except (ValueError, AttributeError):
            ours = False
    if not ours:
        for name in ("log.jsonl", ckpt.CKPT_FILE, "summary.json"):
            p = out / name
            if p.exists() and not (name == ckpt.CKPT_FILE and ckpt.is_checkpoint(p)):
                raise ConfigError(f"{p} exists and was not written by this trainer; it was left untouched. Choose "
                                  "another --out")
