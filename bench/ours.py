"""dflash-prep's own rows for :mod:`bench.peers`, through the public library only.

Plans come from :func:`dflash_prep.analyze.analyze.run` (the code behind ``dflash-prep analyze``,
run on a what-if lengths file; its time, report simulations included, is the row's
``setup``), and every epoch from :func:`dflash_prep.pack.pack.build_epoch`, the code behind
``dflash-prep pack``, with W ranks, A = 1 and the class-aware step schedule. Nothing of our
algorithms is re-implemented here; this module only turns a manifest's arrays into the
``(order, offsets, step, rank)`` that :func:`bench.peers.measure` scores like any peer's.

Rows (keys for ``--skip``):

- ``window``: analyze's default plan: K and window chosen together (the highest simulated
  efficiency whose repeat-pair rate is <= 0.05, near-ties to the least repeat-pair;
  :mod:`dflash_prep.analyze.tradeoff`): the default padded layout (HF's batch size is matched to
  its mean micro-batch);
- ``k6``: ``analyze --buckets K --window 0``: K optimal boundaries, no sorting window;
- ``auto``: auto-K, ``analyze --target-efficiency 0.95 --window 0`` (the smallest K whose
  predicted efficiency reaches 0.95), no window;
- ``window-small``: the K-bucket plan packed with window 512;
- ``window-cost``: the default plan's rule under a cost budget of 1.3 T (docs/definitions.md);
- ``varlen``: concatenated sequences, keyed random order, first-fit into 4 open bins.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from dflash_prep.formats.fileio import atomic_save_npy
from dflash_prep.formats.plan import Plan
from dflash_prep.pack import metrics, pack

from .peer_samplers import PeerEpoch

COST_BUDGET_FACTOR = 1.3  # definitions.md: cost budget 1.3 x T
AUTO_TARGET = 0.95        # auto-K: analyze --target-efficiency
SMALL_WINDOW = 512


def analyze_plan(lengths_file: Path | None, out: Path, **options) -> tuple[Plan, dict]:
    """Run ``analyze`` on a lengths file (or on ``data=`` a dataset folder, in ``options``);
    return the plan it wrote and a short description."""
    from dflash_prep.analyze import analyze
    from dflash_prep.formats import plan as plan_mod

    rep = analyze.run(analyze.AnalyzeConfig(lengths_file=lengths_file, out=out, plot=False, **options))
    plan = plan_mod.load(rep["plan"])
    return plan, {"k": rep["k"], "boundaries": [int(b) for b in plan.boundaries],
                  "predicted_efficiency": plan.predicted.get("efficiency")}


def epoch_fn(lengths: np.ndarray, plan: Plan, cfg: pack.PackConfig):
    """``e -> (PeerEpoch, step, rank)`` from :func:`pack.build_epoch`'s manifest arrays."""
    layout = cfg.layout
    edges = metrics.class_edges(lengths)

    def fn(e: int):
        res = pack.build_epoch(lengths, plan, cfg, e, edges)
        table = res.arrays["microbatches"]          # (M, columns) int64, manifest.COLUMNS
        col = {c: i for i, c in enumerate(res.header["columns"])}
        start, count = table[:, col["start"]], table[:, col["count"]]
        ids = np.asarray(res.arrays["sample_ids"], np.int64)   # packing order; rows point in by start/count
        offsets = np.zeros(len(count) + 1, np.int64)
        np.cumsum(count, out=offsets[1:])
        pos = np.repeat(start - offsets[:-1], count) + np.arange(int(offsets[-1]), dtype=np.int64)
        ep = PeerEpoch(ids[pos], offsets, layout == "varlen", "dflash-prep (pack.build_epoch)")
        return ep, table[:, col["step"]].astype(np.int64), table[:, col["rank"]].astype(np.int64)
    return fn


def our_rows(lengths: np.ndarray, cfg, measure, *, work: Path) -> list:
    """Our strategies on one length set, measured by ``measure`` exactly like the peers."""
    lens = np.asarray(lengths, np.int64)
    lengths_file = Path(work) / "lengths.npy"
    atomic_save_npy(lengths_file, lens)
    W, T = cfg.world_size, cfg.budget
    base = {"budget": T, "seed": cfg.seed}
    cost = {"budget": COST_BUDGET_FACTOR * T, "budget_unit": "cost", "model_dim": cfg.model_dim, "seed": cfg.seed}
    plans: dict = {}

    def plan_for(key, options):
        """One analyze run serves every row with the same options; each such row reports
        that run's time as its setup."""
        if key not in plans:
            t0 = time.perf_counter()
            plan, info = analyze_plan(lengths_file, Path(work) / f"plan-{key}", **options)
            plans[key] = plan, {**info, "setup_s": time.perf_counter() - t0}
        return plans[key]

    rows = []

    def row(key, name, plan_key, options, *, window=None, layout="padded", default=False, budget=None):
        if key in cfg.skip:
            return

        def setup():
            plan, info = plan_for(plan_key, options)
            pc = pack.PackConfig(world_size=W, grad_accum=1, layout=layout, schedule="class-aware", window=window)
            used = plan.window if window is None else window
            b = plan.budget
            return epoch_fn(lens, plan, pc), {**info, "window": used, "default": default,
                                              "budget": {"unit": b.unit, "value": b.value}}
        if "{window}" in name:  # the plan's own K and window go into the row's name
            p = plan_for(plan_key, options)[0]
            name = name.format(window=p.window, k=p.num_buckets)
        print(f"  {name} ...", flush=True, file=sys.stderr)
        rows.append(measure(name, "ours", setup, lens, cfg))

    k = cfg.k
    fixed = {**base, "buckets": k, "window": 0}
    row("window", "dflash-prep padded K={k}, window {window} (default)", "default", base, default=True)
    row("k6", f"dflash-prep padded K={k}, no window", "fixed", fixed)
    row("window-small", f"dflash-prep padded K={k}, window {SMALL_WINDOW}", "fixed", fixed, window=SMALL_WINDOW)
    row("auto", f"dflash-prep padded auto-K (target {AUTO_TARGET}), no window", "auto",
        {**base, "target_efficiency": AUTO_TARGET, "window": 0})
    row("window-cost", f"dflash-prep padded K={{k}}, window {{window}}, cost budget {COST_BUDGET_FACTOR}T", "cost", cost)
    row("varlen", "dflash-prep varlen, first-fit 4 open bins", "default", base, layout="varlen")
    return rows
