"""The drafter step on CPU at a real target's head shape: achieved FLOP/s against a matmul of the
head's shape measured in the same run, where the time goes, and the variants that close the gap
(issue 47, item 7).

    python -m dflash_prep.bench.drafter_cpu --out DIR                  # ~15 min on 2 loaded cores
    python -m dflash_prep.bench.drafter_cpu --smoke --out DIR          # tiny shapes (tests)

One frozen, randomly initialised target in memory (:func:`bench.drafter_gpu.build_target`, a
Qwen3 model class) at SmolLM2-135M's sizes: hidden 576, 9 / 3 heads of 64, MLP 1536, vocabulary
49,152, with ``--layers`` (4) decoder layers only (the head's shape is what this measures; the
depth only scales the target forward). One micro-batch: the first seedlike samples (synthetic
prompt-then-response masks, :class:`bench.drafter_gpu.SyntheticMasks`) until ``--tokens``
(2,800) target tokens, built with the trainer's own batch code. Every variant trains a fresh
drafter (same seed) with its own AdamW through :func:`dflash_prep.train.loop.train_step` on
that same micro-batch each step; variants run round robin (one step each in turn) after
``--warmup`` untimed steps, so drifting load hits all alike (each round starts one variant
further along):

- ``dflash chunk C``: 1 draft layer, B = 8, at most ``--max-anchors`` anchors per sample, decay
  weights, CE (:func:`dflash_prep.train.chunked_ce.weighted_ce` with ``--ce-chunk C``), fp32;
  C = 2048 is the trainer's default;
- ``dflash chunk C bf16 head``: the same, the head's two matmuls in bf16
  (:func:`dflash_prep.train.chunked_ce.head_dtype`, what ``--bf16`` runs on such a CPU); only
  where torch reports native bf16 (:func:`dflash_prep.train.distributed.bf16_native`);
- ``eagle3 Vd``: one EAGLE-3 layer, ``--ttt-steps`` (2: each pass costs the same, so the ratio
  between vocabularies holds for 7) on the same documents, draft vocabulary ``Vd`` = the full
  49,152 or ``--draft-vocab`` (32,000, pack's default; the map of the data's counts).

Each round also measures the matmul rate of the head's shape in fp32 and bf16
(:func:`dflash_prep.train.matmul_peak.measure`, same process and threads). Reported per variant:
seconds per step (the median of the timed steps; wall, and this process's CPU time: steadier
when other processes share the cores) and the ratio to the default's (the median over rounds of
the same round's ratio, so a burst of load on the shared machine hits both sides), model FLOP/s (the objective's cost model, what the trainer logs), its share of
the same-dtype matmul rate, and for DFlash the head's own time (the ``weighted_ce`` call, timed
inside the step; its backward is a saved-gradient scale) and FLOP/s against the rest of the
step. The bf16 head's loss is compared with fp32's at every step (same init, same batches): the
largest relative difference is reported. Output: ``--out/drafter_cpu.{json,md}`` (format
``dflash-prep/bench-drafter-cpu`` v1).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import platform
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from dflash_prep.bench import drafter_gpu as g
from dflash_prep.errors import ConfigError

FORMAT = "dflash-prep/bench-drafter-cpu"


@dataclass(frozen=True)
class CpuBenchConfig:
    """One run; the defaults are SmolLM2-135M's head shape."""

    layers: int = 4
    hidden: int = 576
    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    intermediate: int = 1536
    vocab: int = 49152
    tokens: int = 2800
    """Target tokens of the micro-batch (whole samples, at least this many)."""
    block_size: int = 8
    max_anchors: int = 128
    chunks: tuple[int, ...] = (512, 1024, 2048, 4096)
    bf16_chunk: int = 2048
    draft_vocab: int = 32000
    ttt_steps: int = 2
    eagle3: bool = True
    """Run the two EAGLE-3 variants (``--no-eagle3``: the DFlash ones only, for more rounds)."""
    steps: int = 2
    warmup: int = 1
    seed: int = 0
    scale: int = 1
    """Divide the seedlike lengths by this (the smoke run's tiny samples)."""

    def __post_init__(self):
        if min(self.tokens, self.block_size - 1, self.max_anchors, self.steps, self.ttt_steps, self.scale,
               *self.chunks, self.bf16_chunk, self.draft_vocab) < 1 or self.warmup < 0:
            raise ConfigError("bench.drafter_cpu: sizes and steps must be >= 1 (block size >= 2), warmup >= 0")


