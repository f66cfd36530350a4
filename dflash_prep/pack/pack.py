"""The ``pack`` stage: a plan + lengths -> one manifest folder per epoch.

For each epoch (a pure function of data, plan, options and the epoch number):

1. pack micro-batches: ``padded`` runs :func:`bucketing.pack_padded_epoch` (keyed bucket
   shuffle, sorting windows, greedy under the budget); ``varlen`` runs
   :func:`bucketing.pack_varlen_epoch` (keyed random order, first-fit into open bins);
   ``objective="dflash"`` runs :func:`pack_dflash.pack_drafter` (varlen first-fit under
   token, anchor and drafter-cost budgets) and prices rank balance on drafter FLOPs;
2. make whole steps of ``W x A`` (:func:`steps.complete_steps`: split, or drop the tail
   with ``drop_last``), order the micro-batches with the named schedule and place them on
   ranks (:mod:`dflash_prep.pack.steps`);
3. write ``epoch-000N/`` (:mod:`dflash_prep.formats.manifest`) with a summary: efficiency, fill,
   steps, step mix, rank imbalance, dropped samples, sum L^2, and the repeat-pair rate
   against the previous epoch (packed in the same call, or read from disk beside it).

Every pass is O(N) numba and the summary metrics come from fused per-batch aggregates (O(M)
after one O(N) pass), so an epoch costs about what hashing and writing its manifest costs,
with peak memory a small multiple of the manifest; ``verify`` recomputes the metrics with
:mod:`metrics`. Speed and memory at 902K and 100M samples (``bench/pack_speed.py``):
docs/benchmarks.md#pack.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import numba as nb
import numpy as np

from dflash_prep import objectives
from dflash_prep.errors import ConfigError, FormatError
from dflash_prep.formats import lengths as lengths_mod
from dflash_prep.formats import manifest, outputs
from dflash_prep.formats.fileio import fingerprint_json, holds_marker
from dflash_prep.formats.plan import MAX_REPEAT_PAIR, Budget, Plan, check_seed
from dflash_prep.formats.plan import load as load_plan
from dflash_prep.pack import batch_stats, bucketing
from dflash_prep.pack import config as pack_config
from dflash_prep.pack import metrics, steps
from dflash_prep.pack.config import PackConfig
from dflash_prep.progress import progress

__all__ = ["PackConfig", "EpochResult", "build_epoch", "pack_epochs", "inputs_fingerprint"]


@dataclass
class EpochResult:
    """One packed epoch in memory: the header (no array hashes yet) and the arrays."""

    header: dict
    arrays: dict


# ----------------------------------------------------------------------------- numba helpers
@nb.njit(cache=True)
def _compact(order, olens, offsets, keep, new_start):
    # Drop the micro-batches with keep[b] == 0 from order/olens in place (a stable, left-moving
    # copy); new_start[b] = where kept micro-batch b now starts. Returns the samples kept.
    p = 0
    for b in range(offsets.shape[0] - 1):
        new_start[b] = p if keep[b] else -1
        if keep[b]:
            for i in range(offsets[b], offsets[b + 1]):
                order[p] = order[i]
                olens[p] = olens[i]
                p += 1
    return p


@nb.njit(cache=True)
def _batch_of(ids, start, count, out):
    for m in range(start.shape[0]):
        for i in range(start[m], start[m] + count[m]):
            out[ids[i]] = m


@nb.njit(cache=True)
def _repeat_pairs(prev_ids, prev_start, prev_count, batch_of):
    # Pairs co-batched in the previous epoch and again now (samples absent now skipped).
    total = np.int64(0)
    again = np.int64(0)
    for b in range(prev_start.shape[0]):
        n = prev_count[b]
        total += n * (n - 1) // 2
        cur = np.empty(n, np.int64)
        k = 0
        for i in range(prev_start[b], prev_start[b] + n):
            c = batch_of[prev_ids[i]]
            if c >= 0:
                cur[k] = c
                k += 1
        cur = np.sort(cur[:k])
        run = 1
        for i in range(1, k + 1):
            if i < k and cur[i] == cur[i - 1]:
                run += 1
            else:
                again += run * (run - 1) // 2
                run = 1
    return total, again


def repeat_pair_rate(prev_table: np.ndarray, prev_ids: np.ndarray, cur_table: np.ndarray, cur_ids: np.ndarray,
                     num_samples: int) -> float:
    """:func:`metrics.repeat_pair_rate` over two manifests' tables, in O(N) memory of int32."""
    c = manifest.COL
    batch_of = np.full(num_samples, -1, np.int64 if len(cur_table) >= 2**31 else np.int32)
    _batch_of(np.asarray(cur_ids), np.ascontiguousarray(cur_table[:, c["start"]]),
              np.ascontiguousarray(cur_table[:, c["count"]]), batch_of)
    total, again = _repeat_pairs(np.asarray(prev_ids), np.ascontiguousarray(prev_table[:, c["start"]]),
                                 np.ascontiguousarray(prev_table[:, c["count"]]), batch_of)
    return float(again) / total if total else 0.0


