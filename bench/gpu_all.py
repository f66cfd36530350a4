"""The one GPU entry point: every GPU check and timing, in order, in at most 5 minutes.

    PYTHONPATH=. python3 -m bench.gpu_all --out "$OUT"          # the GPU machine (make bench-gpu)
    PYTHONPATH=. python3 -m bench.gpu_all --smoke --out DIR     # CPU: the same steps, tiny shapes

Made for a machine with a bare ``python3`` (torch, triton, transformers, numba, numpy,
pyarrow, typer, safetensors; no pip, no network, no ``datasets``, no pytest): nothing here
builds a venv or imports ``datasets``. Each step runs in its own subprocess (``sys.executable``,
``PYTHONPATH`` = the repository) under its own time limit, writes its JSON under
``OUT/<step>/`` as it finishes and its output to ``OUT/<step>.log``; after every step
``OUT/gpu_all.json`` (format ``dflash-prep/gpu-all`` v1) is rewritten with what ran so far, so
a run cut short keeps everything it measured. Steps, correctness first:

1. ``checks`` (:mod:`bench.gpu_checks`): causal and DFlash kernels (full and sliding window)
   against their references; a few drafter-training steps on CUDA, Triton loss = reference loss;
2. ``attention-causal`` (:mod:`bench.attention`): causal kernels vs SDPA flash/cuDNN and Flex;
3. ``attention-dflash`` (:mod:`bench.attention_dflash`): DFlash kernels vs Flex and SDPA, and
   windowed vs full attention at 32K context, 512 anchors, B = 16, W = 2048;
4. ``attention-ttt`` (:mod:`bench.attention_ttt`): the EAGLE-3 TTT kernel vs SDPA with an explicit
   mask, forward and backward;
5. ``drafter-training`` (:mod:`bench.drafter_gpu`): drafter-training throughput, packed vs padded;
6. ``drafter-variants`` (:mod:`bench.drafter_variants_gpu`): DFlash, DFlash2 and EAGLE-3 training
   steps on the same micro-batches;
7. ``target-workers`` (:mod:`bench.target_workers_gpu`): one target rank + one drafter rank sharing
   the GPU (gloo link, CPU staging) vs the colocated drafter (``--target-ranks``).

The limits (seconds) add up to :data:`TOTAL_S`; a step gets at most what is left of it. A
step's exit status, time, whether it was cut, and the files it wrote are recorded; the
summary's ``passed`` is true when every step exited 0. ``--smoke`` passes ``--smoke`` to each
step (CPU, Triton interpreter) under generous limits: it proves the path runs, not the speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

FORMAT = "dflash-prep/gpu-all"
ROOT = Path(__file__).resolve().parents[1]
TOTAL_S = 295.0


@dataclass(frozen=True)
class Step:
    name: str
    module: str
    args: tuple[str, ...]
    """Extra arguments on the GPU (shorter budgets, fewer cases); ``--smoke`` runs drop them."""
    limit_s: float
    """Wall-clock limit of the subprocess on the GPU."""


STEPS = (
    Step("checks", "bench.gpu_checks", (), 60),
    Step("attention-causal", "bench.attention", ("--budget-s", "18"), 35),
    Step("attention-dflash", "bench.attention_dflash", ("--budget-s", "9", "--cases", "3072:512,8192:512,1024:64"),
         45),
    Step("attention-ttt", "bench.attention_ttt", ("--budget-s", "15", "--tokens", "4096,16384"), 30),
    Step("drafter-training", "bench.drafter_gpu", ("--steps", "8", "--warmup", "2", "--n", "2000"), 50),
    Step("drafter-variants", "bench.drafter_variants_gpu", ("--steps", "5", "--warmup", "2", "--n", "1500"), 40),
    Step("target-workers", "bench.target_workers_gpu", ("--timeout-s", "28"), 35),
)
SMOKE_LIMIT_S = 900.0


def _write(path: Path, report: dict) -> None:
    from dflash_prep.formats.fileio import atomic_write_json

    atomic_write_json(path, report, format=FORMAT, version=1)


def run_step(step: Step, out: Path, *, smoke: bool, limit_s: float) -> dict:
    """One step in a subprocess; its record (exit status, seconds, cut or not, files it wrote)."""
    dest = out / step.name
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", step.module, "--out", str(dest), *(("--smoke",) if smoke else step.args)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    if not smoke:
        env.pop("TRITON_INTERPRET", None)  # the compiled kernels, not the interpreter
    t0 = time.perf_counter()
    with open(out / f"{step.name}.log", "wb") as log:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=limit_s).returncode
            cut = False
        except subprocess.TimeoutExpired:
            rc, cut = None, True
    files = sorted(str(p.relative_to(out)) for p in dest.rglob("*.json"))
    return dict(name=step.name, command=" ".join(cmd[1:]), returncode=rc, timed_out=cut, limit_s=round(limit_s, 1),
                seconds=round(time.perf_counter() - t0, 1), files=files, passed=rc == 0)


def run(out: Path, *, smoke: bool = False, steps=STEPS, total_s: float = TOTAL_S) -> dict:
    """Every step in order within ``total_s`` (GPU) or :data:`SMOKE_LIMIT_S` each (smoke); the summary."""
    out.mkdir(parents=True, exist_ok=True)
    report = dict(smoke=smoke, started=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), steps=[])
    t0 = time.perf_counter()
    for step in steps:
        left = total_s - (time.perf_counter() - t0)
        limit = SMOKE_LIMIT_S if smoke else min(step.limit_s, left)
        if limit < 10:
            report["steps"].append(dict(name=step.name, passed=False, skipped=f"time budget {total_s:.0f} s spent"))
        else:
            rec = run_step(step, out, smoke=smoke, limit_s=limit)
            report["steps"].append(rec)
            print(f"gpu_all {step.name}: {'ok' if rec['passed'] else 'FAILED'} (exit {rec['returncode']}, "
                  f"{rec['seconds']} s{', cut at the limit' if rec['timed_out'] else ''})", flush=True)
        report["seconds"] = round(time.perf_counter() - t0, 1)
        report["passed"] = all(s["passed"] for s in report["steps"])
        _write(out / "gpu_all.json", report)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.gpu_all", description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU: every step with --smoke (interpreter, tiny shapes)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "results/gpu"),
                    help="results folder (default: $OUT, else results/gpu)")
    a = ap.parse_args(argv)
    report = run(a.out, smoke=a.smoke)
    print(json.dumps({s["name"]: s.get("returncode", s.get("skipped")) for s in report["steps"]}))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
