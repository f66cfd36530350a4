"""One target rank + one drafter rank sharing one GPU vs the colocated drafter, DFlash steps.

    PYTHONPATH=. python3 -m dflash_prep.bench.target_workers_gpu --out DIR          # the GPU (a bench.gpu_all step)
    PYTHONPATH=. python3 -m dflash_prep.bench.target_workers_gpu --smoke --out DIR  # CPU, tiny shapes: the path runs

The same drafter training steps (:func:`dflash_prep.train.loop.train_step` of the DFlash
objective, ``pack --objective dflash`` micro-batches of :mod:`bench.drafter_gpu`'s seedlike
data, its random Qwen3 target) run two ways:

- ``colocated``: one process, the frozen target beside the drafter (what ``--target-ranks 0`` runs);
- ``split``: two processes on the same device: a target rank (:class:`~dflash_prep.train.split.worker.TargetWorker`,
  ``--target-prefetch`` 2) feeding a drafter rank (:class:`~dflash_prep.train.split.taps.RemoteTaps`), what
  ``--target-ranks 1`` runs. NCCL refuses two ranks on one GPU, so the link is gloo and every
  taps tensor is staged through host memory (device -> host on the target rank, host -> device
  on the drafter rank): the figure is a lower bound of a split on two GPUs over NCCL.

Per way: the median step time after ``--warmup`` steps; for the split, the drafter's wait for
taps and the target rank's busy fraction. Writes ``target_workers_gpu.json`` under ``--out``.
Uses only torch, transformers, numpy (the GPU machine's preinstalled python3).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

FORMAT = "dflash-prep/bench-target-workers-gpu"
GPU = dict(layers=16, hidden=1024, heads=16, kv_heads=8, head_dim=64, intermediate=3072, vocab=32000, n=1500,
           scale=2, budget=16384, steps=8, warmup=2)
SMOKE = dict(device="cpu", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512,
             n=300, scale=32, budget=1024, steps=2, warmup=1)


class _Manifest:
    """The bench's epoch 0 for one rank, as :func:`~dflash_prep.train.data.iter_steps` reads a manifest."""

    epoch, world_size, layout = 0, 1, "varlen"

    def __init__(self, mbs):
        self.mbs, self.num_steps = mbs, len(mbs)

    def microbatches(self, rank: int, start_step: int = 0):
        for s in range(int(start_step), self.num_steps):
            yield SimpleNamespace(sample_ids=self.mbs[s], step=s, rank=0, accum=0)


def _setup(cfg):
    """``(device, target, hc, objective builder, micro-batch ids, dataset)`` of ``cfg`` (same in every process)."""
    import torch

    from dflash_prep.bench import drafter_gpu as g
    from dflash_prep.objectives.drafter_cost import DrafterCostModel
    from dflash_prep.train.objectives.dflash.drafter import build_target_layer_ids

    dev = torch.device("cuda", 0) if cfg.device == "cuda" else torch.device("cpu")
    torch.use_deterministic_algorithms(False)
    lens, mc = g.inputs(cfg)
    cost = DrafterCostModel(hidden=cfg.hidden, layers=cfg.layers, intermediate=cfg.intermediate, heads=cfg.heads,
                            kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, vocab=cfg.vocab)
    mbs = g.ours_microbatches(cfg, lens, mc, cost)[:cfg.warmup + cfg.steps]
    ds = g.SyntheticMasks(lens, mc.supervised, cfg.vocab, cfg.seed)
    taps = build_target_layer_ids(cfg.layers, 1)
    target, hc = g.build_target(cfg, dev, taps)
    return dev, target, hc, taps, mbs, ds


def _objective(cfg, dev, hc, taps, provider):
    import torch

    from dflash_prep.bench import drafter_gpu as g
    from dflash_prep.train.objectives.dflash.drafter import Drafter, DrafterConfig
    from dflash_prep.train.loop import build_optimizer
    from dflash_prep.train.objectives.dflash.objective import DFlashObjective
    from dflash_prep.train.objectives.dflash.batch import AnchorSpec, default_gamma

    torch.manual_seed(cfg.seed)
    dcfg = DrafterConfig.from_target_config(hc, 1, g.B, cfg.vocab - 1, target_layer_ids=taps)
    spec = AnchorSpec(seed=cfg.seed, max_anchors=g.MAX_ANCHORS, policy="cap", block_size=g.B)
    tc = g.objective_config(cfg.device)
    obj = DFlashObjective(Drafter(dcfg).to(dev), provider, tc, anchor_spec=spec, gamma=default_gamma(g.B), identity={})
    return obj, build_optimizer(obj.model, tc)


def _train(dev, obj, opt, mbs, ds) -> list[float]:
    """Step times (s) of the drafter steps over ``mbs``, each ended by a device sync."""
    import torch

    from dflash_prep.train import distributed
    from dflash_prep.train.data import StepBatches
    from dflash_prep.train.loop import train_step

    d, autocast, times = distributed.Dist(0, 1, 0, dev), distributed.autocast_for(dev, True), []
    for s, mb in enumerate(_Manifest(mbs).microbatches(0)):
        t0 = time.perf_counter()
        b = obj.build(ds, mb, 0, "varlen", dev.type == "cuda")
        train_step(obj.model, opt, StepBatches(0, s, [b]), lr=1e-3, grad_clip=1.0, d=d, autocast=autocast,
                   objective=obj)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    return times