# ----------------------------------------------------------------------------- one epoch
def build_epoch(lens: np.ndarray, plan: Plan, cfg: PackConfig, epoch: int, edges: np.ndarray | None = None, *,
                mask_counts: lengths_mod.MaskCounts | None = None,
                dataset=None) -> EpochResult:
    """Pack one epoch in memory (module docstring); nothing is written.

    ``edges`` are the step-mix classes, :func:`metrics.class_edges` of ``lens`` (computed
    here when not given; :func:`pack_epochs` computes them once for all its epochs). The
    objective's inputs (:meth:`~dflash_prep.objectives.base.DataObjective.inputs`: for
    ``dflash`` the ``mask_counts`` per sample id, and the
    :class:`dflash_prep.formats.dataset.Dataset` to store anchor positions) come along.
    """
    if epoch < 0:
        raise ConfigError(f"--epoch must be >= 0, got {epoch}")
    check_seed(epoch, "--epoch")  # the epoch keys the shuffles too: 2^64 would repeat epoch 0
    cfg = cfg.resolve(plan)
    obj = objectives.get(cfg.objective)
    state = obj.begin_epoch(lens, cfg, epoch, mask_counts)
    try:
        return _build_epoch(lens, plan, cfg, epoch, edges, obj, state, dataset)
    finally:
        obj.end_epoch(state)


@dataclass
class Rows:
    """Per manifest row: where its samples start in ``sample_ids``, their count, real tokens."""

    start: np.ndarray
    count: np.ndarray
    real: np.ndarray


def _build_epoch(lens: np.ndarray, plan: Plan, cfg: PackConfig, epoch: int, edges: np.ndarray | None,
                 obj, state, dataset) -> EpochResult:
    order, offsets, bucket, olens = obj.pack(lens, plan, cfg, epoch, state)
    edges = batch_stats.class_edges(lens) if edges is None else edges
    se = steps.schedule_epoch(offsets, bucket, olens, edges, schedule=cfg.schedule, step_size=cfg.step_size,
                              drop_last=cfg.drop_last, n_buckets=plan.num_buckets, seed=plan.seed, epoch=epoch,
                              where=f"epoch {epoch}")
    offsets, bucket, sched, dropped_mb = se.offsets, se.bucket, se.sched, se.dropped
    cost, padded = obj.rank_cost(cfg, state, order, offsets, se)
    perm, step, rank, accum = steps.assign_ranks(cost[sched], cfg.world_size, cfg.grad_accum)
    mb = sched[perm]                                        # manifest row -> packed micro-batch
    # sample_ids stay in packing order (no N-sized gather); rows point into it by start/count
    dropped = np.sort(np.concatenate([order[offsets[b]:offsets[b + 1]] for b in dropped_mb])
                      if len(dropped_mb) else np.empty(0, np.int64))
    if len(dropped_mb):
        keep = np.ones(len(se.count), np.uint8)
        keep[dropped_mb] = 0
        new_start = np.empty(len(se.count), np.int64)
        n_used = _compact(order, olens, offsets, keep, new_start)
        start = new_start[mb]
    else:
        n_used, start = len(order), offsets[:-1][mb]
    table = np.stack([start, se.count[mb], step, rank, accum, bucket[mb], se.mx[mb], se.real[mb], padded[mb],
                      se.sq[mb]], axis=1)
    arrays = {"microbatches": np.ascontiguousarray(table, np.int64), "sample_ids": order[:n_used],
              "sample_lens": olens[:n_used], "dropped_ids": dropped.astype(np.int64)}
    if cfg.layout == "varlen":
        arrays["cu_seqlens"] = batch_stats.prefix_sum(olens[:n_used])
    summary = _summary(plan, cfg, obj, se, mb, cost, padded, step, rank, n_used, len(dropped), edges)
    header = _header(lens, plan, cfg, epoch, n_used, summary)
    obj.finish_epoch(state, cfg, epoch, arrays, header, summary, Rows(start, se.count[mb], se.real[mb]), dataset)
    return EpochResult(header=header, arrays=arrays)


