"""How fast ``dflash-prep analyze`` is: warm (numba cache on disk, compile excluded) and cold.

    NUMBA_CACHE_DIR=.numba_cache python -m dflash_prep.bench.analyze_speed [--n-large 100000000] [--exhaustive]

Rows (seedlike lengths, T = 65536, definitions.md):

- ``search K=6``: lengths array -> histogram -> model tables -> boundary search for K=6;
- ``search K=32``: the same for K = 1..32 in one run (what the Pareto table needs);
- ``report``: :func:`dflash_prep.analyze.analyze.run` end to end (search, chain polish, strategy rows
  simulated over 3 epochs, window and K Pareto tables, plan.json, report JSON and PNG),
  with its phase breakdown;
- the two search rows and the whole report again on ``--n-large`` lengths (default 100M;
  the histogram makes the search independent of N, and every simulated row packs the same
  2^19-sample subsample, so only loading, fingerprinting and the O(N) bincount grow);
- ``cold``: a fresh process with an empty numba cache (compile included): K=6 search, and
  the whole report.

``--exhaustive`` also times the O(K D^2) DP and checks that divide and conquer found the
same optimum for K = 1..32. Prints a markdown table (and ``--json PATH`` writes the rows).
Wall-clock seconds, best of ``--repeat`` runs; CPU seconds beside them, since the machine
may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

T = 65536


def _timed(fn, repeat: int):
    best = None
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        w, c = time.perf_counter() - w0, time.process_time() - c0
        if best is None or w < best[0]:
            best = (w, c, out)
    return best


def search_once(lengths: np.ndarray, k: int):
    from dflash_prep.analyze.optimize import Model, PackModel, histogram

    model = Model(histogram(lengths), PackModel(float(T)))
    return model.search(k)


def report_once(lengths_path: Path, out: Path) -> dict:
    from dflash_prep.analyze.analyze import AnalyzeConfig, run

    return run(AnalyzeConfig(lengths_file=lengths_path, out=out, budget=T))


_COLD = """
import sys, time, numpy as np
from pathlib import Path
t0 = time.perf_counter()
sys.path.insert(0, sys.argv[3])
from dflash_prep.bench.analyze_speed import search_once, report_once
lengths = np.load(sys.argv[1])
search_once(lengths, 6)
t1 = time.perf_counter()
report_once(Path(sys.argv[1]), Path(sys.argv[2]))
t2 = time.perf_counter()
print(t1 - t0, t2 - t0)
"""


def cold(lengths_path: Path, out: Path) -> tuple[float, float, float]:
    """(K=6 search, whole report, whole report CPU s) in a fresh process, compile included."""
    import resource

    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        root = str(Path(__file__).resolve().parents[1])
        res = subprocess.run([sys.executable, "-c", _COLD, str(lengths_path), str(out), root], env=env,
                             check=True, capture_output=True, text=True)
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    a, b = res.stdout.split()[-2:]
    return float(a), float(b), (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=902_087, help="seedlike lengths for the main rows")
    ap.add_argument("--n-large", type=int, default=100_000_000, help="seedlike lengths for the scale rows (0: skip)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--exhaustive", action="store_true", help="also time the O(K D^2) DP and compare optima")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("NUMBA_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".numba_cache"))

    from dflash_prep.synth.profiles import make_lengths

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        lengths = make_lengths("seedlike", args.n, 0)
        lpath = tmp / "seedlike.npy"
        np.save(lpath, lengths)

        c6, c_all, c_cpu = cold(lpath, tmp / "cold")
        search_once(lengths, 2)  # warm: load the cached machine code
        report_once(lpath, tmp / "warmup")
        w, c, res = _timed(lambda: search_once(lengths, 6), args.repeat)
        rows.append({"what": "search K=6", "n": args.n, "wall_s": w, "cpu_s": c,
                     "note": f"boundaries {list(res.boundaries[5])}"})
        w, c, res = _timed(lambda: search_once(lengths, 32), args.repeat)
        rows.append({"what": "search K=1..32", "n": args.n, "wall_s": w, "cpu_s": c,
                     "note": f"{len(np.unique(lengths))} distinct lengths"})
        w, c, rep = _timed(lambda: report_once(lpath, tmp / "warm"), max(1, args.repeat - 1))
        phases = ", ".join(f"{k} {v:.2f}" for k, v in rep["cpu_seconds"].items())
        rows.append({"what": "whole report (CPU s per phase in notes)", "n": args.n, "wall_s": w, "cpu_s": c,
                     "note": phases})
        rows.append({"what": "cold: search K=6 (imports + compile)", "n": args.n, "wall_s": c6, "cpu_s": None,
                     "note": "fresh process, empty numba cache"})
        rows.append({"what": "cold: whole report (imports + compile)", "n": args.n, "wall_s": c_all, "cpu_s": c_cpu,
                     "note": "fresh process, empty numba cache"})
        if args.exhaustive:
            from dflash_prep.analyze.optimize import Model, PackModel, histogram

            model = Model(histogram(lengths), PackModel(float(T)))
            fast = model.search(32)
            w, c, full = _timed(lambda: model.search(32, exhaustive=True), 1)
            worst = max(abs(a - b) / b for a, b in zip(fast.padded, full.padded))
            same = sum(a == b for a, b in zip(fast.boundaries, full.boundaries))
            rows.append({"what": "exhaustive O(K D^2) search K=1..32", "n": args.n, "wall_s": w, "cpu_s": c,
                         "note": f"same boundaries for {same}/32 K; worst padded-token gap {worst:.1e}"})
        del lengths
        if args.n_large:
            big = make_lengths("seedlike", args.n_large, 1)
            w, c, res = _timed(lambda: search_once(big, 6), args.repeat)
            rows.append({"what": "search K=6", "n": args.n_large, "wall_s": w, "cpu_s": c,
                         "note": f"boundaries {list(res.boundaries[5])}"})
            w, c, _ = _timed(lambda: search_once(big, 32), args.repeat)
            rows.append({"what": "search K=1..32", "n": args.n_large, "wall_s": w, "cpu_s": c, "note": ""})
            bpath = tmp / "large.npy"
            np.save(bpath, big)
            del big
            w, c, rep = _timed(lambda: report_once(bpath, tmp / "large"), 1)
            phases = ", ".join(f"{k} {v:.2f}" for k, v in rep["cpu_seconds"].items())
            rows.append({"what": "whole report (CPU s per phase in notes)", "n": args.n_large, "wall_s": w,
                         "cpu_s": c, "note": f"plan K={rep['k']} window {rep['window']}; {phases}"})

    print(f"# analyze speed, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, "
          f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}, "
          f"numba cache {os.environ['NUMBA_CACHE_DIR']}\n")
    print("| what | lengths | wall s | CPU s | notes |\n|---|---:|---:|---:|---|")
    for r in rows:
        cpu = f"{r['cpu_s']:.2f}" if r["cpu_s"] is not None else "-"
        print(f"| {r['what']} | {r['n']:,} | {r['wall_s']:.2f} | {cpu} | {r['note']} |")
    if args.json:
        args.json.write_text(json.dumps({"format": "dflash-prep/bench-analyze-speed", "version": 1, "rows": rows},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