SMOKE = dict(layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512, tokens=200,
             max_anchors=8, chunks=(64, 2048), bf16_chunk=64, draft_vocab=256, steps=1, warmup=0, scale=16)


class _HeadTimer:
    """``weighted_ce`` with its wall time added up (the DFlash objective's head + CE call)."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *a, **kw):
        t0 = time.perf_counter()
        out = self.fn(*a, **kw)
        self.seconds += time.perf_counter() - t0
        return out


def _dflash(cfg: CpuBenchConfig, hc, target, chunk: int, bf16: bool):
    from dflash_prep.train.chunked_ce import head_dtype
    from dflash_prep.train.objectives.dflash.batch import AnchorSpec, default_gamma
    from dflash_prep.train.objectives.dflash.drafter import Drafter, DrafterConfig
    from dflash_prep.train.objectives.dflash.objective import DFlashObjective

    torch.manual_seed(cfg.seed)
    B = cfg.block_size
    dcfg = DrafterConfig.from_target_config(hc, 1, B, cfg.vocab - 1, target_layer_ids=target.taps)
    tc = g.objective_config("cpu", ce_chunk=chunk)
    spec = AnchorSpec(seed=cfg.seed, max_anchors=cfg.max_anchors, policy="cap", block_size=B)
    obj = DFlashObjective(Drafter(dcfg), target, tc, anchor_spec=spec, gamma=default_gamma(B), identity={})
    name = f"dflash chunk {chunk}" + (" bf16 head" if bf16 else "")
    ctx = (lambda: head_dtype(torch.bfloat16)) if bf16 else contextlib.nullcontext
    return name, obj, tc, ctx


def _eagle3(cfg: CpuBenchConfig, hc, model, ds, draft_vocab: int):
    from dflash_prep.objectives.eagle3 import vocab_map
    from dflash_prep.train.config import build as build_config
    from dflash_prep.train.objectives.eagle3.model import Eagle3Config, Eagle3Drafter
    from dflash_prep.train.objectives.eagle3.objective import Eagle3Objective
    from dflash_prep.train.target import FrozenTarget

    L = cfg.layers
    taps = (1, L // 2 - 1, L - 4) if L >= 8 else (0, 1, L - 2)
    counts = np.bincount(ds.ids[ds.mask > 0], minlength=cfg.vocab).astype(np.int64)
    vm = vocab_map.build(counts, draft_vocab)
    torch.manual_seed(cfg.seed)
    target = FrozenTarget.from_model(model, taps, device=torch.device("cpu"))
    drafter = Eagle3Drafter(Eagle3Config.from_target_config(hc, vm.draft_vocab_size, target_layer_ids=taps))
    drafter.set_vocab_map(torch.from_numpy(vm.d2t), torch.from_numpy(vm.t2d))
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target.embed_tokens.weight.float())
        drafter.lm_head.weight.copy_(target.lm_head.weight.float()[drafter.draft_target_ids()])
    tc = build_config(objective="eagle3", device="cpu", target="(in-memory bench target)", optimizer="adamw",
                      target_layer_ids=taps)
    obj = Eagle3Objective(drafter, target, tc, steps=cfg.ttt_steps, identity={},
                          vmap={"draft_vocab_size": vm.draft_vocab_size, "map_fingerprint": "",
                                "trained_ids": vm.trained_ids})
    return f"eagle3 draft vocab {vm.draft_vocab_size}", obj, tc, contextlib.nullcontext


def _variants(cfg: CpuBenchConfig, hc, tgt, ds, bf16: bool):
    out = [_dflash(cfg, hc, tgt, c, False) for c in cfg.chunks]
    if bf16:
        out.append(_dflash(cfg, hc, tgt, cfg.bf16_chunk, True))
    for dv in dict.fromkeys((cfg.vocab, min(cfg.draft_vocab, cfg.vocab)) if cfg.eagle3 else ()):
        out.append(_eagle3(cfg, hc, tgt.model, ds, dv))
    return out


def _first_samples(cfg: CpuBenchConfig):
    """``(dataset, sample ids)``: seedlike samples in order until ``cfg.tokens`` target tokens."""
    gc = g.GpuBenchConfig(device="cpu", n=max(16, cfg.tokens // 100), scale=cfg.scale, seed=cfg.seed)
    lens, mc = g.inputs(gc)
    ds = g.SyntheticMasks(lens, mc.supervised, cfg.vocab, cfg.seed)
    k = int(np.searchsorted(np.cumsum(lens), cfg.tokens)) + 1
    if k > len(lens):
        raise ConfigError(f"bench.drafter_cpu: {int(lens.sum())} tokens drawn for --tokens {cfg.tokens}")
    return ds, np.arange(k, dtype=np.int64)


def _rates(cfg: CpuBenchConfig, dtypes, seconds: float) -> dict:
    from dflash_prep.train.matmul_peak import measure

    return {str(dt).removeprefix("torch."): measure(max(cfg.chunks), cfg.hidden, cfg.vocab, dt, seconds=seconds)
            for dt in dtypes}


def _round(runs: list[dict], d, i: int, timed: bool) -> None:
    """Step ``i`` of every variant in turn, starting one further along each round (what runs
    first pays for the memory the last one freed); the head timer is reset per step."""
    from dflash_prep.train.loop import train_step
    from dflash_prep.train.objectives.dflash import objective as dflash_objective

    k = i % len(runs)
    for r in runs[k:] + runs[:k]:
        timer = _HeadTimer(dflash_objective.weighted_ce)
        dflash_objective.weighted_ce = timer
        try:
            t0, c0 = time.perf_counter(), time.process_time()
            st = train_step(r["obj"].model, r["opt"], r["sb"], lr=1e-4, grad_clip=1.0, d=d, autocast=r["ctx"],
                            objective=r["obj"])
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        finally:
            dflash_objective.weighted_ce = timer.fn
        r["loss"].append(st["loss"])
        print(f"step {i}{'' if timed else ' (warmup)'} {r['name']}: {dt:.2f} s, loss {st['loss']:.5f}", flush=True)
        if timed:
            r["times"].append(dt)
            r["cpu"].append(cpu)
            r["head"].append(timer.seconds)
            r["flops"] = st["flops"]


def run(cfg: CpuBenchConfig) -> dict:
    """Every variant, round robin; returns the report (what ``drafter_cpu.json`` holds)."""
    from dflash_prep.train import distributed
    from dflash_prep.train.data import StepBatches
    from dflash_prep.train.objectives.dflash.drafter import build_target_layer_ids
    from dflash_prep.train.optim import build_optimizer

    dev = torch.device("cpu")
    torch.use_deterministic_algorithms(False)
    bf16 = distributed.bf16_native()
    dtypes = (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)
    ds, sids = _first_samples(cfg)
    gc = g.GpuBenchConfig(device="cpu", layers=cfg.layers, hidden=cfg.hidden, heads=cfg.heads,
                          kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, intermediate=cfg.intermediate,
                          vocab=cfg.vocab, seed=cfg.seed)
    tgt, hc = g.build_target(gc, dev, build_target_layer_ids(cfg.layers, 1))
    runs = []
    for name, obj, tc, ctx in _variants(cfg, hc, tgt, ds, bf16):
        b = obj.build(ds, SimpleNamespace(sample_ids=sids, step=0, rank=0, accum=0), 0, "varlen", False)
        runs.append({"name": name, "obj": obj, "opt": build_optimizer(obj.model, tc), "ctx": ctx,
                     "sb": StepBatches(0, 0, [b]), "times": [], "cpu": [], "head": [], "loss": [], "batch": b,
                     "chunk": tc.ce_chunk, "bf16": "bf16" in name})
    d = distributed.Dist(0, 1, 0, dev)
    rates = {k: [] for k in map(lambda t: str(t).removeprefix("torch."), dtypes)}
    for i in range(cfg.warmup + cfg.steps):
        timed = i >= cfg.warmup
        if timed:
            for k, v in _rates(cfg, dtypes, 0.5).items():
                rates[k].append(v.flops_per_s)
        _round(runs, d, i, timed)
    return _report(cfg, runs, {k: float(np.mean(v)) for k, v in rates.items()}, bf16)


def _row(cfg: CpuBenchConfig, r: dict, rates: dict, base: dict | None) -> dict:
    s = float(np.median(r["times"]))
    fps = r["flops"] / s
    rate = rates["bfloat16" if r["bf16"] else "float32"]
    out = {"variant": r["name"], "s_per_step": s, "cpu_s_per_step": float(np.median(r["cpu"])), "flops_per_s": fps, "matmul_dtype": "bf16" if r["bf16"] else "fp32",
           "matmul_flops_per_s": rate, "matmul_share": fps / rate, "model_flops": r["flops"], "losses": r["loss"]}
    b = r["batch"]
    if r["name"].startswith("dflash"):
        rows = int((b.weights > 0).sum())
        head_flops = 4.0 * rows * cfg.hidden * cfg.vocab
        hs = float(np.median(r["head"]))
        out |= {"anchors": int(b.n_anchors), "head_rows": rows, "head_s": hs, "head_flops_per_s": head_flops / hs,
                "rest_s": s - hs, "rest_flops_per_s": (r["flops"] - head_flops) / max(s - hs, 1e-9)}
    if base is not None:
        # the median over rounds of the same round's ratio: a burst of load hits both of a round
        out["speedup_vs_default"] = float(np.median(np.array(base["times"]) / np.array(r["times"])))
        out["cpu_speedup_vs_default"] = float(np.median(np.array(base["cpu"]) / np.array(r["cpu"])))
        if "head_s" in out:
            out["head_speedup_vs_default"] = float(np.median(np.array(base["head"]) / np.array(r["head"])))
        out["max_rel_loss_diff_vs_default"] = max(abs(a - c) / abs(c) for a, c in zip(r["loss"], base["loss"]))
    return out


def _report(cfg: CpuBenchConfig, runs: list[dict], rates: dict, bf16: bool) -> dict:
    default = next((r for r in runs if r["name"] == "dflash chunk 2048"), runs[0])
    e3 = [r for r in runs if r["name"].startswith("eagle3")]
    rows = [_row(cfg, r, rates, default if r["name"].startswith("dflash") else e3[0]) for r in runs]
    return {"config": asdict(cfg), "target_tokens": int(default["batch"].real_tokens), "matmul_flops_per_s": rates,
            "bf16_native": bf16, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(), "rows": rows,
            "machine": f"{platform.processor() or platform.machine()} CPU, torch {torch.__version__}",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def table(rep: dict) -> str:
    G = 1e9
    out = ["| variant | s/step | vs default | CPU s/step | vs default (CPU time) | GFLOP/s | same-run matmul GFLOP/s | "
           "share | head s (GFLOP/s), vs default | rest s (GFLOP/s) | max rel. loss diff |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rep["rows"]:
        head = f"{r['head_s']:.2f} ({r['head_flops_per_s'] / G:.1f}), {r['head_speedup_vs_default']:.2f}x" \
            if "head_s" in r else "n/a"
        rest = f"{r['rest_s']:.2f} ({r['rest_flops_per_s'] / G:.1f})" if "rest_s" in r else "n/a"
        out.append(f"| {r['variant']} | {r['s_per_step']:.2f} | {r.get('speedup_vs_default', 1.0):.2f}x | "
                   f"{r['cpu_s_per_step']:.2f} | {r.get('cpu_speedup_vs_default', 1.0):.2f}x | {r['flops_per_s'] / G:.1f} | {r['matmul_flops_per_s'] / G:.1f} ({r['matmul_dtype']}) | "
                   f"{r['matmul_share']:.2f} | {head} | {rest} | {r.get('max_rel_loss_diff_vs_default', 0.0):.1e} |")
    d = next(r for r in rep["rows"] if "head_rows" in r)
    out.append(f"\n{rep['target_tokens']} target tokens, {d['anchors']} anchors, {d['head_rows']} head rows; "
               f"vs default: step-time ratio to `dflash chunk 2048` (DFlash rows) or to EAGLE-3 with the full "
               f"vocabulary; {rep['threads']} threads, {rep['cpu_capability']}, bf16 native: {rep['bf16_native']}; "
               f"{rep['date']} on {rep['machine']}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_prep.bench.drafter_cpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for drafter_cpu.{json,md}")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: the path runs, not the speed")
    for f in ("layers", "tokens", "max_anchors", "draft_vocab", "ttt_steps", "steps", "warmup"):
        ap.add_argument(f"--{f.replace('_', '-')}", type=int, default=None)
    ap.add_argument("--no-eagle3", dest="eagle3", action="store_false", default=None,
                    help="the DFlash variants only")
    ap.add_argument("--chunks", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                    help="comma-separated --ce-chunk values (default 512,1024,2048,4096)")
    a = ap.parse_args(argv)
    cfg = CpuBenchConfig(**SMOKE) if a.smoke else CpuBenchConfig()
    cfg = replace(cfg, **{f: v for f in ("layers", "tokens", "max_anchors", "draft_vocab", "ttt_steps", "steps",
                                         "warmup", "chunks", "eagle3") if (v := getattr(a, f)) is not None})
    print(f"bench.drafter_cpu: {cfg}", flush=True)
    rep = run(cfg)
    g.write_report(a.out, "drafter_cpu", rep, table(rep), format=FORMAT)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
