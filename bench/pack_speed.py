"""Speed, memory and quality of ``dflash-prep pack`` (issue 4).

``python -m dflash_prep.bench.pack_speed`` runs, on definitions.md's 902,087 seedlike lengths (T = 65536,
W = 8, A = 1, K = 6 boundaries [832, 1248, 1760, 2464, 3760], d_model 768):

1. the strategy table: every schedule, window, budget unit and layout, packed for epochs
   0 and 1 by :func:`dflash_prep.pack.pack.pack_epochs` and read back from the manifests'
   summaries (efficiency, fill, step mix, rank imbalance, repeat-pair 0 -> 1);
2. warm time per epoch of the default configuration, including the manifest write: each
   epoch is a separate ``pack_epochs`` call (load lengths, pack, hash, write, fsync), after
   one warm-up call has compiled/loaded the numba code; median of ``--repeats`` epochs.

``--big N`` (e.g. 100000000) adds the scale run: the lengths are drawn and saved by one
subprocess, then epoch 0 and epoch 1 are each packed by a fresh subprocess, which reports
wall and CPU seconds and its peak RSS (``ru_maxrss``) against the size of the manifest it
wrote. Epoch 1 also reads epoch 0 from disk for the repeat-pair rate.

Output: a markdown report on stdout and ``--out/pack_speed.json`` (format
``dflash-prep/bench-pack`` v1). Nothing here is committed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dflash_prep.formats import lengths as lengths_mod
from dflash_prep.formats import manifest
from dflash_prep.formats.fileio import atomic_write_json
from dflash_prep.formats.plan import Budget, Plan, save
from dflash_prep.pack import bucketing
from dflash_prep.pack.pack import pack_epochs
from dflash_prep.synth import profiles

T = 65536
K6 = (832, 1248, 1760, 2464, 3760)
TOKENS = Budget(unit="tokens", value=T, model_dim=768)
COST = Budget(unit="cost", value=1.3 * T, model_dim=768)
STRATEGIES = [  # (name, pack options)
    ("K=6, window 0, random batch order", dict(window=0, schedule="random")),
    ("K=6, window 0, stratified across buckets", dict(window=0, schedule="stratified")),
    ("K=6, window 0, class-aware", dict(window=0, schedule="class-aware")),
    ("K=6, window 1024, class-aware", dict(window=1024)),
    (f"K=6, window {bucketing.DEFAULT_WINDOW} (default), class-aware", dict(window=bucketing.DEFAULT_WINDOW)),
    ("K=6, window 4096, class-aware", dict(window=4096)),
    (f"K=6, window {bucketing.DEFAULT_WINDOW}, class-aware, cost budget 1.3T", dict(budget=COST)),
    ("K=6, window 4096, class-aware, cost budget 1.3T", dict(window=4096, budget=COST)),
    ("varlen, first-fit 4 open bins, class-aware", dict(layout="varlen")),
    ("varlen, first-fit 4 open bins, random", dict(layout="varlen", schedule="random")),
]
KEYS = ("efficiency", "fill", "step_mix", "rank_imbalance", "repeat_pair_rate", "microbatches", "sum_sq_len_max")


def make_inputs(folder: Path, n: int, window: int = bucketing.DEFAULT_WINDOW) -> Path:
    """Seedlike lengths (``lengths.npy``) and a K=6 plan for them; returns the plan path."""
    folder.mkdir(parents=True, exist_ok=True)
    lens = profiles.make_lengths("seedlike", n=n)
    np.save(folder / "lengths.npy", lens)
    src = lengths_mod.load(lengths_file=folder / "lengths.npy")
    return save(Plan(data=src.describe(), boundaries=K6, budget=TOKENS, seed=0, window=window), folder / "plan.json")


def strategy_table(plan: Path, out: Path) -> list[dict]:
    shutil.rmtree(out / "strategies", ignore_errors=True)
    rows = []
    for name, opts in STRATEGIES:
        dirs = pack_epochs(plan=plan, epochs=[0, 1], out=out / "strategies", world_size=8, overwrite=True, **opts)
        s = manifest.open(dirs[1]).summary
        rows.append({"strategy": name, **{k: s.get(k) for k in KEYS}})
    return rows


def warm_epochs(plan: Path, out: Path, repeats: int) -> dict:
    root = out / "warm"
    shutil.rmtree(root, ignore_errors=True)       # an epoch already there with the same inputs is not re-packed
    pack_epochs(plan=plan, epochs=[0], out=root, world_size=8, overwrite=True)        # warm-up
    wall, cpu = [], []
    for e in range(1, repeats + 1):
        w, c = time.perf_counter(), time.process_time()
        pack_epochs(plan=plan, epochs=[e], out=root, world_size=8, overwrite=True)
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return {"epochs": repeats, "median_wall_s": statistics.median(wall), "median_cpu_s": statistics.median(cpu),
            "max_wall_s": max(wall), "manifest_bytes": _size(manifest.epoch_dir(root, 1))}


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


# ----------------------------------------------------------------------------- scale run
def _child_pack(plan: str, out: str, epoch: int, layout: str) -> None:
    """In a fresh process: pack one epoch, print wall/CPU/peak RSS as JSON."""
    w, c = time.perf_counter(), time.process_time()
    [d] = pack_epochs(plan=plan, epochs=[epoch], out=out, world_size=8, layout=layout, overwrite=True)
    res = {"epoch": epoch, "layout": layout, "wall_s": time.perf_counter() - w, "cpu_s": time.process_time() - c,
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "manifest_bytes": _size(d),
           "summary": {k: manifest.open(d).summary.get(k) for k in KEYS}}
    print("RESULT " + json.dumps(res), flush=True)


def big_run(n: int, work: Path, layouts: list[str]) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    folder = work / f"seedlike-{n}"
    plan = folder / "plan.json"
    if not plan.is_file():
        subprocess.run([sys.executable, "-c", f"from dflash_prep.bench.pack_speed import make_inputs; from pathlib import Path; "
                        f"make_inputs(Path({str(folder)!r}), {n})"], check=True, env=env)
    results = []
    for layout in layouts:
        out = folder / f"manifests-{layout}"
        shutil.rmtree(out, ignore_errors=True)
        for epoch in (0, 1):
            p = subprocess.run([sys.executable, "-m", "dflash_prep.bench.pack_speed", "--child", str(plan), str(out), str(epoch),
                                layout], check=True, env=env, capture_output=True, text=True)
            line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))
            r = json.loads(line[len("RESULT "):])
            r["peak_over_manifest"] = r["peak_rss_bytes"] / r["manifest_bytes"]
            results.append(r)
        shutil.rmtree(out, ignore_errors=True)
    return results


# ----------------------------------------------------------------------------- report
def _fmt(v) -> str:
    return "-" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)


def report(res: dict) -> str:
    lines = [f"pack benchmark, {res['date']}, {res['machine']}, load average at start {res['loadavg']}", "",
             f"Seedlike {res['n']:,} samples, T={T}, W=8, A=1, K=6 {list(K6)}, d_model 768 (epoch 1 summaries):", "",
             "| strategy | " + " | ".join(KEYS) + " |", "|---|" + "---|" * len(KEYS)]
    lines += ["| " + r["strategy"] + " | " + " | ".join(_fmt(r[k]) for k in KEYS) + " |" for r in res["strategies"]]
    w = res["warm"]
    lines += ["", f"Warm epoch incl. write (default options, {w['epochs']} epochs): median {w['median_wall_s']:.3f} s "
              f"wall, {w['median_cpu_s']:.3f} s CPU (max {w['max_wall_s']:.3f} s); manifest "
              f"{w['manifest_bytes'] / 2**20:.1f} MiB"]
    for r in res.get("big", []):
        lines.append(f"{res['big_n']:,} samples, {r['layout']}, epoch {r['epoch']}: {r['wall_s']:.1f} s wall, "
                     f"{r['cpu_s']:.1f} s CPU, peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB = "
                     f"{r['peak_over_manifest']:.2f} x manifest ({r['manifest_bytes'] / 2**30:.2f} GiB); "
                     f"eff {_fmt(r['summary']['efficiency'])}, fill {_fmt(r['summary']['fill'])}, "
                     f"step mix {_fmt(r['summary']['step_mix'])}, repeat-pair {_fmt(r['summary']['repeat_pair_rate'])}")
    return "\n".join(lines)


def main(argv=None) -> None:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child_pack(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=profiles.SEEDLIKE_N, help="seedlike samples for the table and warm timing")
    ap.add_argument("--repeats", type=int, default=5, help="warm epochs timed")
    ap.add_argument("--big", type=int, default=0, help="also run the scale benchmark with this many samples")
    ap.add_argument("--big-layouts", default="padded", help="comma-separated layouts for --big")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp folder)")
    ap.add_argument("--out", type=Path, default=Path("results/bench"), help="where pack_speed.json goes")
    a = ap.parse_args(argv)
    work = a.work or Path(tempfile.mkdtemp(prefix="pack-speed-"))
    res = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}",
           "loadavg": " ".join(f"{x:.1f}" for x in os.getloadavg()), "n": a.n}
    plan = make_inputs(work / "seedlike", a.n)
    res["strategies"] = strategy_table(plan, work)
    res["warm"] = warm_epochs(plan, work, a.repeats)
    if a.big:
        res["big_n"] = a.big
        res["big"] = big_run(a.big, work, a.big_layouts.split(","))
    atomic_write_json(a.out / "pack_speed.json", res, format="dflash-prep/bench-pack", version=1)
    print(report(res))
    if a.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
