"""Resume an epoch under a new world size: re-pack its unconsumed rest for ``W' x A'``.

``dflash-prep pack --resume-from-step K --world-size W' [--grad-accum A']`` reads the epoch
``ROOT/epoch-000N`` packed for ``W x A`` (any layout, either objective). Its first ``K`` steps
(rows ``0 .. K*W*A - 1`` in manifest order) were consumed; the rest of the epoch is
re-packed, deterministically from the same plan, into ``ROOT/resume/epoch-000N`` (a manifest
of the same format and layout):

1. the unconsumed micro-batches are kept as ``pack`` built them (same samples, same
   buckets, same token budget, and under ``--objective dflash`` the same anchor and cost
   budgets), in the old manifest's order;
2. their count is made a multiple of ``W' x A'`` (:func:`steps.complete_steps`: split the
   micro-batches with the most samples in two, or ``drop_last``). A half of a micro-batch
   holds a subset of its samples, so it stays under every budget the whole one met: the
   padded ``n * max_len`` and cost, the varlen ``sum L``, the drafter's ``sum k`` anchors
   and ``sum c`` FLOPs. They are ordered by the named schedule keyed by ``(seed, epoch)``
   and placed on ranks by LPT (:mod:`dflash_prep.pack.steps`) on the cost
   :func:`dflash_prep.pack.pack.build_epoch` balances: ``n * (Lmax + alpha Lmax^2)`` padded,
   ``sum L + alpha L^2`` varlen, the drafter step FLOPs under ``--objective dflash``;
3. the header records ``resume``: the parent's path, fingerprint, ``W x A``, the step it
   resumes from and the consumed micro-batch count. The continuation's step ``s`` is the
   epoch's step ``K + s``. ``pack_config`` is the parent's with the new ``W' x A'``, schedule
   and ``drop_last``.

The objective's per-epoch state is rebuilt through the same hooks ``pack`` calls
(:class:`dflash_prep.objectives.base.DataObjective`: ``inputs``, ``begin_epoch``,
``rank_cost``, ``finish_epoch``) under the parent's resolved pack config, and the section the
objective writes into the header must come out as the parent's, or the re-pack is refused.
Under ``--objective dflash`` that is the drafter's counts and costs from the dataset's mask
counts and the parent's options. Anchors are a pure function of ``(anchor seed, epoch, sample
id)``, not of the micro-batch a sample sits in, so the continuation keeps the parent's
``dflash`` header section (options, budgets, sampler version, cost model) and its anchor
digest (over every sample of the dataset): both are recomputed and must equal the
parent's, or the re-pack is refused. ``anchor_counts.npy`` (and ``anchors.npy`` under
``--store-anchors``) follow the new ``sample_ids`` order.

So every sample of the epoch is used exactly once across the two parts (the parent's
first ``K`` steps, then the continuation), which :func:`dflash_prep.verify.verify_epoch`
checks on the continuation. Each step's loss normaliser is still the step's own target
tokens, summed over its ``W' x A'`` micro-batches.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from dflash_prep.errors import ConfigError, FingerprintMismatch, FormatError
from dflash_prep.formats import manifest
from dflash_prep.formats.fileio import fingerprint_json
from dflash_prep.formats.plan import Plan
from dflash_prep.formats.plan import load as load_plan
from dflash_prep import objectives
from dflash_prep.pack import batch_stats, metrics, steps
from dflash_prep.pack.pack import PackConfig, Rows, resolve_lengths

RESUME_DIR = "resume"


def resume_dir(root: str | Path, epoch: int) -> Path:
    """``ROOT/resume/epoch-000N``: where the continuation of epoch N goes."""
    return manifest.epoch_dir(Path(root) / RESUME_DIR, epoch)


@dataclass
class _Parent:
    """The parent's objective, resolved pack config and per-epoch state, rebuilt as ``pack`` builds them."""

    obj: objectives.DataObjective
    cfg: PackConfig
    state: object
    dataset: object


def _parent_config(parent: manifest.Manifest) -> PackConfig:
    if "pack_config" not in parent.header:
        raise FormatError(f"{parent.path}: the header records no pack_config (packed by an older dflash-prep); re-pack "
                          "the whole epoch for the new world size instead")
    return PackConfig.from_json(parent.header["pack_config"])


