"""Which GPUs each process of a split job takes on its node, engines over several GPUs included.

A node's processes are its torchrun local ranks ``0..L-1``; the split job's target ranks are the
job's first global ranks (static rendezvous: global rank = ``node_rank * L + local_rank``), so on
any node the target ranks, if any, are local ranks ``0..k-1`` and the drafter ranks the rest. With
``t`` GPUs per target (``--target-engine`` with ``tensor_parallel_size x pipeline_parallel_size =
t``; 1 for the transformers target and for an engine on one GPU), the node's GPUs are laid out

    target rank j (local):  GPUs j*t .. j*t+t-1 for its engine, its own process on the first
    drafter rank r (local): GPU k*t + (r - k)

so the node needs ``k*t + (L - k)`` GPUs. With ``t = 1`` this is ``cuda:local_rank`` for everyone,
as a colocated job places its ranks. A target rank's process shares its first GPU with its engine
(it decodes the engine's rows and sends them over NCCL from there), as a colocated drafter rank
shares its GPU with its engine. Indices are torch's (``cuda:i``); an engine is given the job's own
``CUDA_VISIBLE_DEVICES`` entries at its indices (:func:`engine_visible`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dflash_prep.engine.extract import parse_engine_args
from dflash_prep.errors import ConfigError
from dflash_prep.train.engines.registry import BUILTIN


@dataclass(frozen=True)
class NodeGpus:
    """This process's GPUs: ``device`` (its ``cuda:i``) and, on a target rank, ``engine`` (its
    target's GPUs, ``device`` first); a drafter rank's ``engine`` is empty."""

    device: int
    engine: tuple[int, ...]


def node_gpus(*, rank: int, local_rank: int, local_world: int, target_ranks: int, per_target: int,
              count: int) -> NodeGpus:
    """The layout of the module docstring for global ``rank`` (local ``local_rank`` of
    ``local_world``) in a job whose first ``target_ranks`` ranks are targets of ``per_target`` GPUs
    each, on a node where torch sees ``count`` GPUs; a ConfigError when they are too few."""
    if per_target < 1:
        raise ConfigError(f"a target over {per_target} GPUs: tensor_parallel_size and pipeline_parallel_size "
                          "must be at least 1")
    if not 0 <= local_rank < local_world or rank < local_rank:
        raise ConfigError(f"local rank {local_rank} of {local_world} at global rank {rank}: not a torchrun layout")
    first = rank - local_rank                                    # this node's local rank 0
    k = min(max(target_ranks - first, 0), local_world)           # target ranks on this node
    need = k * per_target + (local_world - k)
    if need > count:
        what = f"{k} target rank(s) x {per_target} GPU(s) for their engines" if per_target > 1 else \
            f"{k} target rank(s)"
        raise ConfigError(f"--target-ranks {target_ranks}: this node runs {what} and {local_world - k} drafter "
                          f"rank(s), {need} GPUs in all, and torch sees {count} (CUDA_VISIBLE_DEVICES="
                          f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); give the node more GPUs, fewer "
                          "processes (--nproc_per_node), or an engine over fewer GPUs")
    if local_rank < k:
        gpus = tuple(range(local_rank * per_target, (local_rank + 1) * per_target))
        return NodeGpus(gpus[0], gpus)
    return NodeGpus(k * per_target + local_rank - k, ())


def per_target(cfg) -> int:
    """GPUs one target rank's target takes: its engine's ``tensor_parallel_size x
    pipeline_parallel_size`` (``--engine-arg``), 1 for the transformers target."""
    return 1 if cfg.target_engine == BUILTIN else engine_degree(dict(parse_engine_args(cfg.engine_args)))


def engine_degree(engine_args: dict) -> int:
    """GPUs one engine of ``--engine-arg``s ``engine_args`` spans: ``tensor_parallel_size x
    pipeline_parallel_size``."""
    return int(engine_args.get("tensor_parallel_size", 1)) * int(engine_args.get("pipeline_parallel_size", 1))


def for_job(cfg, count: int, env=os.environ) -> NodeGpus:
    """:func:`node_gpus` for this torchrun process (``RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``)."""
    local = int(env.get("LOCAL_RANK", "0"))
    return node_gpus(rank=int(env.get("RANK", "0")), local_rank=local,
                     local_world=int(env.get("LOCAL_WORLD_SIZE", str(local + 1))),
                     target_ranks=int(cfg.target_ranks), per_target=per_target(cfg), count=count)


def engine_visible(gpus: tuple[int, ...], visible: str | None = None) -> str:
    """The engine's ``CUDA_VISIBLE_DEVICES`` for torch indices ``gpus``: the job's own entries at those
    indices (``visible``, default the environment's), or the indices when the job sets none."""
    visible = visible if visible is not None else os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x.strip() for x in visible.split(",") if x.strip()] if visible else []
    if ids and max(gpus) >= len(ids):
        raise ConfigError(f"GPU {max(gpus)} asked for and CUDA_VISIBLE_DEVICES={visible} lists {len(ids)}")
    return ",".join(ids[i] if ids else str(i) for i in gpus)
