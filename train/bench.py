"""Trainer throughput per batching strategy: real tokens/s and data-wait share.

``python -m dflash_prep.train.bench`` (CPU, tiny model) and ``python -m dflash_prep.train.bench --gpu`` (CUDA,
``100m`` model, bf16, Triton attention; part of ``make bench-gpu``). For each strategy it
packs one epoch with the real ``pack`` code into a temp manifest root, then trains a fresh
model (same seed) for ``warmup + steps`` optimizer steps through the real loader (FIFO
prefetch, label shift) and :func:`dflash_prep.train.loop.train_step`, timing only the last ``steps``:

- ``sorted-static``: one bucket sorted whole (window = N), fixed batches, order shuffled;
- ``bucketed-k6``: K = 6 optimal boundaries (``dflash_prep.analyze.optimize``), batch order random;
- ``bucketed-k6-window``: the same + sort inside shuffled windows of 1024, class-aware steps;
- ``varlen``: random order, first-fit into 4 open bins, concatenated with ``cu_seqlens``;
- ``full-random``: one bucket, random order, greedy.

Lengths: the ``seedlike`` profile divided by ``--scale`` (16 on CPU: 4..511 tokens, so a
tiny model trains on 2 cores), budget ``T = --budget`` (4096 on CPU = 8x the longest
sample, as definitions.md's 65536 is for 8191). Token ids are random; only shapes matter for speed.
``--data DIR`` uses a tokenized dataset's own lengths and samples instead.

Strategies run round robin (one step of each in turn) so that drifting background load
on a shared machine hits all of them alike. Real tokens/s = real (unpadded) tokens of the
timed steps / their wall time, data wait included; the CPU-time variant divides by process
CPU time instead (steadier under contention). Data-wait share = time the loop blocked on the
prefetch queue / wall time.
Tokens/s should rank as efficiency does: the padding is compute thrown away.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import platform
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from dflash_prep.analyze import optimize
from dflash_prep.errors import ConfigError
from dflash_prep.formats import lengths as lengths_mod
from dflash_prep.formats import manifest
from dflash_prep.formats import plan as plan_mod
from dflash_prep.formats.dataset import open_dataset
from dflash_prep.formats.fileio import atomic_save_npy, atomic_write_json
from dflash_prep.pack.pack import pack_epochs
from dflash_prep.synth import profiles

from dflash_prep.train import distributed
from dflash_prep.train.config import preset, build as build_config
from dflash_prep.train.data import Prefetcher, iter_steps
from dflash_prep.train.loop import _autocast_for, train_step
from dflash_prep.train.optim import build_optimizer
from dflash_prep.train.objectives.lm.model import Decoder

BENCH_FORMAT = "dflash-prep/bench-train"
STRATEGIES = ("sorted-static", "bucketed-k6", "bucketed-k6-window", "varlen", "full-random")


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run."""

    n: int = 3000
    """Samples drawn from the seedlike profile (the epoch that is packed)."""
    scale: int = 16
    """Divide seedlike lengths by this (1 on GPU: 65..8191 tokens)."""
    budget: int = 4096
    """Token budget T per micro-batch."""
    steps: int = 0
    """Timed optimizer steps per strategy; 0 = the whole epoch, so every strategy trains on
    exactly the same samples and only the batching differs."""
    warmup: int = 2
    """Untimed steps first (allocator, autotuning), then the timed pass starts at step 0."""
    window: int = 1024
    """Sort window of bucketed-k6-window."""
    model: str = "tiny"
    """Model preset."""
    vocab: int = 259
    """Vocabulary of the synthetic samples (the byte tokenizer's)."""
    device: str = "cpu"
    """cpu or cuda."""
    prefetch: int = 4
    """Prefetch depth in steps."""
    seed: int = 0
    """Lengths, tokens and model init."""
    data: str = ""
    """Tokenized dataset folder to use instead of synthetic samples (lengths not scaled)."""

    def __post_init__(self):
        if min(self.n, self.scale, self.budget, self.vocab, self.prefetch) < 1 or min(self.warmup, self.steps) < 0:
            raise ConfigError("bench: n, scale, budget, vocab and prefetch must be >= 1, warmup and steps >= 0")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"bench: --device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("bench: --gpu needs a CUDA GPU; run without --gpu for the CPU benchmark")


