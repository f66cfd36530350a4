"""dflash-prep's own rows for :mod:`bench.peers`, through the public library only.

Boundaries come from :mod:`dflash_prep.optimize` (the exact DP over the length histogram;
auto-K from :mod:`dflash_prep.analyze`), and every epoch from
:func:`dflash_prep.pack.build_epoch`: the same code ``dflash-prep pack`` runs, with W
ranks, A = 1 and the class-aware step schedule. Nothing of our algorithms is re-implemented
here; this module only turns a manifest's arrays into the ``(order, offsets, step, rank)``
that :func:`bench.peers.measure` scores like any peer's.

Rows (keys for ``--skip``):

- ``k6``: K optimal boundaries, no sorting window (the seed's bucketed shuffle, made exact);
- ``auto``: the bucket count analyze picks on its own (auto-K), no window;
- ``window``: K optimal + pack's default sorting window (:data:`packing.DEFAULT_WINDOW`);
  this is the default padded layout, and HF's batch size is matched to its mean;
- ``window-cost``: the same under a cost budget of 1.3 T (DESIGN.md), for rank balance;
- ``varlen``: concatenated sequences, keyed random order, first-fit into 4 open bins.
"""

from __future__ import annotations

import numpy as np

from dflash_prep import optimize, pack, packing
from dflash_prep.fileio import fingerprint_array
from dflash_prep.plan import Budget, Plan

from .peer_samplers import PeerEpoch

COST_BUDGET_FACTOR = 1.3  # DESIGN.md: cost budget 1.3 x T


def _data(lengths: np.ndarray) -> dict:
    return {"kind": "bench", "path": None, "fingerprint": fingerprint_array(np.asarray(lengths, np.int64)),
            "num_samples": int(len(lengths))}


def optimal_boundaries(lengths: np.ndarray, k: int, budget: Budget) -> tuple[int, ...]:
    """Optimal K-bucket boundaries from the optimize DP (window 0 model)."""
    model = optimize.Model(optimize.histogram(lengths),
                           optimize.PackModel(budget=budget.value, alpha=budget.packing_alpha,
                                              max_batch_size=budget.max_batch_size))
    return model.search(k).boundaries[-1]


def auto_boundaries(lengths: np.ndarray, budget: Budget) -> tuple[tuple[int, ...], str]:
    """Boundaries of the bucket count analyze's auto-K picks, and how it chose."""
    from dflash_prep import analyze

    return analyze.auto_boundaries(lengths, budget)


def epoch_fn(lengths: np.ndarray, plan: Plan, cfg: pack.PackConfig):
    """``e -> (PeerEpoch, step, rank)`` from :func:`pack.build_epoch`'s manifest arrays."""
    layout = cfg.layout

    def fn(e: int):
        res = pack.build_epoch(lengths, plan, cfg, e)
        table = res.arrays["microbatches"]          # (M, columns) int64, manifest.COLUMNS
        col = {c: i for i, c in enumerate(res.header["columns"])}
        start, count = table[:, col["start"]], table[:, col["count"]]
        ids = res.arrays["sample_ids"]
        offsets = np.append(start, np.int64(len(ids))).astype(np.int64)
        if not np.array_equal(np.diff(offsets), count):
            raise RuntimeError("manifest rows are not contiguous in sample_ids; bench.ours needs updating")
        ep = PeerEpoch(np.asarray(ids, np.int64), offsets, layout == "varlen", "dflash-prep (pack.build_epoch)")
        return ep, table[:, col["step"]].astype(np.int64), table[:, col["rank"]].astype(np.int64)
    return fn


def our_rows(lengths: np.ndarray, cfg, measure) -> list:
    """Our strategies on one length set, measured by ``measure`` exactly like the peers."""
    lens = np.asarray(lengths, np.int64)
    W, s = cfg.world_size, cfg.seed
    tokens = Budget(unit="tokens", value=cfg.budget, model_dim=cfg.model_dim)
    cost = Budget(unit="cost", value=COST_BUDGET_FACTOR * cfg.budget, model_dim=cfg.model_dim)
    data = _data(lens)
    rows = []

    def row(key, name, budget, boundaries_fn, window, layout="padded", default=False, notes=""):
        if key in cfg.skip:
            return

        def setup():
            bounds, how = boundaries_fn()
            plan = Plan(data=data, boundaries=tuple(int(b) for b in bounds), budget=budget, seed=s,
                        window=window).with_fingerprint()
            pc = pack.PackConfig(world_size=W, grad_accum=1, layout=layout, schedule="class-aware", window=window)
            return epoch_fn(lens, plan, pc), {"boundaries": [int(b) for b in bounds], "how": how, "window": window,
                                              "budget": {"unit": budget.unit, "value": budget.value},
                                              "default": default}
        print(f"  {name} ...", flush=True, file=__import__("sys").stderr)
        rows.append(measure(name, "ours", setup, lens, cfg, notes))

    k = cfg.k
    w = packing.DEFAULT_WINDOW
    opt = lambda b: (lambda: (optimal_boundaries(lens, k, b), f"optimize DP, K={k}"))  # noqa: E731
    row("k6", f"dflash-prep padded K={k}, no window", tokens, opt(tokens), 0)
    try:
        from dflash_prep import analyze  # noqa: F401
        row("auto", "dflash-prep padded auto-K, no window", tokens, lambda: auto_boundaries(lens, tokens), 0)
    except ImportError:
        print("  auto-K row left out: dflash_prep.analyze is not available", flush=True, file=__import__("sys").stderr)
    row("window", f"dflash-prep padded K={k}, window {w} (default)", tokens, opt(tokens), w, default=True)
    row("window-cost", f"dflash-prep padded K={k}, window {w}, cost budget {COST_BUDGET_FACTOR}T", cost, opt(cost), w)
    row("varlen", "dflash-prep varlen, first-fit 4 open bins", tokens, lambda: ((), "no buckets"), 0, layout="varlen")
    return rows