def _rebuild(parent: manifest.Manifest, lens: np.ndarray, src) -> _Parent:
    """The parent epoch's objective state under its own pack config (the objective's anchor
    digest, for dflash, starts beside the re-pack)."""
    cfg = _parent_config(parent)
    obj = objectives.of_header(parent.header)
    if src is None:
        mask_counts, dataset = None, None
    else:
        mask_counts, dataset = obj.inputs(cfg, src)
    return _Parent(obj, cfg, obj.begin_epoch(lens, cfg, parent.epoch, mask_counts), dataset)


def build_rest(lens: np.ndarray, plan: Plan, parent: manifest.Manifest, from_step: int, cfg: PackConfig, *,
               src=None) -> dict:
    """The continuation's header and arrays (nothing written); ``src`` is the length source
    (a dataset folder, needed under ``--objective dflash``)."""
    if not 0 < from_step < parent.num_steps:
        raise ConfigError(f"{parent.path}: --resume-from-step must be in 1..{parent.num_steps - 1} (the epoch has "
                          f"{parent.num_steps} steps), got {from_step}")
    lens = np.asarray(lens)
    pp = _rebuild(parent, lens, src)
    try:
        return _build_rest(lens, plan, parent, from_step, cfg, pp)
    finally:
        pp.obj.end_epoch(pp.state)


def _build_rest(lens: np.ndarray, plan: Plan, parent: manifest.Manifest, from_step: int, cfg: PackConfig,
                pp: _Parent) -> dict:
    done = from_step * parent.world_size * parent.grad_accum
    rest = np.asarray(parent.table)[done:]
    order, offsets = manifest.rows_to_batches(rest, parent.sample_ids)          # (n_rest,), (M_rest + 1,)
    edges = np.asarray(parent.summary.get("class_edges") or batch_stats.class_edges(lens), np.int64)
    se = steps.schedule_epoch(offsets, rest[:, manifest.COL["bucket"]].copy(), lens[order].astype(np.int32), edges,
                              schedule=cfg.schedule, step_size=cfg.step_size, drop_last=cfg.drop_last,
                              n_buckets=plan.num_buckets, seed=plan.seed, epoch=parent.epoch,
                              where=f"the rest of epoch {parent.epoch} from step {from_step}")
    cost, padded = pp.obj.rank_cost(pp.cfg, pp.state, order, se.offsets, se)   # what pack balanced ranks on
    perm, step, rank, accum = steps.assign_ranks(cost[se.sched], cfg.world_size, cfg.grad_accum)
    mb = se.sched[perm]                                  # manifest row -> packed micro-batch
    # rows point into a fresh sample_ids in manifest order (the rest is small next to an epoch)
    pieces = [order[se.offsets[i]:se.offsets[i + 1]] for i in mb]
    new_ids = np.concatenate(pieces) if pieces else np.empty(0, np.int64)
    count = se.count
    start = np.concatenate([[0], np.cumsum(count[mb])[:-1]]).astype(np.int64)
    dropped = np.concatenate([np.asarray(parent.dropped_ids),
                              *(order[se.offsets[i]:se.offsets[i + 1]] for i in se.dropped)])
    table = np.stack([start, count[mb], step, rank, accum, se.bucket[mb], se.mx[mb], se.real[mb], padded[mb],
                      se.sq[mb]], axis=1)
    sample_lens = np.asarray(lens, np.int64)[new_ids].astype(np.int32)
    arrays = {"microbatches": np.ascontiguousarray(table, np.int64), "sample_ids": new_ids.astype(np.int64),
              "sample_lens": sample_lens, "dropped_ids": np.sort(dropped).astype(np.int64)}
    if parent.layout == "varlen":
        arrays["cu_seqlens"] = batch_stats.prefix_sum(sample_lens)
    summary = _summary(parent, cfg, se, mb, cost, padded, step, rank, edges, len(new_ids),
                       len(arrays["dropped_ids"]))
    header = _header(parent, cfg, from_step, done, summary)
    _objective_arrays(parent, pp, arrays, header, Rows(start, count[mb], se.real[mb]))
    return {"header": header, "arrays": arrays}


