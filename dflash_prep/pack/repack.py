"""Resume an epoch under a new world size: re-pack its unconsumed rest for ``W' x A'``.

``dflash-prep pack --resume-from-step K --world-size W' [--grad-accum A']`` reads the epoch
``ROOT/epoch-000N`` packed for ``W x A``. Its first ``K`` steps (rows ``0 .. K*W*A - 1`` in
manifest order) were consumed; the rest of the epoch is re-packed, deterministically from
the same plan, into ``ROOT/resume/epoch-000N`` (a manifest of the same format):

1. the unconsumed micro-batches are kept as ``pack`` built them (same samples, same
   buckets, same budget), in the old manifest's order;
2. their count is made a multiple of ``W' x A'`` (:func:`steps.complete_steps`: split the
   fullest in two, or ``drop_last``), they are ordered by the named schedule keyed by
   ``(seed, epoch)`` and placed on ranks by LPT (:mod:`dflash_prep.pack.steps`), exactly the
   building blocks :func:`dflash_prep.pack.pack.build_epoch` uses;
3. the header records ``resume``: the parent's path, fingerprint, ``W x A``, the step it
   resumes from and the consumed micro-batch count. The continuation's step ``s`` is the
   epoch's step ``K + s``.

So every sample of the epoch is used exactly once across the two parts (the parent's
first ``K`` steps, then the continuation), which :func:`dflash_prep.verify.verify_epoch`
checks on the continuation. Each step's loss normaliser is still the step's own target
tokens, summed over its ``W' x A'`` micro-batches.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from dflash_prep.errors import ConfigError, FingerprintMismatch
from dflash_prep.formats import manifest
from dflash_prep.formats.fileio import fingerprint_json
from dflash_prep.formats.plan import Plan
from dflash_prep.formats.plan import load as load_plan
from dflash_prep.pack import bucketing, metrics, steps
from dflash_prep.pack.pack import PackConfig, resolve_lengths

RESUME_DIR = "resume"


def resume_dir(root: str | Path, epoch: int) -> Path:
    """``ROOT/resume/epoch-000N``: where the continuation of epoch N goes."""
    return manifest.epoch_dir(Path(root) / RESUME_DIR, epoch)


def build_rest(lens: np.ndarray, plan: Plan, parent: manifest.Manifest, from_step: int, cfg: PackConfig) -> dict:
    """The continuation's header and arrays (nothing written)."""
    if not 0 < from_step < parent.num_steps:
        raise ConfigError(f"{parent.path}: --resume-from-step must be in 1..{parent.num_steps - 1} (the epoch has "
                          f"{parent.num_steps} steps), got {from_step}")
    if parent.layout != "padded":
        raise ConfigError(f"{parent.path}: resuming under a new world size supports the padded layout; "
                          "re-pack the whole epoch for the new world size instead")
    t = np.asarray(parent.table)
    done = from_step * parent.world_size * parent.grad_accum
    rest = t[done:]
    order, offsets = manifest.rows_to_batches(rest, parent.sample_ids)          # (n_rest,), (M_rest + 1,)
    bucket = rest[:, manifest.COL["bucket"]].copy()
    where = f"the rest of epoch {parent.epoch} from step {from_step}"
    olens = np.asarray(lens, np.int64)[order].astype(np.int32)
    edges = np.asarray(parent.summary.get("class_edges") or bucketing.class_edges(lens), np.int64)
    se = steps.schedule_epoch(offsets, bucket, olens, edges, schedule=cfg.schedule, step_size=cfg.step_size,
                              drop_last=cfg.drop_last, n_buckets=plan.num_buckets, seed=plan.seed,
                              epoch=parent.epoch, where=where)
    offsets, bucket, n_split, sched, dropped_mb = se.offsets, se.bucket, se.n_split, se.sched, se.dropped
    real, mx, sq, class_tok, count = se.real, se.mx, se.sq, se.class_tok, se.count
    b = parent.header["budget"]
    alpha = float(b["cost_alpha"])
    mxf = mx.astype(np.float64)
    cost = count * (mxf + alpha * mxf * mxf)
    perm, step, rank, accum = steps.assign_ranks(cost[sched], cfg.world_size, cfg.grad_accum)
    mb = sched[perm]
    # rows point into a fresh sample_ids in manifest order (the rest is small next to an epoch)
    new_ids = np.concatenate([order[offsets[i]:offsets[i + 1]] for i in mb]) if len(mb) else np.empty(0, np.int64)
    start = np.concatenate([[0], np.cumsum(count[mb])[:-1]]).astype(np.int64)
    dropped = np.concatenate([np.asarray(parent.dropped_ids), *(order[offsets[i]:offsets[i + 1]] for i in dropped_mb)])
    padded = count * mx
    table = np.stack([start, count[mb], step, rank, accum, bucket[mb], mx[mb], real[mb], padded[mb], sq[mb]], axis=1)
    arrays = {"microbatches": np.ascontiguousarray(table, np.int64), "sample_ids": new_ids.astype(np.int64),
              "sample_lens": np.asarray(lens, np.int64)[new_ids].astype(np.int32),
              "dropped_ids": np.sort(dropped).astype(np.int64)}

    used_real, used_padded = int(real[mb].sum()), int(padded[mb].sum())
    summary = dict(parent.summary)
    summary.update({
        "efficiency": used_real / used_padded if used_padded else 1.0,
        "fill": (float(cost[mb].sum()) if float(b["packing_alpha"]) else used_padded) / (len(mb) * float(b["value"]))
        if len(mb) else 1.0,
        "microbatches": int(len(mb)), "steps": int(len(mb) // cfg.step_size), "samples": int(len(new_ids)),
        "real_tokens": used_real, "padded_tokens": used_padded,
        "sum_sq_len_max": int(sq[mb].max()) if len(mb) else 0,
        "sum_sq_len_mean": float(sq[mb].mean()) if len(mb) else 0.0,
        "step_mix": steps.step_mix_of(class_tok, mb, cfg.step_size),
        "rank_imbalance": metrics.rank_imbalance(cost[mb], step, rank, cfg.world_size),
        "dropped_samples": int(len(arrays["dropped_ids"])), "dropped_microbatches": int(len(dropped_mb)),
        "split_microbatches": int(n_split), "repeat_pair_rate": None, "repeat_pair_against": None,
        "predicted_efficiency": None, "class_edges": [int(e) for e in edges]})
    header = {k: v for k, v in parent.header.items() if k not in ("arrays", "fingerprint", "summary", "format",
                                                                   "version")}
    header.update({
        "world_size": cfg.world_size, "grad_accum": cfg.grad_accum, "num_steps": summary["steps"],
        "num_microbatches": summary["microbatches"], "num_samples_used": int(len(new_ids)),
        "options": {**parent.header["options"], "schedule": cfg.schedule, "drop_last": cfg.drop_last},
        "resume": {"parent": str(parent.path), "parent_fingerprint": parent.fingerprint,
                   "parent_world_size": parent.world_size, "parent_grad_accum": parent.grad_accum,
                   "from_step": int(from_step), "consumed_microbatches": int(done)},
        "summary": summary})
    header["inputs_fingerprint"] = fingerprint_json({"parent": parent.fingerprint, "from_step": int(from_step),
                                                     "world_size": cfg.world_size, "grad_accum": cfg.grad_accum,
                                                     "schedule": cfg.schedule, "drop_last": cfg.drop_last})
    return {"header": header, "arrays": arrays}


def resume_epoch(*, plan: Plan | str | Path, out: str | Path, epoch: int, from_step: int, world_size: int,
                 grad_accum: int = 1, schedule: str = "class-aware", drop_last: bool = False,
                 data: str | Path | None = None, lengths: str | Path | None = None, overwrite: bool = False) -> Path:
    """Write ``out/resume/epoch-000N``, the continuation of ``out/epoch-000N`` from ``from_step``
    for ``world_size x grad_accum`` (module docstring); returns its folder."""
    if not isinstance(plan, Plan):
        plan = load_plan(plan)
    elif not plan.fingerprint:
        plan = plan.with_fingerprint()
    cfg = PackConfig(world_size=world_size, grad_accum=grad_accum, schedule=schedule, drop_last=drop_last)
    src = resolve_lengths(plan, data=data, lengths=lengths)
    parent = manifest.open(manifest.epoch_dir(out, epoch), plan_fingerprint=plan.fingerprint,
                           data_fingerprint=src.fingerprint)
    res = build_rest(np.asarray(src.lengths), plan, parent, int(from_step), cfg)
    path = resume_dir(out, epoch)
    if (path / manifest.MANIFEST_FILE).is_file():
        if manifest.read_header(path).get("inputs_fingerprint") == res["header"]["inputs_fingerprint"]:
            return path
        if not overwrite:
            raise ConfigError(f"{path} already holds a continuation built from other inputs; pass --overwrite")
    # recorded paths are relative to the folder that records them (one level deeper than the parent)
    res["header"]["data"] = {**res["header"]["data"], "kind": src.kind,
                             "path": os.path.relpath(Path(src.path).resolve(), path.resolve())}
    res["header"]["resume"]["parent"] = os.path.relpath(Path(parent.path).resolve(), path.resolve())
    return manifest.write(path, res["header"], res["arrays"], overwrite=True)


def consumed_ids(m: manifest.Manifest) -> np.ndarray:
    """The sample ids a continuation's parent used before it (empty for a plain epoch).

    Checks that the parent is still the manifest the continuation was built from."""
    r = m.header.get("resume")
    if not r:
        return np.empty(0, np.int64)
    parent = manifest.open(Path(m.path) / r["parent"], data_fingerprint=m.data_fingerprint)
    if parent.fingerprint != r["parent_fingerprint"]:
        raise FingerprintMismatch(f"{m.path}: continues {r['parent']} fingerprint {r['parent_fingerprint']}, but that "
                                  f"folder now holds {parent.fingerprint}; re-run pack --resume-from-step")
    order, _ = manifest.rows_to_batches(np.asarray(parent.table)[:int(r["consumed_microbatches"])], parent.sample_ids)
    return np.asarray(order, np.int64)
