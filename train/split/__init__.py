"""The trainer's split jobs (``--target-ranks K``): the target on its own ranks, the drafters on the rest.

A torchrun job of ``K + W`` processes (:mod:`dflash_prep.train.split.roles`): global ranks ``0..K-1`` run the
objective's target worker (:func:`dflash_prep.train.objectives.serve_target`; for DFlash,
:func:`~dflash_prep.train.split.worker.serve`), global ranks ``K..K+W-1`` run the normal training loop on the
drafter-only :class:`~.distributed.Dist`, with a :class:`~dflash_prep.train.split.taps.RemoteTaps` provider instead
of a local target. The start, in this order on every rank:

1. :func:`join`: the roles (W = the job's size - K), the drafter-only process group;
2. :func:`prepare`: the drafter ranks open every epoch's manifest, so their rank 0 packs the
   missing ones (``--pack-missing``), while the target ranks wait on a default-group barrier:
   nobody packs twice, and a target rank never reads a half-written manifest;
3. the drafters set up as a colocated run does (checkpoint, ``--rescale`` continuation, the
   drafter and its heads), then :func:`announce` the cursor: drafter rank 0 broadcasts
   ``{epoch, step, global_step, max_steps, continuation}`` on the default group; the target
   ranks (:func:`await_start`) load the target after it and join a last default-group barrier,
   so that both sides run the same epochs and steps from the same cursor, resume included, and
   a target's load counts against the process group's timeout, not ``--target-timeout``.

Each of these three meeting points is a :mod:`.handshake` meeting: a rank that refuses the job
between two of them (a manifest packed for another W, a target it cannot load) brings its line
to the next one, and every other rank stops there with one line naming it.

``K`` is not part of the run contract: a checkpoint holds only the drafter's state, the same
for any K (the run key is the drafters'), so a run resumes colocated or split alike.
"""

from __future__ import annotations

from dflash_prep.train import distributed
from dflash_prep.train.split import handshake
from dflash_prep.train.split.roles import Place, Roles
from dflash_prep.train.split.roles import join as join_roles


def cuda_index(cfg):
    """What :func:`~dflash_prep.train.distributed.setup` calls with torch's GPU count for this
    process's ``cuda:i`` in a split job: :mod:`dflash_prep.train.split.gpus`' layout (each target
    rank's engine on GPUs of its own, ``tensor_parallel_size x pipeline_parallel_size`` of them)."""
    from dflash_prep.train.split import gpus

    return lambda count: gpus.for_job(cfg, count).device


def join(cfg, d: distributed.Dist) -> Place:
    """This process's :class:`~dflash_prep.train.split.roles.Place` in a job of ``d.world_size`` ranks, ``cfg.target_ranks`` of them targets."""
    roles = Roles(cfg.target_ranks, d.world_size - cfg.target_ranks)
    return join_roles(roles, rank=d.rank, world_size=d.world_size, local_rank=d.local_rank, device=d.device)


def prepare(cfg, place: Place, source=None) -> None:
    """Step 2 (module docstring): every epoch's manifest exists when this returns, on every rank."""
    if not place.is_target:
        if source is None:
            from dflash_prep.train.source import FileSource

            source = FileSource(cfg.data, cfg.plan, cfg.manifests, pack_missing=cfg.pack_missing, dist=place.dist)
        for epoch in range(cfg.epochs):
            source.manifest(epoch)
    handshake.meet(place)


def announce(place: Place, *, epoch: int, step: int, global_step: int, max_steps: int | None,
             continuation: dict | None) -> None:
    """Drafter ranks: tell the target ranks where training starts, then wait until they are ready."""
    start = [{"epoch": int(epoch), "step": int(step), "global_step": int(global_step),
              "max_steps": max_steps, "continuation": continuation}]
    handshake.meet(place, start[0] if place.dist.rank == 0 else None)
    handshake.meet(place)


def await_start(place: Place) -> dict:
    """Target ranks: the cursor :func:`announce` sends (call :func:`ready` after loading the target)."""
    return handshake.meet(place)[place.roles.drafter_global(0)]


def ready(place: Place) -> None:
    """Target ranks: loaded, the drafters may start."""
    handshake.meet(place)
