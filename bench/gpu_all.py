"""The one GPU entry point: every GPU check and timing, in order, in at most 5 minutes.

    PYTHONPATH=. python3 -m dflash_prep.bench.gpu_all --out "$OUT"          # the GPU machine (make bench-gpu)
    PYTHONPATH=. python3 -m dflash_prep.bench.gpu_all --smoke --out DIR     # CPU: the same steps, tiny shapes

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
   the GPU (gloo link, CPU staging) vs the colocated drafter (``--target-ranks``);
8. ``engine-dflash2`` (:mod:`bench.engine_dflash2`): a DFlash2 export served by vLLM (its V2 model
   runner: GPU only) where vLLM is installed; where it is not (the GPU machine today), a record
   saying so, in a second. With vLLM it needs about two minutes: ``--steps engine-dflash2`` runs it
   alone when the steps before it leave less;
9. ``engine-target-ranks`` (:mod:`bench.engine_target_ranks`): the real trainer with the target in
   vLLM on a target rank feeding two drafter ranks (``--target-engine vllm --target-ranks 1``):
   tokens/s and MiB/s on the link; like step 8, ``not run`` where vLLM is not installed.

Before the steps, :func:`import_check` records, in this process, where the names of the
repository's top-level folders resolve (``kernels``, ``train``, ``bench``, ``tests``: never to the
checkout, whose code is ``dflash_prep.*`` only) and whether ``transformers`` imports; a failure
there fails the run at once (``--check-imports`` runs only this).

The limits (seconds) of the first seven add up to :data:`TOTAL_S`; a step gets at most what is
left of it (the engine steps, last, get the time the others did not use). A
step's exit status, time, whether it was cut, and the files it wrote are recorded; the
summary's ``passed`` is true when every step that ran exited 0. A step with nothing to check on
this machine (an engine step without vLLM) exits :data:`NOT_RUN` and is recorded as ``not run``
(``passed: null``, listed in ``not_run``): never counted as passed, nor as a failure. ``--smoke`` passes ``--smoke`` to each
step (CPU, Triton interpreter) under generous limits: it proves the path runs, not the speed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dflash_prep.bare_name import origin
from dflash_prep.formats.fileio import atomic_write_json

FORMAT = "dflash-prep/gpu-all"
ROOT = Path(__file__).resolve().parents[1]
TOTAL_S = 295.0
NOT_RUN = 75
"""A step's exit status for "nothing to check here" (EX_TEMPFAIL): recorded as not run, not as passed."""


@dataclass(frozen=True)
class Step:
    name: str
    module: str
    args: tuple[str, ...]
    """Extra arguments on the GPU (shorter budgets, fewer cases); ``--smoke`` runs drop them."""
    limit_s: float
    """Wall-clock limit of the subprocess on the GPU."""


STEPS = (
    Step("checks", "dflash_prep.bench.gpu_checks", (), 60),
    Step("attention-causal", "dflash_prep.bench.attention", ("--budget-s", "18"), 35),
    Step("attention-dflash", "dflash_prep.bench.attention_dflash", ("--budget-s", "9", "--cases", "3072:512,8192:512,1024:64"),
         45),
    Step("attention-ttt", "dflash_prep.bench.attention_ttt", ("--budget-s", "15", "--tokens", "4096,16384"), 30),
    Step("drafter-training", "dflash_prep.bench.drafter_gpu", ("--steps", "8", "--warmup", "2", "--n", "2000"), 50),
    Step("drafter-variants", "dflash_prep.bench.drafter_variants_gpu", ("--steps", "5", "--warmup", "2", "--n", "1500"), 40),
    Step("target-workers", "dflash_prep.bench.target_workers_gpu", ("--timeout-s", "28"), 35),
    Step("engine-dflash2", "dflash_prep.bench.engine_dflash2", ("--timeout-s", "150"), 240),
    Step("engine-target-ranks", "dflash_prep.bench.engine_target_ranks", ("--timeout-s", "150"), 200),
)
SMOKE_LIMIT_S = 900.0


FOLDERS = ("kernels", "train", "bench", "tests")
"""The repository's top-level folders that hold code, each a name that other distributions use."""


def _inside(path: str, folder: Path) -> bool:
    return Path(path).resolve().is_relative_to(folder.resolve())


