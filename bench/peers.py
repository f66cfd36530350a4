"""dflash-prep side by side with the samplers users would pick instead (issue 7).

``python -m dflash_prep.bench.peers`` (``make bench``) runs every strategy on the same lengths, the
same budget T and the same step layout (W ranks, A = 1), and measures all of them with
:mod:`dflash_prep.pack.metrics`, the one implementation of definitions.md's definitions:

- efficiency (padded layouts) and fill; micro-batches per epoch; share of micro-batches
  over the budget (HF's fixed batch size and Lhotse's soft ``max_duration`` can exceed T);
- repeat-pair rate between epochs 0 and 1; step mix and rank imbalance at W (alpha from
  ``--model-dim``);
- wall time: ``setup`` is the one-time work (Lhotse's bin estimate, fairseq's and TRL's
  static batching); ``epoch`` is epoch 1's plan, timed after epoch 0 warmed every cache.

Length sets: ``seedlike`` (definitions.md's 902,087 lengths) and ``demo-bpe`` (the demo chat
corpus tokenized with a BPE trained by ``tokenizers``; see :mod:`bench.corpus`). The peers
are in :mod:`bench.peer_samplers`; our rows go through the public ``analyze`` and ``pack``
library functions (:mod:`bench.ours`). Output: a markdown table on stdout, and
``results/bench/peers.json`` (format ``dflash-prep/bench-peers`` v1) + ``peers.png``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from dflash_prep.errors import ConfigError
from dflash_prep.formats.fileio import atomic_write_bytes, atomic_write_json
from dflash_prep.pack import metrics

from . import peer_samplers as ps

BENCH_FORMAT = "dflash-prep/bench-peers"
BENCH_VERSION = 1
LENGTH_SETS = ("seedlike", "demo-bpe")


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run.

    Attributes:
        sets: length sets to run, from :data:`LENGTH_SETS`.
        n: samples in ``seedlike`` (definitions.md: 902,087).
        demo_n: conversations in the demo corpus behind ``demo-bpe``.
        budget: T, tokens per padded micro-batch (``n * max_len <= T``) or per packed row.
        world_size: W; A = 1, so a step is W consecutive micro-batches.
        model_dim: d_model of the cost model (alpha = 1 / (12 d)) for rank imbalance.
        k: our bucket count and Lhotse's ``num_buckets`` "at our K".
        seed: one seed for every strategy.
        skip: strategy keys to leave out: lhotse-k, lhotse-default, hf, fairseq, trl,
            random (peers), k6, auto, window, varlen (ours).
        out: folder for peers.json and peers.png.
    """

    sets: tuple[str, ...] = LENGTH_SETS
    n: int = 902_087
    demo_n: int = 60_000
    budget: int = 65536
    world_size: int = 8
    model_dim: int = 768
    k: int = 6
    seed: int = 0
    skip: tuple[str, ...] = ()
    out: Path = Path("results/bench")

    def __post_init__(self):
        bad = [s for s in self.sets if s not in LENGTH_SETS]
        if bad:
            raise ConfigError(f"unknown length set(s) {bad}; choose from {', '.join(LENGTH_SETS)}")
        if self.n < 100 or self.demo_n < 100:
            raise ConfigError(f"--n and --demo-n must be at least 100, got {self.n} and {self.demo_n}")
        if self.budget < 1 or self.world_size < 1 or self.model_dim < 1 or self.k < 2:
            raise ConfigError("--budget, --world-size, --model-dim must be positive and --k at least 2")


@dataclass
class Row:
    """One strategy's measurements on one length set (None where a figure does not apply)."""

    name: str
    family: str                  # "ours", "peer" or "reference"
    impl: str
    layout: str                  # "padded" or "varlen"
    efficiency: float | None
    fill: float
    microbatches: int
    over_budget: float           # share of micro-batches over the budget: padded (varlen: real)
                                 # tokens > T, or cost > C for a cost budget
    max_load: float              # largest micro-batch load / its budget
    repeat_pair: float
    step_mix: float
    rank_imbalance: float
    setup_s: float
    epoch_s: float
    notes: str = ""
    extra: dict = field(default_factory=dict)


