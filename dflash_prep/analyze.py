"""``dflash-prep analyze``: choose bucket boundaries, compare strategies, write ``plan.json``.

Pipeline: lengths (dataset folder or what-if file) -> histogram -> boundary search for
K = 1..32 (:mod:`dflash_prep.optimize`) -> polish against the renewal chain where the
search's O(1) model is off -> strategy table, Pareto tables -> ``plan.json``, plus the
JSON report and PNG rendered by :mod:`dflash_prep.report`.

What is predicted and what is simulated:

- "pred" figures (window 0, any boundaries) come from the renewal chain
  (:mod:`dflash_prep.renewal`), within 0.05 pp of simulated efficiency in
  ``bench/analyze_accuracy.py``.
- Every strategy row is also *simulated*: ``pack_padded_epoch`` (the exact procedure
  ``pack`` runs) over ``epochs`` epochs (>= 3); efficiency, fill and micro-batches are the
  mean over them, repeat-pair rate and within-batch spread come from epochs 0 and 1.
- The Pareto table over K = 1..32 uses the chain for efficiency and analytic estimates
  for repeat-pair rate (two co-batched samples of bucket b meet again with probability
  ``(n_b - 1) / (N_b - 1)``; measured error < 1e-5) and within-batch spread
  (``(E[max] - E[min]) / E[max]`` of ~n_b i.i.d. draws; within 0.06 for K >= 6, poor for
  K <= 2 at small budgets). The Pareto table over windows is simulated.
- ``plan.predicted`` is for the plan's window: the chain when the window is 0, the mean of
  the simulated epochs otherwise; ``predicted["window0"]`` always holds the chain's figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numba as nb
import numpy as np

from . import metrics
from . import plan as plan_mod
from .errors import ConfigError
from .lengths import LengthSource, load
from .optimize import Histogram, Model, PackModel, histogram
from .bucketing import greedy_offsets, pack_padded_epoch

WINDOWS = (0, 1024, 2048, 4096)   # local sort windows the Pareto table simulates
SMALL_WINDOWS = (64, 128, 256, 512)  # added for small data, where a window covers much of a bucket
SMALL_DATA = 200_000
REPEAT_PAIR_WARN = 0.05           # above this an epoch barely changes batch composition
AUTO_REPEAT_SLACK = 0.01          # auto window: repeat-pair may rise at most this much over window 0
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
    """Number of buckets K (default 6 unless ``target_efficiency`` is given)."""
    target_efficiency: float | None = None
    """Pick the smallest K <= 32 whose predicted efficiency reaches this (instead of K)."""
    seed: int = 0
    """Shuffle seed recorded in the plan (simulations use it too)."""
    window: int | None = None
    """Local sort window recorded in the plan (0 disables). None = auto: the largest simulated
    window whose repeat-pair rate stays within AUTO_REPEAT_SLACK (0.01) of window 0's. On
    seedlike (902K) that is 2048 (efficiency 0.990, repeat-pair 0.0064); on small data it
    shrinks, because a fixed window covers more of each bucket."""
    epochs: int = 3
    """Epochs simulated per strategy row (at least 3)."""
    plot: bool = True
    """Write the PNG (histogram with boundaries, efficiency per K)."""
    drafter: object | None = None
    """``--objective dflash``: :class:`dflash_prep.pack_dflash.DrafterOptions`; the report then
    predicts ``pack --objective dflash`` (:func:`dflash_prep.pack_dflash.predict`)."""

    def __post_init__(self):
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
        if self.epochs < 3:
            raise ConfigError(f"--epochs must be at least 3 (a simulated figure is a mean over >= 3), "
                              f"got {self.epochs}")
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


# ----------------------------------------------------------------------------- simulation
@dataclass
class Simulated:
    """Means over the simulated epochs."""

    efficiency: float
    fill: float
    microbatches: float
    repeat_pair: float
    spread: float
    per_bucket_microbatches: list = field(default_factory=list)


def simulate(lengths: np.ndarray, boundaries, cfg: AnalyzeConfig, *, window: int) -> Simulated:
    """Run ``pack_padded_epoch`` for ``cfg.epochs`` epochs; average the DESIGN.md metrics."""
    b = cfg.budget_spec
    effs, fills, mbs, rps, sps = [], [], [], [], []
    per_bucket = np.zeros(len(boundaries) + 1)
    prev = None
    for ep in range(cfg.epochs):
        order, offsets, bb = pack_padded_epoch(lengths, boundaries, seed=cfg.seed, epoch=ep, budget=b.value,
                                               alpha=b.packing_alpha, max_batch_size=b.max_batch_size,
                                               window=window)
        eff, fl = metrics.efficiency_and_fill(lengths, order, offsets, b.value, alpha=b.packing_alpha)
        effs.append(eff)
        fills.append(fl)
        mbs.append(len(offsets) - 1)
        per_bucket += np.bincount(bb, minlength=len(per_bucket))
        if ep < 2:  # diversity from epochs 0 and 1 (one repeat-pair rate); the rest only for means
            sps.append(metrics.within_batch_spread(lengths, order, offsets))
            if prev is not None:
                rps.append(metrics.repeat_pair_rate(prev[0], prev[1], order, offsets, len(lengths)))
            prev = (order, offsets)
    return Simulated(float(np.mean(effs)), float(np.mean(fills)), float(np.mean(mbs)), float(np.mean(rps)),
                     float(np.mean(sps)), (per_bucket / cfg.epochs).tolist())


def _fill(lengths, order, offsets, b: plan_mod.Budget) -> float:
    return metrics.fill(lengths, order, offsets, b.value, alpha=b.packing_alpha)


def sorted_static(lengths: np.ndarray, b: plan_mod.Budget) -> dict:
    """Global sort by length, fixed greedy batches: deterministic, so exact (not simulated)."""
    ids = np.argsort(lengths, kind="stable")
    offsets = greedy_offsets(ids, lengths, b.value, alpha=b.packing_alpha, max_batch_size=b.max_batch_size)
    eff = metrics.efficiency(lengths, ids, offsets)
    return {"boundaries": [], "efficiency_pred": eff, "efficiency_sim": eff, "fill": _fill(lengths, ids, offsets, b),
            "microbatches": float(len(offsets) - 1), "repeat_pair": 1.0,
            "spread": metrics.within_batch_spread(lengths, ids, offsets), "how": "exact (deterministic)"}


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


def choose_k(cfg: AnalyzeConfig, model: Model, boundaries: list) -> int:
    """K from --buckets, or the smallest K whose predicted efficiency reaches --target-efficiency."""
    kmax = len(boundaries)
    if cfg.target_efficiency is None:
        return min(cfg.buckets or 6, kmax)
    best = 0.0
    for k in range(1, kmax + 1):
        best = model.predict(boundaries[k - 1])["efficiency"]
        if best >= cfg.target_efficiency:
            return k
    raise ConfigError(f"no K <= {kmax} reaches a predicted efficiency of {cfg.target_efficiency:.3f} "
                      f"(best {best:.4f} at K = {kmax}); lower --target-efficiency, raise --budget, "
                      "or keep the local sort window (--window) that pack applies")


def run(cfg: AnalyzeConfig, *, source: LengthSource | None = None) -> dict:
    """Analyze, write ``plan.json`` (+ report JSON and PNG) and return the report dict."""
    from . import report  # matplotlib / rich stay out of library imports that do not report

    clock = _Clock()
    src = source or load(data=cfg.data, lengths_file=cfg.lengths_file)
    lengths = src.lengths
    b = cfg.budget_spec
    hist = histogram(lengths)
    model = Model(hist, PackModel(b.value, b.packing_alpha, b.max_batch_size))  # checks the budget fits
    clock("load + histogram")
    result = model.search(max(MAX_K, cfg.buckets or 0))
    clock("search")
    # the renewal chain has the last word; where the search's model is far off (small
    # budgets), the equal-count and equal-mass cuts are polished too and the best wins
    refined = [model.refine(bd, starts=(equal_count_boundaries(hist, kk), equal_mass_boundaries(hist, kk))
                            if model.disagreement(bd) > MULTI_START_GAP else ())
               for kk, bd in enumerate(result.boundaries, 1)]
    clock("refine")
    k = choose_k(cfg, model, refined)
    bounds = refined[k - 1]
    strategies = strategy_rows(lengths, model, cfg, k, bounds)
    clock("strategies")
    pareto_w = pareto_windows(lengths, cfg, bounds, strategies[-1])
    window = auto_window(pareto_w) if cfg.window is None else cfg.window
    plan_row = next(r for r in pareto_w if r["window"] == window)
    if window:
        strategies.append({"name": f"optimal K={k} + window {window}", "boundaries": list(bounds),
                           "efficiency_pred": plan_row["efficiency"], "efficiency_sim": plan_row["efficiency"],
                           **{m: plan_row[m] for m in ("fill", "microbatches", "repeat_pair", "spread")},
                           "how": f"{cfg.epochs} sim epochs"})
    clock("pareto windows")
    pareto_k = [{"k": kk, "boundaries": list(bd), **_pareto_k_row(model, bd),
                 "equal_mass_efficiency": model.predict(equal_mass_boundaries(hist, kk))["efficiency"]}
                for kk, bd in enumerate(refined, 1)]
    clock("pareto K")
    plan = _plan(src, model, cfg, bounds, plan_row, window)
    plan_path = plan_mod.save(plan, cfg.out_dir)
    rep = {"data": src.describe(), "stats": length_stats(hist),
           "budget": {"unit": b.unit, "value": b.value, "alpha": b.packing_alpha, "max_batch_size": b.max_batch_size},
           "k": k, "boundaries": list(bounds), "window": window,
           "window_how": "auto" if cfg.window is None else "given", "strategies": strategies, "pareto_k": pareto_k,
           "pareto_window": [{kk: vv for kk, vv in r.items() if kk != "per_bucket_microbatches"} for r in pareto_w],
           "predicted": plan.predicted, "plan": str(plan_path), "fingerprint": plan_mod.load(plan_path).fingerprint,
           "warnings": window_warnings(window, pareto_w)}
    if cfg.drafter is not None:                   # --objective dflash (needs the dataset's mask counts)
        from .pack_dflash import predict_source
        rep["dflash"] = predict_source(src, cfg.drafter, b.value, seed=cfg.seed)
    rep["png"] = str(report.plot(hist, rep, cfg.out_dir)) if cfg.plot else None
    clock("plan + plot")
    rep["seconds"] = clock.laps
    rep["report"] = str(report.write_json(rep, cfg.out_dir))
    return rep


def strategy_rows(lengths, model: Model, cfg: AnalyzeConfig, k: int, bounds) -> list[dict]:
    """sorted-static, full random, equal-count, equal-mass and optimal: chain + simulated."""
    hist = model.hist
    rows = [{"name": "sorted-static", **sorted_static(lengths, cfg.budget_spec)}]
    for name, bd in (("full random", ()), (f"equal-count K={k}", equal_count_boundaries(hist, k)),
                     (f"equal-mass K={k}", equal_mass_boundaries(hist, k)), (f"optimal K={k}", bounds)):
        sim = simulate(lengths, bd, cfg, window=0)
        rows.append({"name": name, "boundaries": list(bd), "efficiency_pred": model.predict(bd)["efficiency"],
                     "efficiency_sim": sim.efficiency, "fill": sim.fill, "microbatches": sim.microbatches,
                     "repeat_pair": sim.repeat_pair, "spread": sim.spread,
                     "how": f"chain model + {cfg.epochs} sim epochs"})
    return rows


def pareto_windows(lengths, cfg: AnalyzeConfig, bounds, window0_row: dict) -> list[dict]:
    """Simulated rows for each local sort window at the chosen boundaries (window 0 reused)."""
    windows = set(WINDOWS) | {cfg.window or 0} | (set(SMALL_WINDOWS) if len(lengths) < SMALL_DATA else set())
    rows = []
    for w in sorted(windows):
        if w == 0:
            rows.append({"window": 0, "how": "sim", **{m: window0_row[m] for m in (
                "fill", "microbatches", "repeat_pair", "spread")}, "efficiency": window0_row["efficiency_sim"]})
            continue
        sim = simulate(lengths, bounds, cfg, window=w)
        rows.append({"window": w, "efficiency": sim.efficiency, "fill": sim.fill, "microbatches": sim.microbatches,
                     "repeat_pair": sim.repeat_pair, "spread": sim.spread, "how": "sim",
                     "per_bucket_microbatches": sim.per_bucket_microbatches})
    return rows


def _pareto_k_row(model: Model, bd) -> dict:
    pred = model.predict(bd)
    rp, sp = analytic_diversity(model, bd)
    return {"efficiency": pred["efficiency"], "fill": pred["fill"], "microbatches": pred["microbatches"],
            "repeat_pair": rp, "spread": sp, "how": "chain model + analytic"}


def auto_window(pareto_w: list[dict]) -> int:
    """The largest simulated window whose repeat-pair rate is at most window 0's + AUTO_REPEAT_SLACK.

    Window 0 already sets the floor of how often pairs meet again (small buckets repeat pairs
    by chance); a window may add at most 0.01 to that, so composition keeps changing.
    """
    base = next(r for r in pareto_w if r["window"] == 0)["repeat_pair"]
    return max(r["window"] for r in pareto_w if r["repeat_pair"] <= base + AUTO_REPEAT_SLACK)


def window_warnings(window: int, pareto_w: list[dict]) -> list[str]:
    """A warning when the plan's window leaves a repeat-pair rate above REPEAT_PAIR_WARN."""
    row = next(r for r in pareto_w if r["window"] == window)
    if not window or row["repeat_pair"] <= REPEAT_PAIR_WARN:
        return []
    ok = [r["window"] for r in pareto_w if r["repeat_pair"] <= REPEAT_PAIR_WARN and r["window"]]
    return [f"window {window}: repeat-pair rate {row['repeat_pair']:.3f} (> {REPEAT_PAIR_WARN}); the window "
            "covers much of a bucket, so batches barely change between epochs. "
            + (f"The largest window in the table that stays below it: --window {max(ok)}." if ok
               else "Use a smaller --window.")]