def import_check() -> dict:
    """In this process: the bare names of the top-level folders load nothing from the checkout
    (an installed distribution of that name is what they load), ``dflash_prep.kernels`` and
    ``dflash_prep.train`` load the checkout's code, and ``transformers`` imports (it imports Hugging
    Face's ``kernels`` when that is installed). ``passed`` says all three hold."""
    bare = {name: origin(name) for name in FOLDERS}
    shadowed = sorted(n for n, o in bare.items() if o is not None and _inside(o, ROOT / n))
    ours = {name: origin(name) for name in ("dflash_prep.kernels.attention", "dflash_prep.train.loop")}
    transformers = "not installed"
    if importlib.util.find_spec("transformers") is not None:
        try:
            importlib.import_module("transformers.activations")
            transformers = "ok"
        except Exception as e:  # noqa: BLE001 - recorded, not raised: the check reports what broke
            transformers = f"{type(e).__name__}: {e}"
    passed = (not shadowed and all(o and _inside(o, ROOT) for o in ours.values())
              and transformers in ("ok", "not installed"))
    return dict(bare=bare, shadowed=shadowed, ours=ours, transformers=transformers, passed=passed)


def finish_step(path: Path, rec: dict, *, format: str) -> int:
    """A step module's last act: ``rec`` written to ``path`` (``format`` v1, atomically), printed,
    and the step's exit status: :data:`NOT_RUN` when nothing was checked (``passed`` None), else 0
    or 1 as ``passed`` says."""
    atomic_write_json(path, rec, format=format, version=1)
    print(json.dumps(rec, indent=1))
    if rec["passed"] is None:
        return NOT_RUN
    return 0 if rec["passed"] else 1


def _write(path: Path, report: dict) -> None:
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
                seconds=round(time.perf_counter() - t0, 1), files=files,
                status="not run" if rc == NOT_RUN else "passed" if rc == 0 else "failed",
                passed=None if rc == NOT_RUN else rc == 0)


def run(out: Path, *, smoke: bool = False, steps=STEPS, total_s: float = TOTAL_S,
        check_imports_only: bool = False) -> dict:
    """The import check, then every step in order within ``total_s`` (GPU) or :data:`SMOKE_LIMIT_S`
    each (smoke); the summary."""
    out.mkdir(parents=True, exist_ok=True)
    report = dict(smoke=smoke, started=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), steps=[],
                  imports=import_check())
    report["passed"] = report["imports"]["passed"]
    _write(out / "gpu_all.json", report)
    print(f"gpu_all imports: {'ok' if report['passed'] else 'FAILED'} {json.dumps(report['imports'])}", flush=True)
    if not report["passed"] or check_imports_only:
        return report
    t0 = time.perf_counter()
    for step in steps:
        left = total_s - (time.perf_counter() - t0)
        limit = SMOKE_LIMIT_S if smoke else min(step.limit_s, left)
        if limit < 10:
            report["steps"].append(dict(name=step.name, status="failed", passed=False,
                                        skipped=f"time budget {total_s:.0f} s spent"))
        else:
            rec = run_step(step, out, smoke=smoke, limit_s=limit)
            report["steps"].append(rec)
            verdict = {"passed": "ok", "failed": "FAILED", "not run": "NOT RUN"}[rec["status"]]
            print(f"gpu_all {step.name}: {verdict} (exit {rec['returncode']}, "
                  f"{rec['seconds']} s{', cut at the limit' if rec['timed_out'] else ''})", flush=True)
        report["seconds"] = round(time.perf_counter() - t0, 1)
        report["not_run"] = [s["name"] for s in report["steps"] if s["passed"] is None]
        report["passed"] = report["imports"]["passed"] and all(s["passed"] is not False for s in report["steps"])
        _write(out / "gpu_all.json", report)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m dflash_prep.bench.gpu_all", description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU: every step with --smoke (interpreter, tiny shapes)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "results/gpu"),
                    help="results folder (default: $OUT, else results/gpu)")
    ap.add_argument("--steps", default="", metavar="A,B",
                    help=f"only these steps, in the usual order (of: {', '.join(s.name for s in STEPS)})")
    ap.add_argument("--check-imports", action="store_true",
                    help="only the import check: where kernels/train/bench/tests and transformers resolve")
    a = ap.parse_args(argv)
    chosen = [n for n in a.steps.split(",") if n]
    unknown = sorted(set(chosen) - {s.name for s in STEPS})
    if unknown:
        ap.error(f"unknown steps {unknown}; choose from {[s.name for s in STEPS]}")
    steps = tuple(s for s in STEPS if not chosen or s.name in chosen)
    report = run(a.out, smoke=a.smoke, steps=steps, check_imports_only=a.check_imports)
    print(json.dumps({s["name"]: s.get("returncode", s.get("skipped")) for s in report["steps"]}))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