# A strategy: setup() -> (epoch_fn, extra), where epoch_fn(e) -> (PeerEpoch, step, rank) and
# extra is a dict of facts for the JSON (boundaries, batch size, ...).
EpochFn = Callable[[int], tuple[ps.PeerEpoch, np.ndarray, np.ndarray]]


def measure(name: str, family: str, setup: Callable[[], tuple[EpochFn, dict]], lengths: np.ndarray,
            cfg: BenchConfig, notes: str = "", edges: np.ndarray | None = None) -> Row:
    """Run epochs 0 and 1 of one strategy and compute every figure with dflash_prep.pack.metrics."""
    t0 = time.perf_counter()
    epoch_fn, extra = setup()
    setup_s = extra.pop("setup_s", time.perf_counter() - t0)  # a shared one-time step reports its own time
    e0, _, _ = epoch_fn(0)
    t1 = time.perf_counter()
    e1, step1, rank1 = epoch_fn(1)
    epoch_s = time.perf_counter() - t1
    n = len(lengths)
    if edges is None:
        edges = metrics.class_edges(lengths)
    counts, real, mx = metrics.batch_stats(lengths, e1.order, e1.offsets)
    alpha = metrics.alpha_for(cfg.model_dim)
    cost = metrics.batch_cost(lengths, e1.order, e1.offsets, alpha, varlen=e1.varlen)
    own = extra.get("budget", {})
    if own.get("unit") == "cost":     # a cost budget is checked, and fills, in its own unit
        load, limit, fill_alpha = cost, float(own["value"]), alpha
    else:
        load, limit, fill_alpha = (real if e1.varlen else counts * mx), float(cfg.budget), 0.0
    return Row(
        name=name, family=family, impl=e1.impl, layout="varlen" if e1.varlen else "padded",
        efficiency=None if e1.varlen else metrics.efficiency(lengths, e1.order, e1.offsets),
        fill=metrics.fill(lengths, e1.order, e1.offsets, limit, varlen=e1.varlen, alpha=fill_alpha),
        microbatches=e1.num_batches,
        over_budget=float((load > limit).mean()),
        max_load=float(load.max()) / limit,
        repeat_pair=metrics.repeat_pair_rate(e0.order, e0.offsets, e1.order, e1.offsets, n),
        step_mix=metrics.step_mix(lengths, e1.order, e1.offsets, step1, edges=edges),
        rank_imbalance=metrics.rank_imbalance(cost, step1, rank1, cfg.world_size),
        setup_s=setup_s, epoch_s=epoch_s, notes=notes, extra=dict(extra))


def _consecutive(make: Callable[[int], ps.PeerEpoch], world_size: int) -> EpochFn:
    def fn(e: int):
        ep = make(e)
        step, rank = ps.consecutive_steps(ep.num_batches, world_size)
        return ep, step, rank
    return fn


