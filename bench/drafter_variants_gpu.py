"""DFlash, DFlash2 and EAGLE-3 drafter training on the same micro-batches, side by side on one GPU.

    PYTHONPATH=. python3 -m dflash_prep.bench.drafter_variants_gpu --out DIR       # part of make bench-gpu
    PYTHONPATH=. python3 -m dflash_prep.bench.drafter_variants_gpu --smoke --out DIR   # CPU, tiny shapes (tests)

One frozen, randomly initialised Qwen3-0.6B-shaped target in memory (:func:`bench.drafter_gpu.build_target`:
28 layers, hidden 1024, vocab 151936, bf16), one set of ``pack --objective dflash`` micro-batches
(:func:`bench.drafter_gpu.ours_microbatches`: seedlike lengths, token budget ``T``), and three
drafters trained on them with the trainer's own code (:func:`dflash_prep.train.loop.train_step`,
bf16 autocast, the Triton kernels on CUDA), each with a fresh init (same seed) and its own AdamW:

- ``dflash``: one draft layer, B = 16, at most 512 anchors per sample, decay weights, CE;
- ``dflash2``: the same drafter and blocks plus the convolutions and the candidate selector at
  the released checkpoint's sizes (2 taps, groups of 16, rank 256, top 16), selector loss on;
- ``eagle3``: one EAGLE-3 layer over three taps, 7 TTT passes, a 32,000-id draft vocabulary
  (the map of the synthetic data's counts), on the same documents.

The three run round robin, one step each in turn, after ``--warmup`` untimed steps each (drifting
load hits all alike); a timed step is ``train_step`` up to a CUDA sync. Reported per drafter:
seconds per step, target tokens per second and peak memory; and the ratios DFlash2 / DFlash and
EAGLE-3 / DFlash of the step time (the cost of the variant on the same batch). Output:
``--out/drafter_variants_gpu.json`` (format ``dflash-prep/bench-drafter-variants`` v1) and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from dflash_prep.bench import drafter_gpu as g
from dflash_prep.errors import ConfigError

FORMAT = "dflash-prep/bench-drafter-variants"
DRAFT_VOCAB = 32000
TTT_STEPS = 7


def _variants(cfg, hc, model, dev, ds):
    """``[(name, objective, trainer config)]``: the three drafters on the shared target."""
    from dflash_prep.objectives.eagle3 import vocab_map
    from dflash_prep.train.config import build as build_config
    from dflash_prep.train.objectives.dflash.batch import AnchorSpec, default_gamma
    from dflash_prep.train.objectives.dflash.drafter import Drafter, DrafterConfig, build_target_layer_ids
    from dflash_prep.train.objectives.dflash.objective import DFlashObjective
    from dflash_prep.train.objectives.dflash2.drafter import DFlash2Config, DFlash2Drafter
    from dflash_prep.train.objectives.dflash2.objective import DFlash2Objective
    from dflash_prep.train.objectives.eagle3.model import Eagle3Config, Eagle3Drafter
    from dflash_prep.train.objectives.eagle3.objective import Eagle3Objective
    from dflash_prep.train.target import FrozenTarget

    L = cfg.layers
    taps = build_target_layer_ids(L, 1)
    spec = AnchorSpec(seed=cfg.seed, max_anchors=g.MAX_ANCHORS, policy="cap", block_size=g.B)
    dflash_target = FrozenTarget.from_model(model, taps, device=dev)
    common = dict(device=cfg.device, target="(in-memory bench target)", slot_weights="decay", optimizer="adamw")
    out = []
    torch.manual_seed(cfg.seed)
    dcfg = DrafterConfig.from_target_config(hc, 1, g.B, cfg.vocab - 1, target_layer_ids=taps)
    tc = build_config(objective="dflash", **common)
    out.append(("dflash", DFlashObjective(Drafter(dcfg).to(dev), dflash_target, tc, anchor_spec=spec,
                                          gamma=default_gamma(g.B), identity={}), tc))
    torch.manual_seed(cfg.seed)
    sizes = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16)
    tc2 = build_config(objective="dflash2", **common, **sizes)
    d2 = DFlash2Drafter(DFlash2Config(**dcfg.to_dict(), **sizes)).to(dev)
    out.append(("dflash2", DFlash2Objective(d2, dflash_target, tc2, anchor_spec=spec, gamma=default_gamma(g.B),
                                            identity={}), tc2))
    torch.manual_seed(cfg.seed)
    e_taps = (1, L // 2 - 1, L - 4) if L >= 8 else (0, 1, L - 2)
    counts = np.bincount(ds.ids[ds.mask > 0], minlength=cfg.vocab).astype(np.int64)
    vm = vocab_map.build(counts, min(DRAFT_VOCAB, cfg.vocab // 2))
    ecfg = Eagle3Config.from_target_config(hc, vm.draft_vocab_size, target_layer_ids=e_taps)
    e_target = FrozenTarget.from_model(model, e_taps, device=dev)
    drafter = Eagle3Drafter(ecfg)
    drafter.set_vocab_map(torch.from_numpy(vm.d2t), torch.from_numpy(vm.t2d))
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(e_target.embed_tokens.weight.float().cpu())
        drafter.lm_head.weight.copy_(e_target.lm_head.weight.float().cpu()[drafter.draft_target_ids()])
    tc3 = build_config(objective="eagle3", device=cfg.device, target="(in-memory bench target)", optimizer="adamw",
                       target_layer_ids=e_taps)
    out.append(("eagle3", Eagle3Objective(drafter.to(dev), e_target, tc3, steps=TTT_STEPS, identity={},
                                          vmap={"draft_vocab_size": vm.draft_vocab_size, "map_fingerprint": "",
                                                "trained_ids": vm.trained_ids}), tc3))
    return out


def run(cfg: g.GpuBenchConfig) -> dict:
    from dflash_prep.objectives.drafter_cost import DrafterCostModel
    from dflash_prep.train import distributed
    from dflash_prep.train.data import StepBatches
    from dflash_prep.train.loop import train_step
    from dflash_prep.train.optim import build_optimizer

    dev = torch.device(cfg.device)
    torch.use_deterministic_algorithms(False)
    lens, mc = g.inputs(cfg)
    cost = DrafterCostModel(hidden=cfg.hidden, layers=cfg.layers, intermediate=cfg.intermediate, heads=cfg.heads,
                            kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, vocab=cfg.vocab, draft_layers=1)
    need = cfg.warmup + cfg.steps
    mbs = g.ours_microbatches(cfg, lens, mc, cost)
    if len(mbs) < need:
        raise ConfigError(f"bench.drafter_variants_gpu: {len(mbs)} steps for {need} (warmup + steps); raise --n")
    ds = g.SyntheticMasks(lens, mc.supervised, cfg.vocab, cfg.seed)
    target, hc = g.build_target(cfg, dev, [0])
    d = distributed.Dist(0, 1, 0, dev)
    autocast = distributed.autocast_for(dev, True)
    runs = []
    for name, obj, tc in _variants(cfg, hc, target.model, dev, ds):
        steps = []
        for s in range(need):
            b = obj.build(ds, SimpleNamespace(sample_ids=mbs[s], step=s, rank=0, accum=0), 0, "varlen",
                          dev.type == "cuda")
            steps.append(StepBatches(0, s, [b]))
        runs.append({"name": name, "obj": obj, "opt": build_optimizer(obj.model, tc), "steps": steps, "times": [],
                     "tokens": 0, "peak": 0})
    for i in range(need):                       # round robin
        for r in runs:
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            t0 = time.perf_counter()
            train_step(r["obj"].model, r["opt"], r["steps"][i], lr=1e-4, grad_clip=1.0, d=d, autocast=autocast,
                       objective=r["obj"])
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                r["peak"] = max(r["peak"], torch.cuda.max_memory_allocated(dev))
            if i >= cfg.warmup:
                r["times"].append(time.perf_counter() - t0)
                r["tokens"] += r["steps"][i].micro[0].real_tokens
    rows = []
    for r in runs:
        t = float(np.sum(r["times"]))
        rows.append({"drafter": r["name"], "timed_steps": len(r["times"]), "s_per_step": t / len(r["times"]),
                     "tokens_per_s": r["tokens"] / t, "peak_gib": r["peak"] / 2**30 if r["peak"] else None,
                     "parameters": int(sum(p.numel() for p in r["obj"].model.parameters() if p.requires_grad))})
    base = rows[0]["s_per_step"]
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"{platform.processor() or platform.machine()} CPU"
    return {"config": asdict(cfg), "block_size": g.B, "max_anchors": g.MAX_ANCHORS, "ttt_steps": TTT_STEPS,
            "rows": rows, "step_time_ratio": {r["drafter"]: r["s_per_step"] / base for r in rows[1:]},
            "smoke": dev.type != "cuda", "machine": f"{name}, torch {torch.__version__}",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def table(rep: dict) -> str:
    out = ["| drafter | s/step | target tokens/s | peak GiB | trainable parameters |", "|---|---|---|---|---|"]
    for r in rep["rows"]:
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "n/a"
        out.append(f"| {r['drafter']} | {r['s_per_step']:.3f} | {r['tokens_per_s']:,.0f} | {peak} | "
                   f"{r['parameters']:,} |")
    ratios = ", ".join(f"{k} / dflash {v:.2f}x" for k, v in rep["step_time_ratio"].items())
    note = " (smoke: CPU figures)" if rep["smoke"] else ""
    out.append(f"\nstep time on the same micro-batches: {ratios}{note}; {rep['date']} on {rep['machine']}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_prep.bench.drafter_variants_gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for drafter_variants_gpu.{json,md}")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: the path runs, not the speed")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--n", type=int, default=1500)
    a = ap.parse_args(argv)
    cfg = g.GpuBenchConfig(**g.SMOKE) if a.smoke else g.GpuBenchConfig(steps=a.steps, warmup=a.warmup, n=a.n)
    if a.smoke:
        cfg = replace(cfg, layers=4, steps=1, warmup=0)
    rep = run(cfg)
    g.write_report(a.out, "drafter_variants_gpu", rep, table(rep), format=FORMAT)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
