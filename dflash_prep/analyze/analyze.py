"""``dflash-prep analyze``: choose bucket boundaries and window, compare strategies, write ``plan.json``.

Pipeline: lengths (dataset folder or what-if file) -> histogram -> boundary search for
K = 1..32 (:mod:`dflash_prep.analyze.optimize`) -> polish against the renewal chain where the
search's O(1) model is off -> K and window chosen together (:mod:`dflash_prep.analyze.tradeoff`)
-> strategy, K x window, window and K tables -> ``plan.json``, plus the JSON report and
PNG rendered by :mod:`dflash_prep.analyze.report`.

What is predicted and what is simulated; none of it grows with N beyond the O(N) histogram:

- "pred" figures (window 0, any boundaries) come from the renewal chain
  (:mod:`dflash_prep.analyze.renewal`), exact for an i.i.d. stream; its error against
  simulated packing (``bench/analyze_accuracy.py``): docs/benchmarks.md#analyze-model-accuracy.
- Strategy rows, the window table and the joint (K, window) choice are *simulated*:
  ``pack``'s own packer over a fixed-size subsample of the histogram (at most 2^19
  samples), ``sim_epochs`` epochs, with the repeat-pair rate rescaled to the full bucket
  sizes (:mod:`dflash_prep.analyze.simulate`). Up to 2^19 samples they are exact simulations.
  Sorted-static is computed exactly from the histogram.
- The K table over K = 1..32 (window 0) uses the chain for efficiency and analytic
  estimates for repeat-pair rate (two co-batched samples of bucket b meet again with
  probability ``(n_b - 1) / (N_b - 1)``) and within-batch spread.
- ``plan.predicted`` is for the plan's (K, window): the chain when the window is 0, the
  simulation otherwise, with the step mix of ``pack``'s class-aware schedule at
  ``world_size x grad_accum`` beside it; ``predicted["window0"]`` holds the chain's figures.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numba as nb
import numpy as np

from dflash_prep import objectives
from dflash_prep.analyze import report, tradeoff
from dflash_prep.analyze.optimize import Histogram, Model, PackModel, histogram
from dflash_prep.analyze.simulate import SUBSAMPLE, Subsample
from dflash_prep.analyze.simulate import sorted_static as sorted_static_hist
from dflash_prep.errors import ConfigError
from dflash_prep.formats import plan as plan_mod
from dflash_prep.formats.lengths import LengthSource, load
from dflash_prep.formats.outputs import lock

MAX_K = 32
MULTI_START_GAP = 0.005  # model disagreement (efficiency) above which refine also starts from the baselines


@dataclass(frozen=True)
class AnalyzeConfig:
    """Options of ``dflash-prep analyze`` (one field per CLI flag)."""

    data: Path | None = None
    """Tokenized dataset folder (only ``lengths.npy`` is read)."""
    lengths_file: Path | None = None
    """What-if lengths: ``.npy`` or text with one integer per line (instead of ``data``)."""
    out: Path | None = None
    """Where plan.json, the PNG and the JSON report go (default: the dataset folder, or the
    lengths file's folder)."""
    budget: float = 65536
    """Token budget T per micro-batch (or cost budget C with ``budget_unit='cost'``)."""
    budget_unit: str = "tokens"
    """``tokens``: ``n * max_len <= T``; ``cost``: ``n * (max_len + alpha max_len^2) <= C``."""
    model_dim: int | None = None
    """d_model for ``alpha = 1 / (12 d_model)`` (needed by the cost unit)."""
    max_batch_size: int | None = None
    """Optional cap on samples per micro-batch."""
    buckets: int | None = None
    """Number of buckets K (default: chosen together with the window, see ``max_repeat_pair``)."""
    target_efficiency: float | None = None
    """Pick the smallest K <= 32 whose predicted efficiency reaches this (instead of K)."""
    seed: int = 0
    """Shuffle seed recorded in the plan (simulations use it too)."""
    window: int | None = None
    """Local sort window recorded in the plan (0 disables). None: chosen together with K
    (:mod:`dflash_prep.analyze.tradeoff`): the highest simulated efficiency whose repeat-pair rate
    stays <= ``max_repeat_pair``."""
    max_repeat_pair: float = plan_mod.MAX_REPEAT_PAIR
    """Limit on the simulated repeat-pair rate of the default plan (0.05: at least 95% of
    co-batched pairs are new each epoch); pack warns above the plan's limit."""
    world_size: int = 8
    """W of the step mix reported beside the plan (pack's class-aware schedule)."""
    grad_accum: int = 1
    """A of the step mix reported beside the plan."""
    sim_epochs: int = 2
    """Epochs simulated per row (at least 2: the repeat-pair rate compares two)."""
    subsample: int = SUBSAMPLE
    """Samples every simulated row packs at most (2^19); larger data is subsampled."""
    plot: bool = True
    """Write the PNG (histogram on a log length axis, the efficiency / repeat-pair trade-off)."""
    objective: str = "lm"
    """The objective packed later (:mod:`dflash_prep.objectives`); the report adds its
    prediction of ``pack --objective NAME`` under that name when it makes one (``dflash``:
    :func:`dflash_prep.objectives.dflash.predict`)."""
    options: object | None = None
    """The objective's options (``dflash``: :class:`dflash_prep.objectives.dflash.DrafterOptions`)."""
    overwrite: bool = False
    """Replace a plan.json with another fingerprint (the same plan is always rewritten). A
    file under ``out`` that dflash-prep did not write is never replaced."""

    def __post_init__(self):
        objectives.get(self.objective).check(None, self.options)
        if (self.data is None) == (self.lengths_file is None):
            raise ConfigError("give exactly one of a dataset folder (DATA) or --lengths FILE")
        if self.buckets is not None and self.target_efficiency is not None:
            raise ConfigError("give --buckets K or --target-efficiency E, not both")
        if self.buckets is not None and self.buckets < 1:
            raise ConfigError(f"--buckets must be at least 1, got {self.buckets}")
        if self.target_efficiency is not None and not 0 < self.target_efficiency <= 1:
            raise ConfigError(f"--target-efficiency must be in (0, 1], got {self.target_efficiency}")
        if self.window is not None and self.window < 0:
            raise ConfigError(f"--window must be >= 0 (0 disables), got {self.window}")
        plan_mod.check_seed(self.seed)
        if self.sim_epochs < 2:
            raise ConfigError(f"--sim-epochs must be at least 2 (the repeat-pair rate compares two epochs), "
                              f"got {self.sim_epochs}")
        if not 0 < self.max_repeat_pair <= 1:
            raise ConfigError(f"--max-repeat-pair must be in (0, 1], got {self.max_repeat_pair}")
        if self.world_size < 1 or self.grad_accum < 1:
            raise ConfigError(f"--world-size and --grad-accum must be >= 1, got {self.world_size} and {self.grad_accum}")
        if self.subsample < 1000:
            raise ConfigError(f"the simulation subsample must hold at least 1000 samples, got {self.subsample}")
        self.budget_spec  # validates unit / model_dim / max_batch_size

    @property
    def budget_spec(self) -> plan_mod.Budget:
        return plan_mod.Budget(unit=self.budget_unit, value=float(self.budget), model_dim=self.model_dim,
                               max_batch_size=self.max_batch_size)

    @property
    def out_dir(self) -> Path:
        if self.out is not None:
            return Path(self.out)
        return Path(self.data) if self.data is not None else Path(self.lengths_file).parent


# ----------------------------------------------------------------------------- boundaries
def equal_count_boundaries(hist: Histogram, k: int) -> tuple[int, ...]:
    """K buckets of about N/K samples: cut at the lengths of sample ranks ceil(i N / K)."""
    cum = np.cumsum(hist.counts)
    ranks = [-(-i * int(cum[-1]) // k) for i in range(1, k)]  # ceil, int64-exact
    idx = np.searchsorted(cum, np.asarray(ranks, np.int64), side="right")
    return _clean(hist, hist.values[np.minimum(idx, len(hist.values) - 1)])


@nb.njit(cache=True)
def _lhotse_bins(values, counts, per_bucket):
    # Lhotse estimate_duration_bins over sorted samples, run-length encoded: walk the samples
    # and, whenever the running mass exceeds per_bucket, open a bin at the current length.
    out = np.empty(values.shape[0], np.int64)
    m = 0
    tot = 0.0
    for t in range(values.shape[0]):
        v = float(values[t])
        left = counts[t]
        while left > 0:
            if tot > per_bucket:
                out[m] = values[t]
                m += 1
                tot = 0.0
            # add copies until the running mass exceeds per_bucket (or the run ends)
            need = int((per_bucket - tot) // v) + 1 if tot <= per_bucket else 1
            take = need if need < left else left
            tot += take * v
            left -= take
    return out[:m]


def equal_mass_boundaries(hist: Histogram, k: int) -> tuple[int, ...]:
    """Lhotse ``estimate_duration_bins`` semantics: about 1/K of all tokens per bucket.

    Samples sorted by length are walked with a running token sum; when it exceeds
    total/K, the current sample's length becomes a boundary (it opens the next bucket) and
    the sum restarts. Repeated lengths yield one boundary.
    """
    if k <= 1:
        return ()
    return _clean(hist, _lhotse_bins(hist.values, hist.counts, hist.total_tokens / k))


def _clean(hist: Histogram, b) -> tuple[int, ...]:
    b = np.unique(np.asarray(b, np.int64))
    return tuple(int(x) for x in b if hist.values[0] < x <= hist.values[-1])


# ----------------------------------------------------------------------------- analytic diversity
def analytic_diversity(model: Model, boundaries) -> tuple[float, float]:
    """(repeat-pair rate, mean within-batch spread) estimated from the histogram (window 0)."""
    h = model.hist
    pairs = rep = 0.0
    spread_w = spread_n = 0.0
    for i, j in model.index_ranges(boundaries):
        bk = model.bucket(i, j)
        nb_, n, mb = bk["count"], bk["batch_size"], bk["microbatches"]
        p = nb_ * max(n - 1.0, 0.0) / 2.0
        pairs += p
        if nb_ > 1:
            rep += p * max(n - 1.0, 0.0) / (nb_ - 1.0)
        # E[min] of ~n i.i.d. draws: lo + sum_t gap_t * P(all > v_t)
        v = h.values[i:j + 1].astype(np.float64)
        c = h.counts[i:j + 1].astype(np.float64)
        above = 1.0 - np.cumsum(c)[:-1] / nb_
        e_min = v[0] + float((np.diff(v) * np.power(np.clip(above, 0.0, 1.0), n)).sum())
        e_max = bk["mean_max"]
        spread_w += mb * (e_max - min(e_min, e_max)) / e_max
        spread_n += mb
    return (rep / pairs if pairs else 0.0), (spread_w / spread_n if spread_n else 0.0)


# ----------------------------------------------------------------------------- the stage
def length_stats(hist: Histogram) -> dict:
    """count, total tokens, min/p1/p50/p90/p99/max and the pile at the longest length."""
    cum = np.cumsum(hist.counts)
    n = int(cum[-1])

    def q(p):
        return int(hist.values[min(np.searchsorted(cum, int(np.ceil(p * n)), side="left"), len(cum) - 1)])

    pile = int(hist.counts[-1])
    return {"count": n, "total_tokens": hist.total_tokens, "mean": hist.total_tokens / n,
            "min": int(hist.values[0]), "p1": q(0.01), "p50": q(0.50), "p90": q(0.90), "p99": q(0.99),
            "max": hist.max_len, "distinct": int(len(hist.values)),
            "pile_at_max": {"length": hist.max_len, "count": pile, "share": pile / n}}


def fixed_k(cfg: AnalyzeConfig, model: Model, boundaries: list) -> int | None:
    """K from --buckets, the smallest K whose predicted efficiency reaches --target-efficiency,
    or None (K is then chosen together with the window)."""
    kmax = len(boundaries)
    if cfg.target_efficiency is None:
        return None if cfg.buckets is None else min(cfg.buckets, kmax)
    best = 0.0
    for k in range(1, kmax + 1):
        best = model.predict(boundaries[k - 1])["efficiency"]
        if best >= cfg.target_efficiency:
            return k
    raise ConfigError(f"no K <= {kmax} reaches a predicted efficiency of {cfg.target_efficiency:.3f} "
                      f"(best {best:.4f} at K = {kmax}); lower --target-efficiency, raise --budget, "
                      "or keep the local sort window (--window) that pack applies")


def run(cfg: AnalyzeConfig, *, source: LengthSource | None = None, progress: bool = False) -> dict:
    """Analyze, write ``plan.json`` (+ report JSON and PNG) and return the report dict.
    ``progress``: one stderr line per finished phase (name, seconds)."""
    out = cfg.out_dir
    report.check_outputs(out, plot=cfg.plot)
    with lock(out, inside=True):
        return _run(cfg, source, report, progress)


def _run(cfg: AnalyzeConfig, source: LengthSource | None, report, progress: bool = False) -> dict:
    clock = _Clock(log=progress)
    src = source or load(data=cfg.data, lengths_file=cfg.lengths_file)
    b = cfg.budget_spec
    hist = histogram(src.lengths)
    model = Model(hist, PackModel(b.value, b.packing_alpha, b.max_batch_size))  # checks the budget fits
    sub = Subsample.of(hist, cfg.subsample)
    clock("load + histogram")
    result = model.search(max(MAX_K, cfg.buckets or 0))
    clock("search")
    # the renewal chain has the last word; where the search's model is far off (small
    # budgets), the equal-count and equal-mass cuts are polished too and the best wins
    refined = [model.refine(bd, starts=(equal_count_boundaries(hist, kk), equal_mass_boundaries(hist, kk))
                            if model.disagreement(bd) > MULTI_START_GAP else ())
               for kk, bd in enumerate(result.boundaries, 1)]
    clock("refine")
    ev = tradeoff.Evaluator(sub, b, cfg.seed, cfg.sim_epochs)
    k_fixed = fixed_k(cfg, model, refined)
    ks = [k_fixed] if k_fixed else [k for k in tradeoff.JOINT_KS if k <= len(refined)]
    joint = tradeoff.choose(ev, refined, ks=ks, window=cfg.window, limit=cfg.max_repeat_pair)
    k, window = joint["k"], joint["window"]
    bounds = refined[k - 1]
    clock("choose K x window")
    strategies = strategy_rows(ev, model, cfg, k, bounds)
    clock("strategies")
    full, _ = sub.bucket_sizes(bounds)
    pareto_w = tradeoff.window_table(ev, bounds, k, tradeoff.window_grid(int(full.max())), cfg.max_repeat_pair,
                                     extra=(window,))
    plan_row = next(r for r in pareto_w if r["window"] == window)
    if window:
        strategies.append({"name": f"optimal K={k} + window {window}", "boundaries": list(bounds),
                           "efficiency_pred": plan_row["efficiency"], "efficiency_sim": plan_row["efficiency"],
                           **{m: plan_row[m] for m in ("fill", "microbatches", "repeat_pair", "spread")},
                           "how": plan_row["how"]})
    clock("window table")
    pareto_k = [{"k": kk, "boundaries": list(bd), **_pareto_k_row(model, bd),
                 "equal_mass_efficiency": model.predict(equal_mass_boundaries(hist, kk))["efficiency"]}
                for kk, bd in enumerate(refined, 1)]
    clock("K table")
    plan = _plan(src, model, cfg, bounds, plan_row, window).with_fingerprint()
    mix = tradeoff.step_mix(sub, plan, world_size=cfg.world_size, grad_accum=cfg.grad_accum)
    plan = _plan(src, model, cfg, bounds, plan_row, window, mix)
    clock("step mix")
    plan_path = plan_mod.save(plan, cfg.out_dir, overwrite=cfg.overwrite)
    strip = ("per_bucket_microbatches",)
    rep = {"data": src.describe(), "stats": length_stats(hist),
           "budget": {"unit": b.unit, "value": b.value, "alpha": b.packing_alpha, "max_batch_size": b.max_batch_size},
           "k": k, "boundaries": list(bounds), "window": window,
           "window_how": "given" if cfg.window is not None else "joint",
           "k_how": "joint" if k_fixed is None else ("target" if cfg.target_efficiency else "given"),
           "max_repeat_pair": cfg.max_repeat_pair, "simulated_samples": int(len(sub.lengths)),
           "strategies": strategies, "pareto_k": pareto_k,
           "pareto_window": [{kk: vv for kk, vv in r.items() if kk not in strip} for r in pareto_w],
           "joint": [{kk: vv for kk, vv in r.items() if kk not in strip} for r in joint["candidates"]],
           "predicted": plan.predicted, "plan": str(plan_path), "fingerprint": plan_mod.load(plan_path).fingerprint,
           "warnings": window_warnings(plan_row, pareto_w, cfg.max_repeat_pair)}
    predicted = objectives.get(cfg.objective).predict(src, cfg.options, b, seed=cfg.seed)
    if predicted is not None:
        rep[cfg.objective] = predicted
    rep["png"] = str(report.plot(hist, rep, cfg.out_dir)) if cfg.plot else None
    clock("plan + plot")
    rep["seconds"] = clock.laps
    rep["cpu_seconds"] = clock.cpu
    rep["report"] = str(report.write_json(rep, cfg.out_dir))
    return rep


def strategy_rows(ev: tradeoff.Evaluator, model: Model, cfg: AnalyzeConfig, k: int, bounds) -> list[dict]:
    """sorted-static (exact, from the histogram), full random, equal-count, equal-mass and optimal:
    chain prediction + simulation (window 0)."""
    hist = model.hist
    b = cfg.budget_spec
    st = sorted_static_hist(hist, budget=b)
    rows = [{"name": "sorted-static", "boundaries": [], "efficiency_pred": st["efficiency"],
             "efficiency_sim": st["efficiency"], "fill": st["fill"], "microbatches": st["microbatches"],
             "repeat_pair": 1.0, "spread": st["spread"], "how": "exact, from the histogram"}]
    for name, bd in (("full random", ()), (f"equal-count K={k}", equal_count_boundaries(hist, k)),
                     (f"equal-mass K={k}", equal_mass_boundaries(hist, k)), (f"optimal K={k}", bounds)):
        sim = ev(bd, 0)
        rows.append({"name": name, "boundaries": list(bd), "efficiency_pred": model.predict(bd)["efficiency"],
                     "efficiency_sim": sim.efficiency, "fill": sim.fill, "microbatches": sim.microbatches,
                     "repeat_pair": sim.repeat_pair, "spread": sim.spread, "how": "chain model + " + sim.how})
    return rows


def _pareto_k_row(model: Model, bd) -> dict:
    pred = model.predict(bd)
    rp, sp = analytic_diversity(model, bd)
    return {"efficiency": pred["efficiency"], "fill": pred["fill"], "microbatches": pred["microbatches"],
            "repeat_pair": rp, "spread": sp, "how": "chain model + analytic"}


def window_warnings(plan_row: dict, pareto_w: list[dict], limit: float) -> list[str]:
    """A warning when the plan's (K, window) leaves a repeat-pair rate above ``limit``."""
    rp, window = plan_row["repeat_pair"], plan_row["window"]
    if rp <= limit:
        return []
    ok = [r["window"] for r in pareto_w if r["repeat_pair"] <= limit]
    fix = (f"The largest window in the table within it: --window {max(ok)}." if ok else
           "No window of this K is within it: use fewer --buckets, a smaller --window, or more data.")
    return [f"K={plan_row['k']} window {window}: simulated repeat-pair rate {rp:.3f} is above --max-repeat-pair "
            f"{limit:g}, so fewer than {1 - limit:.0%} of co-batched pairs are new each epoch. {fix}"]


def _plan(src: LengthSource, model: Model, cfg: AnalyzeConfig, bounds, plan_row: dict, window: int,
          mix: dict | None = None) -> plan_mod.Plan:
    """The plan: boundaries, budget, seed, window, per-bucket figures and the prediction."""
    pred0 = model.predict(bounds)
    w0 = {"efficiency": pred0["efficiency"], "fill": pred0["fill"], "microbatches": pred0["microbatches"],
          "window": 0, "how": "model"}
    if window == 0:
        predicted = dict(w0)
        per_bucket_mb = [bk["microbatches"] for bk in pred0["buckets"]]
    else:
        predicted = {"efficiency": plan_row["efficiency"], "fill": plan_row["fill"],
                     "microbatches": plan_row["microbatches"], "window": window, "how": "simulated, " + plan_row["how"]}
        per_bucket_mb = plan_row["per_bucket_microbatches"]
    predicted["repeat_pair"] = plan_row["repeat_pair"]
    predicted["max_repeat_pair"] = cfg.max_repeat_pair
    predicted["step_mix"] = mix
    predicted["window0"] = w0
    edges = [0, *bounds, model.hist.max_len + 1]  # bucket t holds [edges[t], edges[t+1])
    buckets = tuple({"lo": edges[t], "hi": edges[t + 1], "count": bk["count"], "tokens": bk["tokens"],
                     "expected_microbatches": float(per_bucket_mb[t]),
                     "expected_microbatches_window0": bk["microbatches"]} for t, bk in enumerate(pred0["buckets"]))
    return plan_mod.Plan(data=src.describe(), boundaries=tuple(bounds), budget=cfg.budget_spec, seed=cfg.seed,
                         window=window, buckets=buckets, predicted=predicted)


class _Clock:
    """Wall-clock and CPU laps of the stage's phases (reported, so the benchmark can break them
    down; on a shared machine the CPU seconds are the fair measure)."""

    def __init__(self, log: bool = False):
        self.log = log
        self._now, self._cpu = time.perf_counter, time.process_time
        self._t, self._c = self._now(), self._cpu()
        self.laps: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def __call__(self, name: str) -> None:
        t, c = self._now(), self._cpu()
        self.laps[name], self.cpu[name] = t - self._t, c - self._c
        self._t, self._c = t, c
        if self.log:
            print(f"analyze: {name} done ({self.laps[name]:.1f} s)", file=sys.stderr, flush=True)
