"""Target ranks and drafter ranks in one torchrun job (``--target-ranks K``).

A job of ``K + W`` processes: global ranks ``0..K-1`` are **target ranks** (each loads the
frozen target and computes taps), global ranks ``K..K+W-1`` are **drafter ranks** (they
train the drafter). The manifests are packed for the ``W`` drafter ranks: drafter ``i``
(global rank ``K + i``) is manifest rank ``i``. ``1 <= K <= W``.

**Who serves whom: round-robin.** Drafter ``i`` is served by target rank ``i % K``, so target
``k`` serves drafters ``k, k + K, k + 2K, ...``. Each target serves ``floor(W / K)`` or
``ceil(W / K)`` drafters (contiguous blocks balance the same), and both directions are one
closed form with no remainder rule: ``target_of(i) = i % K``, ``served(k) = range(k, W, K)``.
The manifest already balances the ranks of a step by drafter cost, so which drafters share a
target does not change a target's load beyond the count.

**Process groups.** The default group spans all ``K + W`` ranks (point-to-point taps go
through it, :mod:`dflash_prep.train.split.link`); :func:`join` creates the drafter-only group (``new_group``
is collective over the default group, so every rank calls it, target ranks included) and
hands drafters a :class:`~.distributed.Dist` of rank ``i`` in world ``W`` whose collectives
run on that group: the training loop's all-reduces never wait for a target rank.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dflash_prep.errors import ConfigError

from dflash_prep.train.distributed import Dist


@dataclass(frozen=True)
class Roles:
    """The job's split: ``target_ranks`` (K) target ranks first, then ``drafter_ranks`` (W)."""

    target_ranks: int
    """K, the number of target ranks (global ranks ``0..K-1``)."""
    drafter_ranks: int
    """W, the number of drafter ranks (global ranks ``K..K+W-1``); the manifests' world size."""

    def __post_init__(self):
        K, W = int(self.target_ranks), int(self.drafter_ranks)
        if W < 1:
            raise ConfigError(f"the manifests are packed for {W} drafter ranks; pack them with --world-size >= 1")
        if not 1 <= K <= W:
            raise ConfigError(f"--target-ranks {K} with manifests packed for {W} drafter ranks: K must be 1..{W} "
                              f"(each target rank serves at least one drafter rank); pass --target-ranks 1..{W}, "
                              "or re-pack the manifests with `dflash-prep pack --world-size W` for more drafter ranks")

    @property
    def world_size(self) -> int:
        """K + W: the torchrun job's process count."""
        return self.target_ranks + self.drafter_ranks

    def is_target(self, rank: int) -> bool:
        """Whether global rank ``rank`` is a target rank."""
        self._check_rank(rank)
        return rank < self.target_ranks

    def drafter_index(self, rank: int) -> int:
        """The manifest rank of the drafter at global rank ``rank``."""
        if self.is_target(rank):
            raise ValueError(f"global rank {rank} is a target rank, not a drafter rank")
        return rank - self.target_ranks

    def drafter_global(self, i: int) -> int:
        """Global rank of drafter (manifest rank) ``i``."""
        if not 0 <= i < self.drafter_ranks:
            raise ValueError(f"drafter rank {i} is outside 0..{self.drafter_ranks - 1}")
        return self.target_ranks + i

    def target_of(self, i: int) -> int:
        """Global rank of the target rank serving drafter (manifest rank) ``i``: ``i % K``."""
        self.drafter_global(i)  # range check
        return i % self.target_ranks

    def served(self, target_rank: int) -> list[int]:
        """Manifest ranks of the drafters target rank ``target_rank`` serves, ascending."""
        if not 0 <= target_rank < self.target_ranks:
            raise ValueError(f"target rank {target_rank} is outside 0..{self.target_ranks - 1}")
        return list(range(target_rank, self.drafter_ranks, self.target_ranks))

    def check_world(self, world_size: int) -> None:
        """Refuse a job whose process count is not K + W, naming the numbers and the launch fix."""
        if int(world_size) != self.world_size:
            raise ConfigError(
                f"--target-ranks {self.target_ranks} with manifests packed for {self.drafter_ranks} drafter ranks "
                f"needs {self.target_ranks} + {self.drafter_ranks} = {self.world_size} processes, but this job has "
                f"{world_size}; launch torchrun with --nproc_per_node/--nnodes giving {self.world_size} ranks, or "
                f"pass --target-ranks {int(world_size) - self.drafter_ranks} if that is 1..{self.drafter_ranks}, or "
                f"re-pack with `dflash-prep pack --world-size {int(world_size) - self.target_ranks}`")

    def _check_rank(self, rank: int) -> None:
        if not 0 <= int(rank) < self.world_size:
            raise ValueError(f"global rank {rank} is outside the job's {self.world_size} ranks")


@dataclass(frozen=True)
class Place:
    """This process's place in a split job (what :func:`join` returns)."""

    roles: Roles
    rank: int
    """Global rank in the default group."""
    dist: Dist | None
    """Drafter ranks: a Dist of rank ``i`` in world ``W`` on the drafter-only group. Target ranks: None."""

    @property
    def is_target(self) -> bool:
        return self.roles.is_target(self.rank)

    @property
    def served(self) -> list[int]:
        """Target ranks: the manifest ranks this process serves; drafter ranks: empty."""
        return self.roles.served(self.rank) if self.is_target else []

    @property
    def target(self) -> int:
        """Drafter ranks: the global rank of the target serving this drafter."""
        return self.roles.target_of(self.roles.drafter_index(self.rank))


def join(roles: Roles, *, rank: int, world_size: int, local_rank: int, device: torch.device,
         timeout: float | None = None) -> Place:
    """Check the job against ``roles`` and create the drafter-only process group.

    Call it on every rank of an initialised default group (``new_group`` is collective).
    ``timeout`` (seconds) bounds the drafter group's collectives; None keeps the backend default.
    """
    roles.check_world(world_size)
    if not dist.is_initialized():
        raise ConfigError("target ranks need a torchrun job (torch.distributed initialised); launch with torchrun "
                          "or dflash_prep.train.launch")
    members = [roles.drafter_global(i) for i in range(roles.drafter_ranks)]
    kw = {} if timeout is None else {"timeout": datetime.timedelta(seconds=float(timeout))}
    group = dist.new_group(ranks=members, **kw)
    if roles.is_target(rank):
        return Place(roles, rank, None)
    i = roles.drafter_index(rank)
    return Place(roles, rank, Dist(i, roles.drafter_ranks, local_rank, device, group=group, role="drafter rank",
                                   global_offset=roles.target_ranks))