def _summary(parent, cfg, se, mb, cost, padded, step, rank, edges, n_used: int, n_dropped: int) -> dict:
    """The parent's summary with every metric recomputed over the continuation's rows."""
    b = parent.header["budget"]
    used_real, used_padded = int(se.real[mb].sum()), int(padded[mb].sum())
    summary = dict(parent.summary)
    summary.update({
        "efficiency": used_real / used_padded if used_padded else 1.0,
        "fill": (float(cost[mb].sum()) if float(b["packing_alpha"]) else used_padded) / (len(mb) * float(b["value"]))
        if len(mb) else 1.0,
        "microbatches": int(len(mb)), "steps": int(len(mb) // cfg.step_size), "samples": int(n_used),
        "real_tokens": used_real, "padded_tokens": used_padded,
        "step_mix": steps.step_mix_of(se.class_tok, mb, cfg.step_size),
        "rank_imbalance": metrics.rank_imbalance(cost[mb], step, rank, cfg.world_size),
        "dropped_samples": int(n_dropped), "dropped_microbatches": int(len(se.dropped)),
        "split_microbatches": int(se.n_split),
        "sum_sq_len_max": int(se.sq[mb].max()) if len(mb) else 0,
        "sum_sq_len_mean": float(se.sq[mb].mean()) if len(mb) else 0.0,
        "repeat_pair_rate": None, "repeat_pair_against": None,
        "predicted_efficiency": None, "class_edges": [int(e) for e in edges]})
    return summary


def _header(parent: manifest.Manifest, cfg: PackConfig, from_step: int, done: int, summary: dict) -> dict:
    """The parent's header with the new step layout, its ``resume`` record and inputs fingerprint."""
    header = {k: v for k, v in parent.header.items() if k not in ("arrays", "fingerprint", "summary", "format",
                                                                   "version")}
    header.update({
        "world_size": cfg.world_size, "grad_accum": cfg.grad_accum, "num_steps": summary["steps"],
        "num_microbatches": summary["microbatches"], "num_samples_used": summary["samples"],
        "options": {**parent.header["options"], "schedule": cfg.schedule, "drop_last": cfg.drop_last},
        "resume": {"parent": str(parent.path), "parent_fingerprint": parent.fingerprint,
                   "parent_world_size": parent.world_size, "parent_grad_accum": parent.grad_accum,
                   "from_step": int(from_step), "consumed_microbatches": int(done)},
        "summary": summary})
    if "pack_config" in parent.header:
        pc = replace(_parent_config(parent), world_size=cfg.world_size, grad_accum=cfg.grad_accum,
                     schedule=cfg.schedule, drop_last=cfg.drop_last)
        header.update(pack_config=pc.to_json(), pack_config_fingerprint=pc.fingerprint())
    header["inputs_fingerprint"] = inputs_fingerprint(parent, cfg, from_step)
    return header


def inputs_fingerprint(parent: manifest.Manifest, cfg: PackConfig, from_step: int) -> str:
    """What a continuation is a pure function of: its parent, the step it resumes from and the new steps."""
    return fingerprint_json({"parent": parent.fingerprint, "from_step": int(from_step), "world_size": cfg.world_size,
                             "grad_accum": cfg.grad_accum, "schedule": cfg.schedule, "drop_last": cfg.drop_last})


def _objective_arrays(parent: manifest.Manifest, pp: _Parent, arrays: dict, header: dict, rows: Rows) -> None:
    """The objective's arrays (dflash: ``anchor_counts``, ``anchors``), summary entries and header
    section for the new rows; the section must come out as the parent's (module docstring)."""
    name = pp.obj.name
    had = name in header
    pp.obj.finish_epoch(pp.state, pp.cfg, parent.epoch, arrays, header, header["summary"], rows, pp.dataset)
    if had and header[name] != parent.header[name]:
        mine, theirs = header[name], parent.header[name]
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        raise FormatError(f"{parent.path}: its {name} header ({', '.join(diff)}) is not what this dflash-prep derives "
                          "from the same dataset and options (packed by another version, or the data changed); "
                          "re-pack the whole epoch for the new world size instead")


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
    path = resume_dir(out, epoch)
    fp = inputs_fingerprint(parent, cfg, from_step)
    if (path / manifest.MANIFEST_FILE).is_file():
        if manifest.read_header(path).get("inputs_fingerprint") == fp:
            return path
        if not overwrite:
            raise ConfigError(f"{path} already holds a continuation built from other inputs; pass --overwrite")
    res = build_rest(np.asarray(src.lengths), plan, parent, int(from_step), cfg, src=src)
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
