"""Does batch composition change what a model learns? (issue 7, ``make bench-convergence``)

Setup, all through the library: ``synth`` writes a demo chat corpus (train) and a second
one with another seed (validation); a byte-level BPE is trained on the train corpus with
``tokenizers`` (:func:`bench.corpus.train_bpe`); ``tokenize`` builds both datasets.
Every strategy is then a plan (:class:`dflash_prep.formats.plan.Plan`) plus pack options, packed
by :func:`dflash_prep.pack.pack.pack_epochs` and trained by :func:`dflash_prep.train.loop.train` (the tiny
decoder, CPU, fp32, deterministic), with the same token budget T per micro-batch, the
same grad accumulation A (one rank), the same model seed and the same number of steps:

- ``sorted-static``: one bucket sorted whole (window >= N), so batches are fixed, and
  their order random (fairseq's ``batch_by_size``);
- ``bucketed``: K optimal buckets, each reshuffled per epoch, class-aware step schedule;
- ``windowed``: the same plus sorting windows of ``window`` samples;
- ``varlen``: concatenated sequences, first-fit into 4 open bins, class-aware schedule;
- ``random``: one bucket, no window, random order (a full random shuffle, greedy packed).

Training runs in chunks of ``eval_every`` steps (``max_steps`` raised each time; the
trainer resumes bit-exactly from its checkpoint) and the checkpoint is scored on the whole
validation set after every chunk: the per-token mean cross-entropy over assistant tokens.
The LR is constant after warmup (``min_lr_ratio = 1``), so every strategy gets the same LR
at the same step although their epochs have different lengths. Wall-clock is the sum of
the trainer's own ``step_time_s`` (data wait included, evaluation excluded).

Reported per strategy, over ``seeds`` (seed = model init and data order): validation loss
at equal steps (the last one) and at equal wall-clock (the shortest run's total time,
linear interpolation between evaluations), as mean and sample standard deviation, plus
Welch's t against ``random`` at equal steps. Output: ``WORK/convergence.json`` (format
``dflash-prep/bench-convergence`` v1), ``WORK/convergence.png`` and a markdown table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from dflash_prep.errors import ConfigError
from dflash_prep.formats.fileio import atomic_write_bytes, atomic_write_json

CONV_FORMAT = "dflash-prep/bench-convergence"
CONV_VERSION = 1
STRATEGIES = ("sorted-static", "bucketed", "windowed", "varlen", "random")


@dataclass(frozen=True)
class ConvConfig:
    """One convergence study.

    Attributes:
        work: folder for corpora, datasets, runs and the report.
        n_train: demo conversations to train on.
        n_val: held-out demo conversations (another synth seed).
        vocab: BPE vocabulary size (the model's embedding rows).
        max_len: tokenize ``--max-len`` (longer samples are truncated).
        budget: T, padded tokens per micro-batch (``n * max_len <= T``; varlen ``sum L <= T``).
        grad_accum: A micro-batches per optimizer step (one rank).
        steps: optimizer steps per run.
        eval_every: steps between validation evaluations.
        k: buckets of the bucketed strategies.
        window: sorting window of ``windowed``, in samples.
        seeds: one run per seed and strategy.
        strategies: a subset of :data:`STRATEGIES`.
        lr: peak (and constant) learning rate.
        threads: torch CPU threads. 1 by default: on a shared 2-core machine two OpenMP
            threads that wait on each other made a tiny-model step 4x slower than one.
    """

    work: Path = Path("results/convergence")
    n_train: int = 2000
    n_val: int = 24
    vocab: int = 1024
    max_len: int = 1024
    budget: int = 2048
    grad_accum: int = 2
    steps: int = 150
    eval_every: int = 25
    k: int = 6
    window: int = 32
    seeds: tuple[int, ...] = (0, 1, 2)
    strategies: tuple[str, ...] = STRATEGIES
    lr: float = 3e-3
    threads: int = 1

    def __post_init__(self):
        bad = [s for s in self.strategies if s not in STRATEGIES]
        if bad:
            raise ConfigError(f"unknown strategies {bad}; choose from {', '.join(STRATEGIES)}")
        if min(self.n_train, self.n_val, self.vocab, self.max_len, self.budget, self.grad_accum, self.steps,
               self.eval_every, self.window, len(self.seeds), self.threads) < 1 or self.k < 2:
            raise ConfigError("every size, count and step option must be at least 1 (--k at least 2)")
        if self.max_len > self.budget:
            raise ConfigError(f"--max-len {self.max_len} exceeds the budget {self.budget}: a sample would not fit")
        if self.vocab < 300:
            raise ConfigError(f"--vocab must be at least 300 (256 bytes + specials + merges), got {self.vocab}")


# ----------------------------------------------------------------------------- data
def build_data(cfg: ConvConfig) -> tuple[Path, Path]:
    """Train and validation dataset folders (cached: synth and tokenize skip what is up to date)."""
    from dflash_prep.synth.synth import SynthConfig, synth
    from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize

    from .corpus import train_bpe

    w = Path(cfg.work)
    tok_dir = w / f"bpe-{cfg.vocab}"
    for name, n, seed in (("train", cfg.n_train, 0), ("val", cfg.n_val, 1)):
        folder = w / f"corpus-{name}-{n}"
        if not (folder / "chat.jsonl").is_file():
            synth(SynthConfig(out=folder, profile="seedlike", n=n, seed=seed, overwrite=True))
    if not (tok_dir / "tokenizer.json").is_file():
        train_bpe(w / f"corpus-train-{cfg.n_train}" / "chat.jsonl", tok_dir, train_on=min(cfg.n_train, 2000),
                  vocab=cfg.vocab)
    out = []
    for name, n in (("train", cfg.n_train), ("val", cfg.n_val)):
        ds = w / f"data-{name}-{n}-v{cfg.vocab}-m{cfg.max_len}"
        tokenize(TokenizeConfig(inputs=(str(w / f"corpus-{name}-{n}" / "chat.jsonl"),), out=ds,
                                tokenizer=str(tok_dir), chat_template="chatml", max_len=cfg.max_len))
        out.append(ds)
    return out[0], out[1]


def _plan(data: Path, boundaries, *, budget: int, seed: int, window: int):
    from dflash_prep.formats import lengths as lengths_mod
    from dflash_prep.formats.plan import Budget, Plan

    src = lengths_mod.load(data)
    return Plan(data=src.describe(), boundaries=tuple(int(b) for b in boundaries),
                budget=Budget(unit="tokens", value=budget), seed=seed, window=window).with_fingerprint()


def strategy_plan(name: str, data: Path, cfg: ConvConfig, seed: int, work: Path):
    """``(plan, pack options)`` of one strategy (module docstring); bucketed plans come from
    :func:`dflash_prep.analyze.analyze.run` on the training dataset."""
    from dflash_prep.formats import lengths as lengths_mod

    from .ours import analyze_plan

    T = cfg.budget
    if name in ("bucketed", "windowed"):
        window = cfg.window if name == "windowed" else 0
        plan, _ = analyze_plan(None, work / "plan", data=data, budget=T, buckets=cfg.k, window=window, seed=seed)
        return plan, {"schedule": "class-aware", "layout": "padded"}
    if name == "sorted-static":
        n = lengths_mod.load(data).num_samples
        return _plan(data, (), budget=T, seed=seed, window=n), {"schedule": "random", "layout": "padded"}
    if name == "varlen":
        return _plan(data, (), budget=T, seed=seed, window=0), {"schedule": "class-aware", "layout": "varlen"}
    return _plan(data, (), budget=T, seed=seed, window=0), {"schedule": "random", "layout": "padded"}


# ----------------------------------------------------------------------------- evaluation
class Validator:
    """Per-token validation loss of a checkpoint over the whole validation set (varlen batches)."""

    def __init__(self, val: Path, work: Path, budget: int):
        from dflash_prep.formats import manifest as man
        from dflash_prep.formats.dataset import open_dataset
        from dflash_prep.pack.pack import pack_epochs

        self.ds = open_dataset(val)
        plan = _plan(val, (), budget=budget, seed=0, window=0)
        root = work / "val-manifests" / f"{Path(val).name}-T{budget}"
        pack_epochs(plan=plan, epochs=[0], out=root, data=val, layout="varlen", schedule="class-aware", overwrite=True)
        self.manifest = man.open(man.epoch_dir(root, 0))

    def __call__(self, ckpt_path: Path) -> float:
        import torch

        from dflash_prep.train import checkpoint as ckpt
        from dflash_prep.train.config import ModelConfig
        from dflash_prep.train.data import iter_steps
        from dflash_prep.train.objectives.lm.model import Decoder, token_loss_sum

        state = ckpt.load(ckpt_path)
        model = Decoder(ModelConfig(**state["model_config"]))
        model.load_state_dict(state["model"])
        model.eval()
        total, n = 0.0, 0
        with torch.no_grad():
            for sb in iter_steps(self.ds, self.manifest, 0):
                for b in sb.micro:
                    total += float(token_loss_sum(model(b.input_ids, **b.model_inputs()), b.labels))
                    n += b.n_targets
        return total / max(n, 1)


# ----------------------------------------------------------------------------- runs
def run_one(name: str, seed: int, data: Path, validate: Validator, cfg: ConvConfig) -> dict:
    """Train one strategy with one seed; evaluate every ``eval_every`` steps."""
    from dflash_prep.pack.pack import pack_epochs
    from dflash_prep.train.config import build as build_config
    from dflash_prep.train.loop import train

    run = Path(cfg.work) / "runs" / f"{name}-s{seed}"
    plan, opts = strategy_plan(name, data, cfg, seed, run)
    pack_epochs(plan=plan, epochs=[0, 1], out=run / "manifests", data=data, world_size=1, grad_accum=cfg.grad_accum,
                overwrite=True, **opts)
    from dflash_prep.formats import plan as plan_mod
    plan_path = plan_mod.save(plan, run / "plan.json")
    from dflash_prep.formats import manifest as man
    summ = [man.read_header(man.epoch_dir(run / "manifests", e))["summary"] for e in (0, 1)]
    evals = [{"step": 0, "val_loss": None}]
    ck = None
    for upto in range(cfg.eval_every, cfg.steps + 1, cfg.eval_every):
        tc = build_config(data=str(data), plan=str(plan_path), manifests=str(run / "manifests"), out=str(run / "out"),
                         model="tiny", epochs=1000, max_steps=upto, lr=cfg.lr, min_lr_ratio=1.0, warmup_steps=5,
                         seed=seed, device="cpu", progress=False, from_scratch=upto == cfg.eval_every)
        train(tc)
        ck = run / "out" / "checkpoint.pt"
        evals.append({"step": upto, "val_loss": validate(ck)})
    # cumulative training wall-clock at each evaluation, from the trainer's own log
    times, tokens = {}, {}
    t = tok = 0.0
    with open(run / "out" / "log.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            if "global_step" not in rec:
                continue
            t += rec["step_time_s"]
            tok += rec["real_tokens"]
            times[rec["global_step"]], tokens[rec["global_step"]] = t, tok
    for e in evals[1:]:
        e["time_s"], e["real_tokens"] = times[e["step"]], tokens[e["step"]]
    evals[0].update(time_s=0.0, real_tokens=0)
    return {"strategy": name, "seed": seed, "evals": evals,
            "pack": {k: summ[0][k] for k in ("efficiency", "fill", "microbatches", "steps", "step_mix")}
            | {"repeat_pair_rate": summ[1]["repeat_pair_rate"]}}


def _at_time(evals: list[dict], t: float) -> float:
    xs = [e["time_s"] for e in evals[1:]]
    ys = [e["val_loss"] for e in evals[1:]]
    return float(np.interp(t, xs, ys))


def summarize(runs: list[dict], cfg: ConvConfig) -> dict:
    """Mean and spread per strategy at equal steps and at equal wall-clock; Welch t vs random."""
    t_common = min(r["evals"][-1]["time_s"] for r in runs)
    out = {"t_common_s": t_common, "strategies": {}}
    for s in cfg.strategies:
        rs = [r for r in runs if r["strategy"] == s]
        at_step = np.array([r["evals"][-1]["val_loss"] for r in rs])
        at_time = np.array([_at_time(r["evals"], t_common) for r in rs])
        out["strategies"][s] = {
            "val_loss_at_steps": {"mean": float(at_step.mean()), "std": float(at_step.std(ddof=1)) if len(rs) > 1 else 0.0},
            "val_loss_at_time": {"mean": float(at_time.mean()), "std": float(at_time.std(ddof=1)) if len(rs) > 1 else 0.0},
            "time_s": float(np.mean([r["evals"][-1]["time_s"] for r in rs])),
            "real_tokens": float(np.mean([r["evals"][-1]["real_tokens"] for r in rs])),
            "pack": {k: float(np.mean([r["pack"][k] for r in rs if r["pack"][k] is not None] or [np.nan]))
                     for k in rs[0]["pack"]},
            "_at_step": at_step.tolist(), "_at_time": at_time.tolist()}
    ref = out["strategies"].get("random")
    for s, v in out["strategies"].items():
        v["welch_t_vs_random"] = _welch(v["_at_step"], ref["_at_step"]) if ref and s != "random" else None
    return out


def _welch(a, b) -> float | None:
    a, b = np.asarray(a), np.asarray(b)
    if len(a) < 2 or len(b) < 2:
        return None
    se = np.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))
    return float((a.mean() - b.mean()) / se) if se > 0 else None


def table(summary: dict, cfg: ConvConfig) -> str:
    lines = [f"| strategy | val loss @ {cfg.steps} steps | val loss @ {summary['t_common_s']:.0f} s | train s | "
             "real tokens | efficiency | step mix | repeat-pair | Welch t vs random |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s, v in summary["strategies"].items():
        a, b, p = v["val_loss_at_steps"], v["val_loss_at_time"], v["pack"]
        t = "—" if v["welch_t_vs_random"] is None else f"{v['welch_t_vs_random']:+.1f}"
        eff = p["fill"] if s == "varlen" else p["efficiency"]
        lines.append(f"| {s} | {a['mean']:.4f} ± {a['std']:.4f} | {b['mean']:.4f} ± {b['std']:.4f} | {v['time_s']:.1f} | "
                     f"{v['real_tokens']:,.0f} | {eff:.3f}{' (fill)' if s == 'varlen' else ''} | {p['step_mix']:.3f} | "
                     f"{p['repeat_pair_rate']:.3f} | {t} |")
    return "\n".join(lines)


def plot(runs: list[dict], cfg: ConvConfig, path: Path) -> None:
    import io

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    colors = dict(zip(STRATEGIES, ("tab:red", "tab:blue", "tab:green", "tab:purple", "tab:gray")))
    for r in runs:
        ev = r["evals"][1:]
        lab = r["strategy"] if r["seed"] == cfg.seeds[0] else None
        axes[0].plot([e["step"] for e in ev], [e["val_loss"] for e in ev], color=colors[r["strategy"]], alpha=0.7, label=lab)
        axes[1].plot([e["time_s"] for e in ev], [e["val_loss"] for e in ev], color=colors[r["strategy"]], alpha=0.7, label=lab)
    axes[0].set_xlabel("optimizer step")
    axes[1].set_xlabel("training wall-clock, s (2 CPU cores)")
    for ax in axes:
        ax.set_ylabel("validation loss (per token)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"tiny decoder, demo corpus + BPE {cfg.vocab}, T={cfg.budget}, A={cfg.grad_accum}, "
                 f"{len(cfg.seeds)} seeds per strategy")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def run(cfg: ConvConfig) -> dict:
    import torch

    torch.set_num_threads(cfg.threads)
    started = time.perf_counter()
    data, val = build_data(cfg)
    validate = Validator(val, Path(cfg.work), cfg.budget)
    runs = []
    for seed in cfg.seeds:
        for name in cfg.strategies:
            t0 = time.perf_counter()
            runs.append(run_one(name, seed, data, validate, cfg))
            print(f"  {name} seed {seed}: val loss {runs[-1]['evals'][-1]['val_loss']:.4f} "
                  f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    summary = summarize(runs, cfg)
    body = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}",
            "command": "python -m dflash_prep.bench.convergence " + " ".join(sys.argv[1:]),
            "config": {k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v)
                       for k, v in asdict(cfg).items()},
            "wall_s": time.perf_counter() - started, "summary": summary, "runs": runs}
    atomic_write_json(Path(cfg.work) / "convergence.json", body, format=CONV_FORMAT, version=CONV_VERSION)
    plot(runs, cfg, Path(cfg.work) / "convergence.png")
    print(table(summary, cfg), flush=True)
    print(f"wrote {cfg.work}/convergence.json and convergence.png in {body['wall_s']:.0f} s", file=sys.stderr)
    return body


def main(argv: list[str] | None = None) -> int:
    d = ConvConfig()
    p = argparse.ArgumentParser(prog="python -m dflash_prep.bench.convergence", description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=d.work)
    for f in ("n_train", "n_val", "vocab", "max_len", "budget", "grad_accum", "steps", "eval_every", "k", "window",
              "threads"):
        p.add_argument("--" + f.replace("_", "-"), type=int, default=getattr(d, f))
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seeds", default=",".join(map(str, d.seeds)))
    p.add_argument("--strategies", default=",".join(d.strategies))
    a = p.parse_args(argv)
    try:
        cfg = ConvConfig(work=a.work, n_train=a.n_train, n_val=a.n_val, vocab=a.vocab, max_len=a.max_len,
                         budget=a.budget, grad_accum=a.grad_accum, steps=a.steps, eval_every=a.eval_every, k=a.k,
                         window=a.window, lr=a.lr, threads=a.threads, seeds=tuple(int(s) for s in a.seeds.split(",") if s),
                         strategies=tuple(s for s in a.strategies.split(",") if s))
        run(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