def colocated(cfg) -> dict:
    dev, target, hc, taps, mbs, ds = _setup(cfg)
    obj, opt = _objective(cfg, dev, hc, taps, target)
    t = _train(dev, obj, opt, mbs, ds)[cfg.warmup:]
    return {"step_s": statistics.median(t), "steps": len(t)}


def _rank(rank: int, init: str, cfg_d: dict, out: str) -> None:
    """One process of the split way (``torch.multiprocessing`` entry); writes ``split{rank}.json``."""
    import torch
    import torch.distributed as dist

    from dflash_prep.bench.drafter_gpu import GpuBenchConfig
    from dflash_prep.train.split.roles import Roles, join
    from dflash_prep.train.split.link import TapsReceiver, link_device

    cfg = GpuBenchConfig(**cfg_d)
    rec = {}
    try:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
        dev, target, hc, taps, mbs, ds = _setup(cfg)
        place = join(Roles(1, 1), rank=rank, world_size=2, local_rank=0, device=dev)
        if place.is_target:
            rec = _serve(cfg, place, dev, target, hc, taps, mbs, ds)
        else:
            from dflash_prep.train.split.taps import RemoteTaps

            remote = RemoteTaps(TapsReceiver(0, timeout=120.0, device=link_device(dev)), target.embed_tokens,
                                target.lm_head, device=dev, target_config=hc, roles=place.roles)
            del target   # the drafter rank keeps the embedding and the head only
            obj, opt = _objective(cfg, dev, hc, taps, remote)
            t = _train(dev, obj, opt, mbs, ds)
            rec = {"step_s": statistics.median(t[cfg.warmup:]), "steps": len(t) - cfg.warmup,
                   "wait_s": remote.receiver.wait_s, "time_s": sum(t)}
        dist.barrier()
    except Exception as e:  # the parent reports it
        rec = {"error": f"{type(e).__name__}: {e}"}
    Path(out, f"split{rank}.json").write_text(json.dumps(rec))
    os._exit(0)


def _serve(cfg, place, dev, target, hc, taps, mbs, ds) -> dict:
    from dflash_prep.bench import drafter_gpu as g
    from dflash_prep.train.objectives.dflash.batch import AnchorSpec, build_dflash_batch, default_gamma
    from dflash_prep.train.split.link import link_device
    from dflash_prep.train.split.worker import TargetWorker, sender_for
    from dflash_prep.train.split.taps import LocalTaps
    from dflash_prep.train import distributed

    spec = AnchorSpec(seed=cfg.seed, max_anchors=g.MAX_ANCHORS, policy="cap", block_size=g.B)
    build = (lambda mb, epoch: build_dflash_batch(ds, mb, epoch=epoch, spec=spec, gamma=default_gamma(g.B),
                                                  mask_token_id=cfg.vocab - 1, vocab_size=cfg.vocab))
    sender = sender_for(place, prefetch=2, timeout=120.0, device=link_device(dev))
    source = SimpleNamespace(dataset=ds, manifest=lambda e: _Manifest(mbs))
    w = TargetWorker(source, LocalTaps(target), sender, roles=place.roles, target_rank=0, build=build, device=dev,
                     autocast=distributed.autocast_for(dev, True))
    t = w.run([0])
    wall = sum(x.wall_s for x in t)
    return {"busy_frac": sum(x.busy_s for x in t) / wall if wall else 0.0, "bytes_sent": sender.bytes_sent,
            "messages": sender.messages}


def split(cfg, timeout_s: float) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="bench-twg-") as tmp:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank, args=(r, f"{tmp}/init", asdict(cfg), tmp)) for r in range(2)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        recs = [json.loads(Path(tmp, f"split{r}.json").read_text()) if Path(tmp, f"split{r}.json").exists()
                else {"error": "no result"} for r in range(2)]
    if alive or any("error" in r for r in recs):
        raise RuntimeError(f"split run failed: ranks {alive} still running after {timeout_s} s; {recs}")
    target, drafter = recs
    return {"step_s": drafter["step_s"], "steps": drafter["steps"],
            "drafter_wait_frac": drafter["wait_s"] / drafter["time_s"] if drafter["time_s"] else 0.0,
            "target_busy_frac": target["busy_frac"], "bytes_sent": target["bytes_sent"]}


def run(out: Path, *, smoke: bool = False, timeout_s: float = 45.0) -> dict:
    from dflash_prep.bench.drafter_gpu import GpuBenchConfig

    cfg = GpuBenchConfig(**(SMOKE if smoke else GPU))
    t0 = time.perf_counter()
    rep = {"format": FORMAT, "version": 1, "smoke": smoke, "config": asdict(cfg),
           "link": "gloo, CPU staging (NCCL refuses two ranks on one GPU)", "colocated": colocated(cfg)}
    rep["split"] = split(cfg, max(10.0, timeout_s - (time.perf_counter() - t0)))
    rep["split_over_colocated"] = rep["split"]["step_s"] / rep["colocated"]["step_s"]
    rep["wall_s"] = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    (out / "target_workers_gpu.json").write_text(json.dumps(rep, indent=2) + "\n")
    return rep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: proves the path runs")
    ap.add_argument("--timeout-s", type=float, default=45.0, help="the split way's processes are killed past this")
    a = ap.parse_args(argv)
    rep = run(a.out, smoke=a.smoke, timeout_s=a.timeout_s if not a.smoke else 600.0)
    print(json.dumps({k: rep[k] for k in ("colocated", "split", "split_over_colocated", "wall_s")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
