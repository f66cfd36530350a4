"""Shared pieces of the EAGLE-3 trainer tests: the run config over the fakes (whose manifests
carry the real vocabulary map of the fake data) on the tiny Qwen3 target, and a gloo worker."""

from __future__ import annotations

from pathlib import Path

from dflash_prep.tests.train.dflash_fixtures import tiny_target  # noqa: F401 (re-exported for the tests)

#: a draft vocabulary smaller than the fakes' 94 ids, so the map is exercised; 3 passes
EAGLE3 = (48, 3)


def eagle3_cfg(out, target, **kw):
    from dflash_prep.train.config import build as build_config

    base = dict(out=str(out), objective="eagle3", target=str(target), target_layer_ids=(0, 1, 2), progress=False,
                prefetch=2, warmup_steps=1, lr=3e-3, device="cpu", ce_chunk=16, optimizer="adamw")
    base.update(kw)
    return build_config(**base)


def eagle3_source(**kw):
    from dflash_prep.tests.train.train_fakes import FakeSource

    return FakeSource(n=48, layout="varlen", eagle3=EAGLE3, **kw)


def eagle3_grads_setup(target, world: int, accum: int, rank: int, **kw):
    """Objective, optimizer and step-0 batches of ``rank`` for W x A over the same micro-batches."""
    import torch

    from dflash_prep.train.data import iter_steps
    from dflash_prep.train.objectives import build_objective
    from dflash_prep.train.optim import build_optimizer

    src = eagle3_source(world_size=world, grad_accum=accum)
    cfg = eagle3_cfg("unused", target, **kw)
    m = src.manifest(0)
    obj = build_objective(cfg, src.dataset, torch.device("cpu"), manifest=m)
    sb = next(iter(iter_steps(src.dataset, m, rank, build=lambda mb: obj.build(src.dataset, mb, 0, m.layout, False))))
    return obj, build_optimizer(obj.model, cfg), sb


def gloo_eagle3_worker(rank: int, world: int, init_file: str, out_dir: str, target: str, kw: dict) -> None:
    """``torch.multiprocessing.spawn`` entry: one EAGLE-3 step over W=world, A=1 with no clipping;
    rank 0 saves the summed gradients, the parameters after the step and the step record."""
    import contextlib

    import torch
    import torch.distributed as dist

    from dflash_prep.train.distributed import Dist
    from dflash_prep.train.loop import train_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        obj, opt, sb = eagle3_grads_setup(target, world, 1, rank, **kw)
        st = train_step(obj.model, opt, sb, lr=1e-3, grad_clip=0.0, d=Dist(rank, world, 0, torch.device("cpu")),
                        autocast=contextlib.nullcontext, objective=obj)
        if rank == 0:
            torch.save({"grads": {n: p.grad.clone() for n, p in obj.model.named_parameters() if p.grad is not None},
                        "step": st, "params": {n: p.detach().clone() for n, p in obj.model.named_parameters()}},
                       Path(out_dir) / "eagle3_grads.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
