"""How right analyze's predictions are: models against simulated ``pack_padded_epoch``.

    NUMBA_CACHE_DIR=.numba_cache python -m dflash_prep.bench.analyze_accuracy [--n 902087] [--epochs 3]
    NUMBA_CACHE_DIR=.numba_cache python -m dflash_prep.bench.analyze_accuracy --scale 1000000,10000000,100000000

``--scale`` (the scale table): for each N, seedlike lengths go through ``analyze``'s
default plan (a 2^19-sample subsample, rescaled), and the plan's K with its window, a
quarter of it, four times it and the window table's largest window are packed by
``pack``'s packer over all N samples for two epochs; the table shows predicted and realized efficiency and repeat-pair rate side by side.

For each profile (seedlike, bimodal, heavytail), budget and K, the optimal boundaries are
packed for ``--epochs`` epochs and compared with:

- ``chain``: the renewal-chain prediction that ``plan.predicted`` and every table use;
- ``dp``: the O(1) model the boundary search scores buckets with;
- the analytic repeat-pair rate and within-batch spread of the Pareto table.

Prints one markdown row per (profile, budget) with the worst absolute error over K, and
the overall worst; ``--json PATH`` writes every (profile, budget, K) row.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

KS = (1, 2, 4, 6, 8, 16, 32)


def main(argv=None) -> int:
    from dflash_prep.analyze.analyze import analytic_diversity
    from dflash_prep.analyze.optimize import Model, PackModel, histogram
    from dflash_prep.formats.plan import Budget
    from dflash_prep.pack import metrics
    from dflash_prep.pack.bucketing import pack_padded_epoch
    from dflash_prep.synth.profiles import make_lengths

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=902_087)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--budgets", type=str, default="65536,16384,8192")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--scale", type=str, default=None, help="comma-separated N: the scale table instead")
    args = ap.parse_args(argv)
    if args.scale:
        return scale_table([int(x) for x in args.scale.split(",")], args.json)

    rows, summary = [], []
    for profile in ("seedlike", "bimodal", "heavytail"):
        lengths = make_lengths(profile, args.n, 0)
        hist = histogram(lengths)
        for budget in (int(b) for b in args.budgets.split(",")):
            model = Model(hist, PackModel(float(budget)))
            res = model.search(max(KS))
            worst = {"chain": 0.0, "dp": 0.0, "dp6": 0.0, "repeat_pair": 0.0, "spread": 0.0, "spread6": 0.0}
            for k in KS:
                b = model.refine(res.boundaries[k - 1])
                chain = model.predict(b)["efficiency"]
                dp = hist.total_tokens / sum(model.dp_cost(i, j) for i, j in model.index_ranges(b))
                rp_a, sp_a = analytic_diversity(model, b)
                effs, rps, sps, prev = [], [], [], None
                for e in range(args.epochs):
                    order, offsets, _ = pack_padded_epoch(lengths, b, seed=0, epoch=e, budget=Budget(value=budget))
                    effs.append(metrics.efficiency(lengths, order, offsets))
                    sps.append(metrics.within_batch_spread(lengths, order, offsets))
                    if prev is not None:
                        rps.append(metrics.repeat_pair_rate(*prev, order, offsets, len(lengths)))
                    prev = (order, offsets)
                row = {"profile": profile, "budget": budget, "k": k, "sim": float(np.mean(effs)), "chain": chain,
                       "dp": dp, "repeat_pair_sim": float(np.mean(rps)), "repeat_pair_analytic": rp_a,
                       "spread_sim": float(np.mean(sps)), "spread_analytic": sp_a}
                rows.append(row)
                worst["chain"] = max(worst["chain"], abs(chain - row["sim"]))
                worst["dp"] = max(worst["dp"], abs(dp - row["sim"]))
                worst["repeat_pair"] = max(worst["repeat_pair"], abs(rp_a - row["repeat_pair_sim"]))
                worst["spread"] = max(worst["spread"], abs(sp_a - row["spread_sim"]))
                if k >= 6:  # narrow buckets: what the search actually picks between
                    worst["dp6"] = max(worst["dp6"], abs(dp - row["sim"]))
                    worst["spread6"] = max(worst["spread6"], abs(sp_a - row["spread_sim"]))
            summary.append((profile, budget, worst))

    print(f"# analyze model accuracy, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, n={args.n:,}, "
          f"{args.epochs} simulated epochs, K in {KS}\n")
    print("Worst absolute error over K (over K >= 6 in brackets); efficiency in percentage points.\n")
    print("| profile | budget | chain efficiency | search-model efficiency | repeat-pair (analytic) "
          "| spread (analytic) |")
    print("|---|---:|---:|---:|---:|---:|")
    for profile, budget, w in summary:
        print(f"| {profile} | {budget} | {100 * w['chain']:.2f} | {100 * w['dp']:.2f} ({100 * w['dp6']:.2f}) | "
              f"{w['repeat_pair']:.5f} | {w['spread']:.3f} ({w['spread6']:.3f}) |")
    if args.json:
        args.json.write_text(json.dumps({"format": "dflash-prep/bench-analyze-accuracy", "version": 1,
                                         "rows": rows}, indent=2) + "\n")
    return 0


def scale_table(ns: list[int], json_path: Path | None) -> int:
    """Predicted (analyze, subsampled) against realized (pack over all N) at each N."""
    import tempfile

    from dflash_prep.analyze import analyze, tradeoff
    from dflash_prep.analyze.optimize import histogram
    from dflash_prep.analyze.simulate import Subsample, simulate
    from dflash_prep.formats.plan import Budget
    from dflash_prep.synth.profiles import make_lengths

    rows = []
    for n in ns:
        lengths = make_lengths("seedlike", n, 1)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "lengths.npy"
            np.save(path, lengths)
            t0 = time.perf_counter()
            rep = analyze.run(analyze.AnalyzeConfig(lengths_file=path, out=Path(tmp), plot=False))
            secs = time.perf_counter() - t0
        k, w, bounds = rep["k"], rep["window"], rep["boundaries"]
        full = Subsample(histogram(lengths), lengths)        # every sample: what pack realizes
        ev = tradeoff.Evaluator(Subsample.of(full.hist), Budget(value=65536), 0, 2)
        last = rep["pareto_window"][-1]["window"]   # the table's largest window: the large-window model's path
        for window in sorted({w // 4, w, 4 * w, last}):
            pred = ev(bounds, window)
            real = simulate(full, bounds, budget=Budget(value=65536), window=window)
            rows.append({"n": n, "k": k, "window": window, "plan": window == w, "analyze_s": secs,
                         "eff_pred": pred.efficiency, "eff_pack": real.efficiency,
                         "rp_pred": pred.repeat_pair, "rp_pack": real.repeat_pair})
            print(rows[-1], flush=True)
        del lengths, full
    print(f"\n# analyze predictions at scale, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: seedlike, "
          "T = 65536, predicted from a 2^19-sample subsample vs pack's packer over all N, epochs 0-1\n")
    print("| N | K | window | efficiency pred | efficiency pack | diff pp | repeat-pair pred | repeat-pair pack | diff |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        w = f"**{r['window']}** (plan)" if r["plan"] else str(r["window"])
        print(f"| {r['n']:,} | {r['k']} | {w} | {r['eff_pred']:.4f} | {r['eff_pack']:.4f} | "
              f"{100 * (r['eff_pred'] - r['eff_pack']):+.2f} | {r['rp_pred']:.4f} | {r['rp_pack']:.4f} | "
              f"{r['rp_pred'] - r['rp_pack']:+.4f} |")
    if json_path:
        json_path.write_text(json.dumps({"format": "dflash-prep/bench-analyze-scale", "version": 1, "rows": rows},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