def _summary(plan: Plan, cfg: PackConfig, obj, se, mb, cost, padded, step, rank, n_used: int, n_dropped: int,
             edges) -> dict:
    """The manifest's ``summary`` (definitions.md's metrics) of the scheduled micro-batches ``mb``."""
    budget = cfg.budget
    used_real, used_padded = int(se.real[mb].sum()), int(padded[mb].sum())
    return {
        "efficiency": used_real / used_padded if used_padded else 1.0,
        # in the budget's unit: tokens, or packing cost under a cost budget (alpha_pack == alpha_cost then)
        "fill": (float(cost[mb].sum()) if budget.packing_alpha else used_padded) / (len(mb) * float(budget.value))
        if len(mb) else 1.0,
        "microbatches": int(len(mb)),
        "steps": int(len(mb) // cfg.step_size),
        "samples": int(n_used),
        "real_tokens": used_real,
        "padded_tokens": used_padded,
        "step_mix": steps.step_mix_of(se.class_tok, mb, cfg.step_size),
        "rank_imbalance": metrics.rank_imbalance(cost[mb], step, rank, cfg.world_size),
        "rank_imbalance_alpha": budget.alpha,
        "rank_imbalance_cost": obj.rank_cost_name,
        "dropped_samples": int(n_dropped),
        "dropped_microbatches": int(len(se.dropped)),
        "split_microbatches": int(se.n_split),
        "sum_sq_len_max": int(se.sq[mb].max()) if len(mb) else 0,
        "sum_sq_len_mean": float(se.sq[mb].mean()) if len(mb) else 0.0,
        "repeat_pair_rate": None,
        "repeat_pair_against": None,
        "predicted_efficiency": _prediction(plan, cfg),
        "class_edges": [int(e) for e in edges],
    }


def _header(lens: np.ndarray, plan: Plan, cfg: PackConfig, epoch: int, n_used: int, summary: dict) -> dict:
    """The manifest header of an epoch (``summary`` included; the objective adds its section)."""
    return {
        "epoch": int(epoch),
        "layout": cfg.layout,
        "world_size": cfg.world_size,
        "grad_accum": cfg.grad_accum,
        "num_steps": summary["steps"],
        "num_microbatches": summary["microbatches"],
        "num_samples_used": int(n_used),
        "budget": cfg.budget.to_json(),
        "options": {"schedule": cfg.schedule, "window": int(cfg.window), "drop_last": cfg.drop_last,
                    "open_bins": cfg.open_bins, "boundaries": [int(b) for b in plan.boundaries], "seed": int(plan.seed),
                    "objective": cfg.objective},
        "pack_config": cfg.to_json(),
        "pack_config_fingerprint": cfg.fingerprint(),
        "plan_fingerprint": plan.fingerprint,
        "data": {k2: plan.data.get(k2) for k2 in ("kind", "path", "fingerprint")} | {"num_samples": int(len(lens))},
        "inputs_fingerprint": inputs_fingerprint(plan, cfg, epoch),
        "columns": list(manifest.COLUMNS),
        "summary": summary,
    }


def _prediction(plan: Plan, cfg: PackConfig):
    """Analyze's predicted efficiency, when this epoch packs exactly what analyze simulated."""
    cfg = cfg.resolve(plan)
    same = objectives.get(cfg.objective).predicts_plan(cfg) and cfg.budget == plan.budget and cfg.window == plan.window
    eff = plan.predicted.get("efficiency") if same else None
    return float(eff) if eff is not None else None


def run_identity(plan: Plan, cfg: PackConfig) -> dict:
    """What every epoch of a root shares: the plan (incl. data) and the resolved options."""
    return {"plan": plan.fingerprint, "config": cfg.resolve(plan).to_json(),
            "format": [manifest.MANIFEST_FORMAT, manifest.MANIFEST_VERSION]}


def inputs_fingerprint(plan: Plan, cfg: PackConfig, epoch: int) -> str:
    """What an epoch is a pure function of: the plan (incl. data), the options, the epoch."""
    return fingerprint_json({**run_identity(plan, cfg), "epoch": int(epoch)})


# ----------------------------------------------------------------------------- the stage
def resolve_lengths(plan: Plan, *, data=None, lengths=None) -> lengths_mod.LengthSource:
    """The plan's data (or the ``--data`` / ``--lengths`` override), checked against the plan."""
    if data is None and lengths is None:
        kind, path = plan.data.get("kind"), plan.data.get("path")
        if not path:
            raise ConfigError("the plan records no data path; pass --data DIR or --lengths FILE")
        data, lengths = (path, None) if kind == "dataset" else (None, path)
    src = lengths_mod.load(data=data, lengths_file=lengths)
    plan.check_data(src)
    return src


def previous_epoch(out: Path, epoch: int, data_fingerprint: str):
    """(table, sample_ids) of epoch - 1 from disk, if there for the same data; else None."""
    if epoch == 0:
        return None
    prev = manifest.epoch_dir(out, epoch - 1)
    if not (prev / manifest.MANIFEST_FILE).is_file():
        return None
    m = manifest.open(prev, data_fingerprint=data_fingerprint)
    return m.table, m.sample_ids


def pack_epochs(*, plan: Plan | str | Path, epochs, out: str | Path, config: PackConfig | None = None,
                data: str | Path | None = None, lengths: str | Path | None = None,
                overwrite: bool = False, progress: bool = False, **options) -> list[Path]:
    """Pack and write ``out/epoch-000N`` for every N in ``epochs``; returns the folders.

    The options are ``config``, or its fields as keywords (``world_size=4, layout="varlen"``).
    ``progress`` reports each epoch (:mod:`dflash_prep.progress`: a bar, or log lines off a terminal).
    An epoch folder that already holds the same inputs (plan, options, epoch: its
    ``inputs_fingerprint``) is kept as is, so a trainer can call this for a missing epoch
    on the fly. One built from other inputs is replaced only with ``overwrite``. The
    resolved config is written to ``out/pack_config.json`` (:mod:`dflash_prep.pack.config`).

    The whole call holds the root's advisory lock (:func:`dflash_prep.formats.outputs.lock`), so a
    second writer fails clearly instead of mixing epochs; the root records its run in
    ``root.json`` (:func:`dflash_prep.formats.manifest.prepare_root`); a folder under the root
    that holds no ``manifest.json`` is never replaced.
    """
    plan_path = None
    if not isinstance(plan, Plan):
        plan_path = plan
        plan = load_plan(plan)
    elif not plan.fingerprint:                    # a Plan built in code, never saved
        plan = plan.with_fingerprint()
    if config is not None and options:
        raise ConfigError(f"pass a PackConfig or its fields, not both (got config and {sorted(options)})")
    try:
        cfg = config or PackConfig(**options)
    except TypeError as e:
        raise ConfigError(f"pack_epochs: {e}") from None
    epochs = [int(e) for e in epochs]
    bad = [e for e in epochs if e < 0]
    if bad or not epochs:
        raise ConfigError(f"epochs must be >= 0 and at least one is needed, got {epochs}")
    src = resolve_lengths(plan, data=data, lengths=lengths)
    lens = np.asarray(src.lengths)
    out = outputs.check_out(out, inputs=[src.path] + ([plan_path] if plan_path else []))
    with outputs.lock(out, inside=True):
        run_fp = manifest.prepare_root(out, run_identity(plan, cfg), overwrite=overwrite)
        return _pack_into(out, run_fp, plan, cfg, src, lens, epochs, overwrite, show=progress)


def _pack_into(out: Path, run_fp: str, plan: Plan, cfg: PackConfig, src, lens, epochs, overwrite: bool,
               show: bool = False) -> list[Path]:
    with progress("pack", total=len(set(epochs)), unit="epochs", enabled=show) as bar:
        return _pack_loop(out, run_fp, plan, cfg, src, lens, epochs, overwrite, bar)


def _pack_loop(out, run_fp, plan, cfg, src, lens, epochs, overwrite, bar) -> list[Path]:
    committed = False
    edges = batch_stats.class_edges(lens)
    counts, dataset = objectives.get(cfg.objective).inputs(cfg, src)
    written, prev = [], None
    for e in sorted(set(epochs)):
        path = manifest.epoch_dir(out, e)
        fp = inputs_fingerprint(plan, cfg, e)
        if path.exists() and not holds_marker(path, manifest.MANIFEST_FILE, manifest.MANIFEST_FORMAT):
            raise ConfigError(f"{path} exists but holds no {manifest.MANIFEST_FILE}, so it is not a manifest; it was left "
                              "untouched. Move it away or choose another --out")
        if (path / manifest.MANIFEST_FILE).is_file():
            try:
                same = manifest.read_header(path).get("inputs_fingerprint") == fp
            except FormatError:
                same = False
            if same:
                written.append(path)
                prev = None
                bar.advance()
                continue
            if not overwrite:
                raise ConfigError(f"{path} already holds a manifest built from other inputs (plan, options or data); "
                                  "pass --overwrite to replace it, or --out another folder")
        res = build_epoch(lens, plan, cfg, e, edges, mask_counts=counts, dataset=dataset)
        if not committed:  # only now, so a pack that fails earlier leaves the root as it was
            manifest.commit_root(out, run_identity(plan, cfg))
            committed = True
        before = prev if prev is not None else previous_epoch(out, e, src.fingerprint)
        if before is not None:
            res.header["summary"]["repeat_pair_rate"] = repeat_pair_rate(
                before[0], before[1], res.arrays["microbatches"], res.arrays["sample_ids"], len(lens))
            res.header["summary"]["repeat_pair_against"] = e - 1
        res.header["run_fingerprint"] = run_fp
        # recorded relative to the epoch folder, so the tree can move and any cwd works
        res.header["data"].update(kind=src.kind, path=os.path.relpath(Path(src.path).resolve(), path.resolve()))
        manifest.write(path, res.header, res.arrays, overwrite=True)
        written.append(path)
        prev = (res.arrays["microbatches"], res.arrays["sample_ids"])
        del res
        bar.advance()
    pack_config.save(out, cfg, plan)
    return written


def parse_epochs(epoch: int | None, epochs: str | None) -> list[int]:
    """``--epoch N`` or ``--epochs 0-9`` / ``0,2,5`` -> a list of epochs (each >= 0)."""
    if (epoch is None) == (epochs is None):
        raise ConfigError("give exactly one of --epoch N or --epochs A-B")
    if epoch is not None:
        out = [int(epoch)]
    else:
        out = []
        for part in epochs.split(","):
            a, sep, b = part.strip().partition("-")
            try:
                first, last = int(a), int(b) if sep else int(a)
            except ValueError:
                raise ConfigError(f"--epochs {epochs!r}: write a range like 0-9 or a list like 0,2,5") from None
            check_seed(last, "--epoch")  # before the range is built
            out += list(range(first, last + 1))
    if not out or min(out) < 0:
        raise ConfigError(f"epochs must be >= 0, got {epoch if epoch is not None else epochs}")
    check_seed(max(out), "--epoch")  # before any work: an epoch beyond 64 bits would repeat another
    return out


def budget_override(base: Budget, unit: str | None, value: float | None, model_dim: int | None) -> Budget | None:
    """The plan's budget with the given fields replaced, or None when nothing is given."""
    if unit is None and value is None and model_dim is None:
        return None
    return replace(base, **{k: v for k, v in (("unit", unit), ("value", value), ("model_dim", model_dim)) if v is not None})


#: The repeat-pair limit of plans that record none (analyze's --max-repeat-pair default).
REPEAT_PAIR_WARN = MAX_REPEAT_PAIR


def summary_warnings(name: str, summary: dict, limit: float = REPEAT_PAIR_WARN) -> list[str]:
    """Plain-language warnings about an epoch's summary (printed by ``dflash-prep pack``);
    ``limit`` is the plan's repeat-pair limit (``plan.predicted["max_repeat_pair"]``)."""
    out = []
    rp = summary.get("repeat_pair_rate")
    if rp is not None and rp > limit:
        out.append(f"{name}: {rp:.1%} of the pairs co-batched in the previous epoch meet again (repeat-pair rate), "
                   f"above the plan's limit of {limit:.1%}: fewer than {1 - limit:.0%} of pairs are new this epoch. "
                   "The sort window covers much of each bucket for this dataset: lower --window, or re-run "
                   "analyze without --window (it then picks K and window within --max-repeat-pair)")
    trained, dv = summary.get("trained_ids"), summary.get("draft_vocab_size")     # an eagle3 epoch's map
    if trained is not None and dv is not None and trained < dv:
        out.append(f"{name}: only {trained} token ids are ever trained on, fewer than the draft vocabulary of {dv}; "
                   f"its other {dv - trained} ids are the lowest never-trained ones, dead rows of the draft head. "
                   f"Pass --draft-vocab-size {trained} or less, or pack more data")
    pred, eff = summary.get("predicted_efficiency"), summary.get("efficiency")
    if pred is not None and eff is not None and abs(eff - pred) > 0.005:
        out.append(f"{name}: efficiency {eff:.4f} differs from analyze's prediction {pred:.4f} by more than 0.5 pp")
    return out