def _plan(src: LengthSource, model: Model, cfg: AnalyzeConfig, bounds, plan_row: dict, window: int) -> plan_mod.Plan:
    """The plan: boundaries, budget, seed, window, per-bucket figures and the prediction."""
    pred0 = model.predict(bounds)
    w0 = {"efficiency": pred0["efficiency"], "fill": pred0["fill"], "microbatches": pred0["microbatches"],
          "window": 0, "how": "model"}
    if window == 0:
        predicted = dict(w0)
        per_bucket_mb = [bk["microbatches"] for bk in pred0["buckets"]]
    else:
        predicted = {"efficiency": plan_row["efficiency"], "fill": plan_row["fill"],
                     "microbatches": plan_row["microbatches"], "window": window,
                     "how": f"simulated, mean of {cfg.epochs} epochs"}
        per_bucket_mb = plan_row["per_bucket_microbatches"]
    predicted["window0"] = w0
    edges = [0, *bounds, model.hist.max_len + 1]  # bucket t holds [edges[t], edges[t+1])
    buckets = tuple({"lo": edges[t], "hi": edges[t + 1], "count": bk["count"], "tokens": bk["tokens"],
                     "expected_microbatches": float(per_bucket_mb[t]),
                     "expected_microbatches_window0": bk["microbatches"]} for t, bk in enumerate(pred0["buckets"]))
    return plan_mod.Plan(data=src.describe(), boundaries=tuple(bounds), budget=cfg.budget_spec, seed=cfg.seed,
                         window=window, buckets=buckets, predicted=predicted)


class _Clock:
    """Wall-clock laps of the stage's phases (reported, so the benchmark can break them down)."""

    def __init__(self):
        import time

        self._now = time.perf_counter
        self._t = self._now()
        self.laps: dict[str, float] = {}

    def __call__(self, name: str) -> None:
        t = self._now()
        self.laps[name] = t - self._t
        self._t = t
