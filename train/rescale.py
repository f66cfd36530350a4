"""Resume a run under a new world size (``python -m dflash_prep.train --rescale``).

A checkpoint taken at global step ``g``, cursor ``(epoch N, step K)``, by a job of ``W``
ranks continues under ``W'`` ranks only when asked (``--rescale``):

1. epoch ``N`` from step ``K`` is read from its continuation manifest ``MANIFESTS/resume/
   epoch-000N`` (:mod:`dflash_prep.pack.repack`: the unconsumed rest of the epoch re-packed for
   ``W' x A`` from the same plan, in the epoch's layout: padded or varlen, LM or DFlash; a
   DFlash continuation keeps the parent's anchor options and digest, so the drafter
   regenerates the same anchors for every sample, keyed by (anchor seed, epoch, sample id)).
   When it is missing, rank 0 writes it with :func:`dflash_prep.pack.repack.resume_epoch`
   while the other ranks wait at a barrier, as :mod:`dflash_prep.train.source` packs a
   missing epoch. The continuation's step ``s`` is
   shown to the loop as the epoch's step ``K + s`` (:class:`ShiftedManifest`), so the cursor,
   the log and later checkpoints keep the epoch's own step numbers and the global step
   continues at ``g``. A cursor at an epoch edge (``K = 0``) needs no continuation;
2. later epochs read the plain manifests, which must be packed for ``W'``;
3. the run key records ``continuation`` (epoch, from step, parent ``W x A``, new ``W``) and the
   new world size; :func:`check_key` accepts exactly those two changes and refuses every
   other one (:func:`dflash_prep.train.checkpoint.check_run_key`). The accumulation ``A`` is
   kept (steps are not elastic);
4. the checkpoint's per-rank RNG states cannot map onto another rank count, so every rank is
   re-seeded from ``(seed, global step, rank)`` (:func:`reseed`). CPU training is
   deterministic with no dropout, so this changes nothing there; on CUDA it fixes the random
   state of the new ranks reproducibly.

The loss normaliser stays the step's all-reduced target count (:func:`dflash_prep.train.loop.
train_step`), now over ``W'`` ranks. Without ``--rescale`` a world-size change is refused with
a message naming the option and the ``pack --resume-from-step`` command.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import torch

from dflash_prep.errors import ConfigError, FormatError
from dflash_prep.formats import manifest as man
from dflash_prep.pack.repack import resume_dir, resume_epoch

from dflash_prep.train import checkpoint as ckpt
from dflash_prep.train import distributed


class ShiftedManifest:
    """A continuation manifest whose step ``s`` reads as step ``offset + s`` of its epoch."""

    def __init__(self, m, offset: int):
        self._m, self.offset = m, int(offset)

    def __getattr__(self, name):
        return getattr(self._m, name)

    @property
    def num_steps(self) -> int:
        return self.offset + int(self._m.num_steps)

    def microbatches(self, rank: int, start_step: int = 0):
        if int(start_step) < self.offset:
            raise ConfigError(f"{self._m.path}: continues epoch {self._m.epoch} from step {self.offset}; steps "
                              f"before it ({start_step}..) are in the parent manifest")
        for mb in self._m.microbatches(rank, start_step=int(start_step) - self.offset):
            yield dataclasses.replace(mb, step=int(mb.step) + self.offset)


class RescaledSource:
    """``source`` with epoch ``cont['epoch']`` read from its continuation (module docstring)."""

    def __init__(self, source, cont: dict, d: distributed.Dist):
        self._src, self.cont, self.d = source, cont, d

    def __getattr__(self, name):
        return getattr(self._src, name)

    def manifest(self, epoch: int):
        if epoch != int(self.cont["epoch"]):
            return self._src.manifest(epoch)

        s, c = self._src, self.cont
        path = resume_dir(s.root, epoch)
        # every rank passes the barrier on every call: whether the continuation exists is rank 0's to
        # see (another rank looking after rank 0 wrote it must still wait for the others)
        if self.d.is_main and not (path / man.MANIFEST_FILE).is_file():
            print(f"packing the rest of epoch {epoch} from step {c['from_step']} for world size "
                  f"{c['world_size']} into {path}", flush=True)
            opts = man.open(man.epoch_dir(s.root, epoch)).meta.get("options") or {}
            resume_epoch(plan=s.plan_path, out=s.root, epoch=epoch, from_step=int(c["from_step"]),
                         world_size=int(c["world_size"]), grad_accum=int(c["parent_grad_accum"]),
                         schedule=opts.get("schedule", "class-aware"), drop_last=bool(opts.get("drop_last")),
                         data=s.data_path)
        distributed.barrier(self.d)
        m = man.open(path, plan_fingerprint=s.plan_fingerprint, data_fingerprint=str(s.dataset.fingerprint))
        r = m.header.get("resume") or {}
        if (int(r.get("from_step", -1)), int(m.world_size)) != (int(c["from_step"]), int(c["world_size"])):
            raise FormatError(f"{path}: continues from step {r.get('from_step')} for world size {m.world_size}, but "
                              f"the checkpoint needs step {c['from_step']} for {c['world_size']}; re-run `dflash-prep "
                              f"pack --epoch {epoch} --resume-from-step {c['from_step']} --world-size "
                              f"{c['world_size']} --overwrite`")
        return ShiftedManifest(m, int(c["from_step"]))


def plan_resume(state: dict | None, *, rescale: bool, world_size: int, ckpt_path) -> dict | None:
    """The continuation this resume reads (None: plain manifests only).

    A checkpoint already inside a continuation at this world size keeps it; a new world size
    needs ``rescale`` and starts a continuation at the cursor (none at an epoch edge). A new
    world size while the cursor is still inside a continuation is refused: the continuation
    is always of the epoch manifest, and the steps since the first change were not read from
    it."""
    if state is None:
        return None
    key, cur = state["run_key"], state["cursor"]
    saved = key.get("continuation")
    W = int(key["world_size"])
    if W == world_size:
        return saved
    e, k = int(cur["epoch"]), int(cur["step"])
    if saved and int(saved["epoch"]) == e and k > 0:
        # the epoch's steps from saved["from_step"] on came from the continuation, not from the epoch
        # manifest that a second re-pack would continue: its samples would be trained twice or never
        raise ConfigError(
            f"{ckpt_path}: epoch {e} already continues from step {saved['from_step']} under world size {W} "
            f"(MANIFESTS/resume/epoch-{e:04d}); a second world-size change inside one epoch is not supported. "
            f"Finish epoch {e} on {W} rank(s) (the next epoch edge may change the world size with --rescale), "
            "or pass --from-scratch")
    if not rescale:
        raise ConfigError(
            f"{ckpt_path}: the checkpoint was trained with world size {W} but this job has {world_size} "
            f"process(es). To continue it under {world_size}, pass --rescale (the rest of epoch {e} from step {k} is "
            f"re-packed for {world_size} ranks, or pack it yourself: `dflash-prep pack --plan PLAN --out MANIFESTS "
            f"--epoch {e} --resume-from-step {k} --world-size {world_size} --grad-accum {key['grad_accum']}`; later "
            f"epochs must be packed for {world_size}); or launch {W} ranks; or pass --from-scratch")
    if k == 0:
        return saved
    return {"epoch": e, "from_step": k, "parent_world_size": W, "parent_grad_accum": int(key["grad_accum"]),
            "world_size": int(world_size)}


def check_key(saved: dict, current: dict, *, path) -> None:
    """:func:`checkpoint.check_run_key` that accepts exactly a new world size and continuation."""
    allowed = {k: current.get(k) for k in ("world_size", "continuation")}
    ckpt.check_run_key({**saved, **allowed}, current, path=path)


def reseed(seed: int, global_step: int, rank: int) -> None:
    """Every generator of this rank from ``(seed, global_step, rank)`` (module docstring, 4)."""
    ss = np.random.SeedSequence([int(seed), int(global_step), int(rank)])
    a, b = ss.generate_state(2, np.uint32)
    torch.manual_seed(int(a) << 32 | int(b))
    np.random.seed(int(a))
    random.seed(int(b))


def source_for(source, cont: dict | None, d: distributed.Dist):
    return source if cont is None else RescaledSource(source, cont, d)


__all__ = ["ShiftedManifest", "RescaledSource", "plan_resume", "check_key", "reseed", "source_for"]