class SyntheticDataset:
    """Samples as views of one flat int32 array (like the mmap'd shards); mask 0 on the first quarter."""

    def __init__(self, lengths: np.ndarray, vocab: int, seed: int):
        self.lengths = np.asarray(lengths, np.int32)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)])
        rng = np.random.default_rng([seed, 7])
        self.ids = rng.integers(3, vocab, int(self.offsets[-1])).astype(np.int32)
        self.mask = np.ones(int(self.offsets[-1]), np.uint8)
        for i in range(len(self.lengths)):
            s = int(self.offsets[i])
            self.mask[s:s + max(1, int(self.lengths[i]) // 4)] = 0
        self.tokenizer_info = {"vocab_size": vocab, "pad_id": 0}

    def __len__(self):
        return len(self.lengths)

    def sample(self, i: int):
        s, e = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.ids[s:e], self.mask[s:e]


def strategy_options(name: str, n: int, k6: tuple[int, ...], window: int) -> dict:
    """Plan fields and pack options of each strategy."""
    table = {
        "sorted-static": dict(boundaries=(), window=n, layout="padded", schedule="random"),
        "bucketed-k6": dict(boundaries=k6, window=0, layout="padded", schedule="random"),
        "bucketed-k6-window": dict(boundaries=k6, window=window, layout="padded", schedule="class-aware"),
        "varlen": dict(boundaries=(), window=0, layout="varlen", schedule="random"),
        "full-random": dict(boundaries=(), window=0, layout="padded", schedule="random"),
    }
    return table[name]


def pack_strategy(name: str, src: lengths_mod.LengthSource, root: Path, cfg: BenchConfig, k6, *, data=None,
                  lengths_file=None):
    """Pack epoch 0 of ``name`` with the real pack code; return the opened manifest."""
    o = strategy_options(name, src.num_samples, k6, cfg.window)
    p = plan_mod.Plan(data=src.describe(), boundaries=tuple(o["boundaries"]), budget=plan_mod.Budget(value=cfg.budget),
                      seed=cfg.seed, window=o["window"]).with_fingerprint()
    [folder] = pack_epochs(plan=p, epochs=[0], out=root / name, layout=o["layout"], schedule=o["schedule"],
                           data=data, lengths=lengths_file)
    return manifest.open(folder)


class _Runner:
    """One strategy's model, optimizer and prefetched manifest, stepped from outside."""

    def __init__(self, name: str, ds, m, cfg: BenchConfig):
        dev = torch.device(cfg.device)
        self.name, self.m, self.dev = name, m, dev
        self.d = distributed.Dist(0, 1, 0, dev)
        torch.manual_seed(cfg.seed)
        self.model = Decoder(preset(cfg.model, vocab_size=int(ds.tokenizer_info["vocab_size"]))).to(dev)
        self.opt = build_optimizer(self.model, build_config(device=cfg.device))
        self.autocast = _autocast_for(dev, True)
        self.todo = cfg.steps or m.num_steps
        if m.num_steps < max(cfg.warmup, self.todo):
            raise ConfigError(f"bench: {name} packs only {m.num_steps} steps, fewer than --warmup/--steps; "
                              "raise --n or lower them")
        pin = dev.type == "cuda"
        warm = iter_steps(ds, m, 0, pin=pin)
        for _ in range(cfg.warmup):
            self._run(next(warm))
        self.pf = Prefetcher(iter_steps(ds, m, 0, pin=pin), cfg.prefetch)
        self.real = self.padded = self.steps = 0
        self.wall = self.cpu = self.wait = 0.0

    def _run(self, sb) -> dict:
        st = train_step(self.model, self.opt, sb, lr=1e-3, grad_clip=1.0, d=self.d, autocast=self.autocast)
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
        return st

    def step(self) -> bool:
        """One timed step; False once this strategy's timed steps are done."""
        if self.steps >= self.todo:
            return False
        t0, c0, w0 = time.perf_counter(), time.process_time(), self.pf.wait_s
        st = self._run(next(self.pf))
        self.wall += time.perf_counter() - t0
        self.cpu += time.process_time() - c0
        self.wait += self.pf.wait_s - w0
        self.real += st["real_tokens"]
        self.padded += st["padded_tokens"]
        self.steps += 1
        return True

    def result(self) -> dict:
        self.pf.close()
        s = self.m.summary
        return {"strategy": self.name, "layout": self.m.layout, "epoch_efficiency": float(s.get("efficiency", 0.0)),
                "epoch_fill": float(s.get("fill", 0.0)), "step_mix": s.get("step_mix"),
                "microbatches": self.m.num_microbatches, "timed_steps": self.steps, "timed_efficiency": self.real / max(1, self.padded),
                "real_tokens": self.real, "padded_tokens": self.padded, "time_s": self.wall,
                "tokens_per_s": self.real / self.wall, "cpu_tokens_per_s": self.real / max(self.cpu, 1e-9),
                "data_wait_share": self.wait / self.wall}


def run(cfg: BenchConfig, strategies=STRATEGIES) -> dict:
    """Pack every strategy, then time them round robin; returns the report (what ``--out`` holds)."""
    torch.use_deterministic_algorithms(False)
    if cfg.device == "cpu":
        torch.set_num_threads(1)  # one core each: stable on a shared machine, no oversubscription
    with tempfile.TemporaryDirectory(prefix="dflash-bench-train-") as tmp:
        root = Path(tmp)
        if cfg.data:
            ds = open_dataset(cfg.data)
            src = lengths_mod.read_dataset_lengths(cfg.data)
            kw = dict(data=cfg.data)
        else:
            lens = np.maximum(profiles.make_lengths("seedlike", cfg.n, cfg.seed) // cfg.scale, 4).astype(np.int32)
            atomic_save_npy(root / "lengths.npy", lens)
            src = lengths_mod.read_lengths_file(root / "lengths.npy")
            ds = SyntheticDataset(lens, cfg.vocab, cfg.seed)
            kw = dict(lengths_file=root / "lengths.npy")
        hist = optimize.histogram(np.asarray(src.lengths))
        k6 = optimize.Model(hist, optimize.PackModel(budget=float(cfg.budget))).search(6).boundaries[5]
        runners = [_Runner(name, ds, pack_strategy(name, src, root, cfg, k6, **kw), cfg) for name in strategies]
        # round robin, one step of each strategy in turn: background load drifts over time
        # (shared machines) and would otherwise favour whichever strategy ran in a quiet spell
        busy = list(runners)
        while busy:
            busy = [r for r in busy if r.step()]
        rows = [r.result() for r in runners]
    dev = torch.cuda.get_device_name(0) if cfg.device == "cuda" else f"{platform.processor() or platform.machine()} CPU"
    return {"config": asdict(cfg), "k6_boundaries": list(k6), "rows": rows,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{dev}, torch {torch.__version__}, {torch.get_num_threads()} threads",
            "orders": orders(rows)}


def _measure(r: dict) -> float:
    """definitions.md's efficiency measure: padding efficiency, or fill in the varlen layout."""
    return r["epoch_fill"] if r["layout"] == "varlen" else r["epoch_efficiency"]


def orders(rows: list[dict]) -> dict:
    """Strategies ranked by the efficiency measure, by wall tokens/s and by CPU-time tokens/s."""
    def rank(key):
        return [r["strategy"] for r in sorted(rows, key=lambda r: -key(r))]
    return {"by_efficiency": rank(_measure), "by_tokens_per_s": rank(lambda r: r["tokens_per_s"]),
            "by_cpu_tokens_per_s": rank(lambda r: r["cpu_tokens_per_s"])}


def _row(r: dict) -> str:
    return (f"| {r['strategy']} | {r['layout']} | {_measure(r):.3f} | {r['timed_efficiency']:.3f} | "
            f"{r['tokens_per_s']:,.0f} | {r['cpu_tokens_per_s']:,.0f} | {100 * r['data_wait_share']:.1f}% |")


def table(report: dict) -> str:
    head = ("| strategy | layout | efficiency (fill for varlen) | timed efficiency | real tokens/s (wall) | "
            "real tokens/s (CPU time) | data wait |\n|---|---|---|---|---|---|---|")
    return "\n".join([head, *(_row(r) for r in report["rows"])])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_prep.train.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", action="store_true", help="CUDA, 100m model, seedlike lengths unscaled, T=65536")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run of the same code path (tests use it)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset")
    helps = {"n": "samples in the packed epoch", "scale": "divide seedlike lengths by this",
             "budget": "token budget T", "steps": "timed steps per strategy (0 = the whole epoch)",
             "warmup": "untimed steps first", "window": "sort window of bucketed-k6-window",
             "vocab": "synthetic vocabulary", "prefetch": "prefetch depth in steps", "seed": "lengths, tokens, init"}
    for f, h in helps.items():
        ap.add_argument(f"--{f}", type=int, default=None, help=h)
    ap.add_argument("--model", default=None, help="model preset (tiny, 100m)")
    ap.add_argument("--data", default=None, help="tokenized dataset folder instead of synthetic samples")
    ap.add_argument("--out", default=None, help="write the report JSON here")
    a = ap.parse_args(argv)
    base = {}
    if a.gpu:
        base = dict(device="cuda", model="100m", scale=1, budget=65536, vocab=32000, n=4000, steps=0, warmup=3)
    if a.smoke:  # the same path, sized for a test: CPU, tiny model, a handful of steps
        base.update(device="cpu", model="tiny", scale=16, budget=1024, vocab=259, n=300, steps=2, warmup=1)
    base.update({k: v for k, v in vars(a).items() if k in BenchConfig.__dataclass_fields__ and v is not None})
    cfg = BenchConfig(**base)
    names = [s for s in a.strategies.split(",") if s]
    bad = [s for s in names if s not in STRATEGIES]
    if bad:
        raise SystemExit(f"unknown strategies {bad}; choose from {', '.join(STRATEGIES)}")
    print(f"train.bench: {cfg}", flush=True)
    report = run(cfg, names)
    print(table(report))
    print(f"\n{report['date']} on {report['machine']}; K=6 boundaries {report['k6_boundaries']}")
    for k, v in report["orders"].items():
        print(f"{k:>20}: {' > '.join(v)}")
    if a.out:
        atomic_write_json(a.out, report, format=BENCH_FORMAT, version=1)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        raise SystemExit(main())