def peer_rows(lengths: np.ndarray, cfg: BenchConfig, *, hf_batch: int) -> list[Row]:
    """Every peer on one length set, in the order of docs/benchmarks.md#side-by-side-with-the-peers."""
    T, W, s = cfg.budget, cfg.world_size, cfg.seed
    rows = []

    def run(key, name, setup, notes=""):
        if key in cfg.skip:
            return
        print(f"  {name} ...", file=sys.stderr, flush=True)
        rows.append(measure(name, "peer" if name != "full random" else "reference", setup, lengths, cfg, notes))

    for key, nb_, from_all, label in (
            ("lhotse-k", cfg.k, True, f"Lhotse DynamicBucketing, K={cfg.k} (estimate_duration_buckets)"),
            ("lhotse-default", 10, False, "Lhotse DynamicBucketing, num_buckets=10 (default)")):
        def setup(nb_=nb_, from_all=from_all):
            lh = ps.Lhotse(lengths, budget=T, num_buckets=nb_, world_size=W, seed=s, bins_from_all=from_all)
            return _consecutive(lh.epoch, W), {"boundaries": [round(b) for b in lh.boundaries]}
        run(key, label, setup, "same bucket on all W ranks (sync_buckets)")
    run("hf", f"HF LengthGroupedSampler, batch {hf_batch}",
        lambda: (_consecutive(lambda e: ps.hf_length_grouped_epoch(lengths, batch_size=hf_batch, seed=s, epoch=e), W),
                 {"batch_size": hf_batch}),
        "fixed batch size = our mean micro-batch; no token budget")

    def fairseq():
        fs = ps.FairseqBatchBySize(lengths, budget=T, seed=s)
        return _consecutive(fs.epoch, W), {}
    run("fairseq", "fairseq batch_by_size (sorted-static)", fairseq, "batches fixed once, order shuffled")

    def trl():
        tr = ps.TrlBfd(lengths, budget=T, seed=s)
        return _consecutive(tr.epoch, W), {}
    run("trl", "TRL BFD packing (static)", trl, "packed once per 1000-row map batch; rows shuffled")
    run("random", "full random",
        lambda: (_consecutive(lambda e: ps.full_random_epoch(lengths, budget=T, seed=s, epoch=e), W), {}))
    return rows


def load_set(name: str, cfg: BenchConfig) -> tuple[np.ndarray, str]:
    """Lengths (int64) and a one-line description of where they come from."""
    if name == "seedlike":
        from dflash_prep.synth.profiles import make_lengths
        return make_lengths("seedlike", cfg.n, cfg.seed).astype(np.int64), f"profiles.make_lengths('seedlike', {cfg.n}, {cfg.seed})"
    from . import corpus
    return corpus.demo_bpe_lengths(cfg.demo_n, seed=cfg.seed, work=cfg.out / "demo-bpe")


def run_set(name: str, cfg: BenchConfig) -> dict:
    from . import ours

    lengths, source = load_set(name, cfg)
    print(f"[{name}] {len(lengths):,} samples from {source}", file=sys.stderr, flush=True)
    our = ours.our_rows(lengths, cfg, measure, work=cfg.out / f"ours-{name}")
    default = next(r for r in our if r.extra.get("default"))
    hf_batch = max(1, int(round(len(lengths) / default.microbatches)))
    rows = our + peer_rows(lengths, cfg, hf_batch=hf_batch)
    return {"name": name, "source": source, "samples": int(len(lengths)),
            "real_tokens": int(lengths.sum(dtype=np.int64)), "p50": float(np.median(lengths)),
            "p99": float(np.percentile(lengths, 99)), "max": int(lengths.max()),
            "class_edges": [int(e) for e in metrics.class_edges(lengths)], "rows": [asdict(r) for r in rows]}


def _fmt(x, nd=3):
    return "—" if x is None else f"{x:.{nd}f}"


