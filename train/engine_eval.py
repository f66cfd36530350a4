"""``--eval-every N``: the drafter evaluated in the serving engine while it trains.

Users report drafters whose training accuracy looks fine and whose acceptance, once served, is
near 1. This puts the engine's number beside the trainer's as the run goes, so the two diverging
shows at the step it starts, not after the run:

    step N (N % eval_every == 0, every rank)   the trainer saves its checkpoint (as --ckpt-every does)
    rank 0                                      links it to OUT/evals/step-NNNNNNN/checkpoint.pt and starts
                                                ``python -m dflash_prep.train.engine_eval`` there, in a
                                                process group of its own that dies with the trainer
                                                (:func:`dflash_prep.engine.lifetime.spawn`), and goes on training
    the background process                      exports the checkpoint (python -m dflash_prep.train.export),
                                                then runs ``dflash-prep evaluate`` on it: vLLM with and
                                                without the drafter, and our own evaluator, on --eval-prompts
                                                and --eval-bench's sets (--eval-n prompts each); its report is
                                                OUT/evals/step-NNNNNNN/eval.json
    every later step, rank 0                    polls (no wait); a finished evaluation becomes a log.jsonl
                                                record ``{"global_step": N, "eval": {"tau_engine", "tau_ours",
                                                "tau_train", "lossless", "per_set": {set: {"tau_engine",
                                                "tau_ours", "lossless"}}, ...}}``

One evaluation runs at a time: a step that falls due while one runs is recorded as skipped (an
engine start alone takes tens of seconds on a CPU; queueing would fall ever further behind). When
training ends the one in flight is waited for, at most ``FINAL_WAIT_S``, so its record is not lost.
``tau_train`` is the trainer's own expected tau at step N (the mean acceptance its per-slot
accuracies imply on training blocks); ``tau_engine`` is vLLM's, from its counters, on held-out
prompts, pooled over the sets (``per_set``: each set's own); ``tau_ours`` is our evaluator's on the
same prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from dflash_prep.engine import backends
from dflash_prep.engine.env import engine_python
from dflash_prep.engine.evaluate import evaluate_exports
from dflash_prep.engine.lifetime import Engine, spawn
from dflash_prep.errors import ConfigError, DflashError
from dflash_prep.evalsets import parse_benchmarks
from dflash_prep.train import engines
from dflash_prep.train.export import export

FINAL_WAIT_S = 1800.0
"""At the end of training, how long the evaluation in flight is waited for before it is stopped."""
EVAL_ENGINE = backends.DEFAULT
"""The engine the evaluation serves in (``dflash-prep evaluate``'s); its trainer side
(:mod:`dflash_prep.train.engines`) names the report section its tau is read from."""


def check(cfg, spec) -> None:
    """Refuse ``--eval-every`` where it cannot work, before the first step: an objective with no
    export, missing prompts, or no engine venv (one line each, with the fix)."""
    if not cfg.eval_every:
        return
    if spec.export is None:
        raise ConfigError(f"--eval-every evaluates a drafter export in the serving engine; an --objective "
                          f"{cfg.objective} run has none")
    if cfg.eval_prompts and not Path(cfg.eval_prompts).is_file():
        raise ConfigError(f"--eval-prompts {cfg.eval_prompts}: no such file")
    if cfg.eval_bench:
        parse_benchmarks(cfg.eval_bench)   # an unknown name: one line naming the shipped ones
    engine_python(EVAL_ENGINE)   # an EngineError naming `make venv-vllm` when the engine venv is missing


class EngineEvals:
    """Rank 0's evaluations of checkpoints in the engine, one background process at a time."""

    def __init__(self, out: Path, *, target: str, prompts: str, every: int, bench: str = "", n: int = 8,
                 ours: str = "auto"):
        self.root, self.target, self.prompts, self.every = Path(out) / "evals", target, prompts, every
        self.bench, self.n, self.ours = bench, n, ours
        self.proc: subprocess.Popen | None = None
        self.engine: Engine | None = None
        self.running: dict | None = None   # {"global_step", "dir", "tau_train", "t0"}

    def due(self, gstep: int) -> bool:
        return bool(self.every) and gstep % self.every == 0

    def start(self, gstep: int, checkpoint: Path, tau_train: float | None) -> dict | None:
        """Start evaluating ``checkpoint`` (the state after ``gstep``); a record to log when it is
        skipped because another evaluation still runs, else None."""
        if self.proc is not None and self.proc.poll() is None:
            return {"global_step": gstep, "eval": {"skipped": f"the evaluation of global step "
                                                              f"{self.running['global_step']} was still running"}}
        d = self.root / f"step-{gstep:07d}"
        if d.exists():   # a resumed run evaluates this step again, from its own checkpoint
            shutil.rmtree(d)
        d.mkdir(parents=True)
        try:
            os.link(checkpoint, d / "checkpoint.pt")   # the next save replaces checkpoint.pt by rename: this stays
        except OSError:
            shutil.copy2(checkpoint, d / "checkpoint.pt")
        cmd = [sys.executable, "-m", "dflash_prep.train.engine_eval", str(d), "--target", str(self.target),
               *(["--prompts", str(self.prompts)] if self.prompts else []),
               *(["--bench", self.bench, "--n", str(self.n)] if self.bench else []), "--ours", self.ours]
        with open(d / "engine_eval.log", "wb") as log:
            self.engine = spawn(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.proc = self.engine.proc
        self.running = {"global_step": gstep, "dir": d, "tau_train": tau_train, "t0": time.monotonic()}
        return None

    def poll(self) -> list[dict]:
        """The record of the evaluation that has finished since the last poll, if any (no wait)."""
        if self.proc is None or self.proc.poll() is None:
            return []
        return [self._finish()]

    def close(self, timeout_s: float = FINAL_WAIT_S) -> list[dict]:
        """At the end of training: wait for the evaluation in flight (at most ``timeout_s``), else stop it."""
        if self.proc is None:
            return []
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        self.engine.stop()   # SIGTERM: it stops its vLLM server first (lifetime.py); then SIGKILL
        return [self._finish()]

    def _finish(self) -> dict:
        self.engine.stop()   # done: its group (and the watchdog) gone, its handlers no longer needed
        run, rc = self.running, self.proc.returncode
        self.proc, self.engine, self.running = None, None, None
        d, seconds = run["dir"], round(time.monotonic() - run["t0"], 1)
        rec = {"tau_train": run["tau_train"], "seconds": seconds, "report": str(d / "eval.json")}
        if rc != 0 or not (d / "eval.json").is_file():
            lines = (d / "engine_eval.log").read_text(errors="replace").strip().splitlines()
            why = "stopped at the end of training" if rc is not None and rc < 0 else (lines[-1] if lines else f"exit {rc}")
            return {"global_step": run["global_step"], "eval": {**rec, "failed": why, "log": str(d / "engine_eval.log")}}
        r = json.loads((d / "eval.json").read_text())
        section = engines.get(EVAL_ENGINE).report_section
        e = r["exports"][0]
        per_set = {name: {"tau_engine": c[section]["tau"], "tau_ours": (c.get("ours") or {}).get("tau_pooled"),
                          "lossless": c["lossless"].get("ok"), "agree": (c.get("ours") or {}).get("agree")}
                   for name, c in e["sets"].items()}
        blocks = sum((c.get("ours") or {}).get("blocks") or 0 for c in e["sets"].values())
        ours = (sum(((c.get("ours") or {}).get("tau_pooled") or 0) * ((c.get("ours") or {}).get("blocks") or 0)
                    for c in e["sets"].values()) / blocks) if blocks else None   # pooled over every block, as vLLM's
        flags = [s["lossless"] for s in per_set.values()]
        agree = [s["agree"] for s in per_set.values()]
        return {"global_step": run["global_step"],
                "eval": {**rec, "tau_engine": e[section]["tau"], "tau_ours": ours,
                         "lossless": None if None in flags else all(flags),
                         "agree": None if None in agree else all(agree), "per_set": per_set,
                         "engine": r["engine"]["version"]}}


def main(argv: list[str] | None = None) -> int:
    """The background process: export ``DIR/checkpoint.pt`` to ``DIR/export``, then evaluate it."""
    ap = argparse.ArgumentParser(prog="python -m dflash_prep.train.engine_eval",
                                 description="Export a training checkpoint and evaluate it in vLLM (--eval-every).")
    ap.add_argument("dir", type=Path, help="the evaluation folder holding checkpoint.pt")
    ap.add_argument("--target", required=True, type=Path)
    ap.add_argument("--prompts", type=Path, help="a held-out prompts file (dflash-prep evaluate --prompts)")
    ap.add_argument("--bench", default="", help="shipped sets, comma-separated (dflash-prep evaluate --bench)")
    ap.add_argument("--n", type=int, default=8, help="prompts sampled from each --bench set")
    ap.add_argument("--ours", choices=("auto", "on", "off"), default="auto",
                    help="our own evaluator beside vLLM: auto (evaluate's default, by the target's size), on, off")
    a = ap.parse_args(argv)
    try:
        export(a.dir / "checkpoint.pt", a.dir / "export", overwrite=True)
        evaluate_exports(target=a.target, exports=[a.dir / "export"], prompts=a.prompts, out=a.dir / "eval.json",
                         benches=parse_benchmarks(a.bench) if a.bench else [], n=a.n, log=print,
                         ours={"auto": None, "on": True, "off": False}[a.ours])
    except DflashError as e:
        print(f"error: {e}", flush=True)
        return 1
    (a.dir / "checkpoint.pt").unlink()   # the export and the report are what this folder keeps
    return 0


if __name__ == "__main__":
    sys.exit(main())