def table(result: dict) -> str:
    """Markdown table of one length set."""
    head = ("| strategy | code | efficiency | fill | micro-batches | over T | repeat-pair e0→e1 | step mix | "
            "rank imb. | setup s | epoch s |\n|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in result["rows"]:
        code = "ours" if r["family"] == "ours" else ("real package" if r["impl"].startswith("package") else r["impl"].split(" (")[0])
        lines.append(f"| {r['name']} | {code} | {_fmt(r['efficiency'], 4)} | {_fmt(r['fill'], 4)} | {r['microbatches']:,} | "
                     f"{100 * r['over_budget']:.1f}% | {r['repeat_pair']:.4f} | {r['step_mix']:.3f} | "
                     f"{r['rank_imbalance']:.3f} | {r['setup_s']:.2f} | {r['epoch_s']:.2f} |")
    return "\n".join(lines)


_SHORT = (("dflash-prep padded ", ""), ("dflash-prep varlen, first-fit 4 open bins", "varlen"),
          ("Lhotse DynamicBucketing, ", "Lhotse "), (" (estimate_duration_buckets)", ""),
          ("HF LengthGroupedSampler", "HF"), (" (sorted-static)", ""), (" packing (static)", ""),
          ("cost budget ", "cost "), (", no window", ""))


def _short(name: str) -> str:
    """A plot label: the strategy name without the words every row repeats (* = our default)."""
    name = name.replace(" (default)", "*" if name.startswith("dflash-prep") else " (its default)")
    for a, b in _SHORT:
        name = name.replace(a, b)
    return name


def plot(results: list[dict], path: Path) -> None:
    """Efficiency (fill for varlen) against step mix, one panel per length set."""
    import io

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 5.5), squeeze=False)
    for ax, res in zip(axes[0], results):
        for r in res["rows"]:
            x = r["efficiency"] if r["efficiency"] is not None else r["fill"]
            color = {"ours": "tab:blue", "peer": "tab:orange", "reference": "tab:gray"}[r["family"]]
            marker = "s" if r["layout"] == "varlen" else "o"
            ax.scatter(x, r["step_mix"], c=color, marker=marker, s=60)
            ax.annotate(f"{_short(r['name'])} rp={r['repeat_pair']:.2g}", (x, r["step_mix"]), fontsize=6,
                        xytext=(4, 3), textcoords="offset points", rotation=20)
        ax.set_xlabel("padding efficiency (varlen: fill)  → better")
        ax.set_ylabel("step mix (TV from uniform length classes)  ↓ better")
        ax.set_title(f"{res['name']}: {res['samples']:,} samples, T={res.get('budget', '')}")
        ax.grid(alpha=0.3)
    fig.suptitle("blue: dflash-prep (* = default), orange: peers, gray: full random; square = varlen; "
                 "rp = repeat-pair rate")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def run(cfg: BenchConfig) -> dict:
    """Run every length set; write JSON + PNG; return the JSON body."""
    started = time.perf_counter()
    results = []
    for name in cfg.sets:
        res = run_set(name, cfg)
        res["budget"] = cfg.budget
        results.append(res)
        print(f"\n### {name} ({res['samples']:,} samples, {res['source']})\n\n{table(res)}\n", flush=True)
    body = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}",
        "command": "python -m dflash_prep.bench.peers " + " ".join(sys.argv[1:]),
        "config": {k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v)
                   for k, v in asdict(cfg).items()},
        "wall_s": time.perf_counter() - started,
        "sets": results,
    }
    atomic_write_json(cfg.out / "peers.json", body, format=BENCH_FORMAT, version=BENCH_VERSION)
    plot(results, cfg.out / "peers.png")
    print(f"wrote {cfg.out / 'peers.json'} and {cfg.out / 'peers.png'} in {body['wall_s']:.0f} s", file=sys.stderr)
    return body


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_prep.bench.peers", description=__doc__.split("\n\n")[0])
    d = BenchConfig()
    p.add_argument("--sets", default=",".join(d.sets), help="comma-separated length sets")
    p.add_argument("--n", type=int, default=d.n)
    p.add_argument("--demo-n", type=int, default=d.demo_n)
    p.add_argument("--budget", type=int, default=d.budget)
    p.add_argument("--world-size", type=int, default=d.world_size)
    p.add_argument("--model-dim", type=int, default=d.model_dim)
    p.add_argument("--k", type=int, default=d.k)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--skip", default="", help="comma-separated strategy keys to leave out (see BenchConfig.skip)")
    p.add_argument("--out", type=Path, default=d.out)
    a = p.parse_args(argv)
    try:
        cfg = BenchConfig(sets=tuple(s for s in a.sets.split(",") if s), n=a.n, demo_n=a.demo_n, budget=a.budget,
                          world_size=a.world_size, model_dim=a.model_dim, k=a.k, seed=a.seed,
                          skip=tuple(s for s in a.skip.split(",") if s), out=a.out)
        run(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
