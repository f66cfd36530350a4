"""``dflash-prep verify``: full checks of a manifest epoch or a tokenized dataset.

:func:`verify_epoch` recomputes an epoch from its arrays and the lengths (coverage, budget,
layout, the summary metrics) and names, in its result's ``unchecked``, each summary field it
cannot recompute and why (:data:`NOT_RECOMPUTED`; the repeat-pair rate when the epoch it was
measured against is gone). Over a root, every ``epoch-*`` entry must be an epoch folder with
its manifest (:func:`dflash_prep.formats.manifest.find_epochs` ``strict``). :func:`verify_dataset`
re-hashes every shard against its ``sha256`` in ``meta.json`` and checks the token ids against the vocabulary and the loss
mask values, on top of the cheap checks of :func:`dflash_prep.formats.dataset.open_dataset`. Both
raise :class:`FormatError` / :class:`FingerprintMismatch` naming the file and the fix.
:func:`verify_path` picks by what the folder holds (a states cache: :func:`dflash_prep.formats.states.verify_states`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dflash_prep import objectives
from dflash_prep.errors import FingerprintMismatch, FormatError
from dflash_prep.formats import lengths as lengths_mod
from dflash_prep.formats import states
from dflash_prep.formats.dataset import META_FILE, open_dataset
from dflash_prep.formats.fileio import fingerprint_file
from dflash_prep.formats.manifest import (COL, MANIFEST_FILE, Manifest, data_path, epoch_dir, find_epochs,  # noqa: A004
                                          open)
from dflash_prep.pack import batch_stats, metrics
from dflash_prep.pack.repack import consumed_ids


# ----------------------------------------------------------------------------- manifests
def _summary_metrics(m: Manifest, lens: np.ndarray, order: np.ndarray, offsets: np.ndarray, seg: np.ndarray,
                     obj, state) -> dict:
    """Every summary metric, recomputed from scratch with :mod:`dflash_prep.pack.metrics`.

    ``order``/``offsets`` are the segments in file order; ``seg`` maps them to table rows.
    Rank imbalance is priced on what the objective ``obj`` balanced ranks on (``state``: what
    its :meth:`~dflash_prep.objectives.base.DataObjective.verify` returned)."""
    t = np.asarray(m.table)[seg]
    varlen = m.layout == "varlen"
    b = m.header["budget"]
    cost = obj.verify_rank_cost(m, lens, order, offsets, state)
    eff = 1.0 if varlen else metrics.efficiency(lens, order, offsets)
    real, sq = t[:, COL["real_tokens"]], t[:, COL["sum_sq_len"]]    # checked against the lengths by the caller
    edges = batch_stats.class_edges(lens)             # pack's classes (a continuation keeps its parent's, the same)
    out = {"efficiency": eff, "fill": metrics.fill(lens, order, offsets, float(b["value"]), varlen=varlen,
                                                     alpha=float(b["packing_alpha"])),
           "microbatches": int(len(t)), "steps": int(len(t) // (m.world_size * m.grad_accum)),
           "samples": int(len(order)), "dropped_samples": int(len(m.dropped_ids)),
           "real_tokens": int(real.sum()), "padded_tokens": int(t[:, COL["padded_tokens"]].sum()),
           "sum_sq_len_max": int(sq.max()) if len(t) else 0, "sum_sq_len_mean": float(sq.mean()) if len(t) else 0.0,
           "step_mix": metrics.step_mix(lens, order, offsets, t[:, COL["step"]], edges=edges),
           "rank_imbalance": metrics.rank_imbalance(cost, t[:, COL["step"]], t[:, COL["rank"]], m.world_size),
           "rank_imbalance_alpha": float(b["cost_alpha"]),
           "rank_imbalance_cost": obj.rank_cost_name}
    out["class_edges"] = [int(e) for e in edges]
    return out


#: Summary fields verify cannot recompute from an epoch's arrays and lengths, and why.
NOT_RECOMPUTED = {
    "predicted_efficiency": "analyze's prediction, copied from the plan (the manifest holds only the plan's "
                            "fingerprint); compare it with plan.json",
    "split_microbatches": "how many micro-batches pack split in two to complete the last step: the arrays hold "
                          "the result, not the splits; re-pack the epoch and compare to check it",
    "dropped_microbatches": "how many micro-batches --drop-last left out: dropped_ids.npy lists their samples, "
                            "not their grouping",
}


def verify_epoch(path: str | Path, *, data: str | Path | None = None, lengths: str | Path | None = None,
                 plan_fingerprint: str | None = None) -> dict:
    """Recompute an epoch from its arrays and the lengths; raise on any violation.

    Checks, in order: everything :func:`dflash_prep.formats.manifest.open` checks (format and
    version, epoch fingerprint, root run, every array's SHA-256, header against arrays:
    corrupt, truncated, edited or swapped files); the data fingerprint (the lengths are found by the path
    the manifest records, or ``data`` / ``lengths``); exactly-once coverage of every
    sample id apart from the listed drops; stored lengths, maxima and token counts; the
    budget and ``max_batch_size``; the step/rank/accum layout with equal counts per rank;
    ``cu_seqlens``; and every summary field against its recomputation
    (:mod:`dflash_prep.pack.metrics`, the columns, the budget; the repeat-pair rate against the
    previous epoch when it is beside this one, and none for epoch 0). Returns the recomputed
    metrics, with ``unchecked``: each summary field it could not recompute, and why; raises
    :class:`FormatError` / :class:`FingerprintMismatch` listing problems.
    """
    path = Path(path)
    m = open(path, plan_fingerprint=plan_fingerprint)
    if data is None and lengths is None:
        where = data_path(path, m.header)
        data, lengths = (where, None) if m.header["data"].get("kind") == "dataset" else (None, where)
    src = lengths_mod.load(data=data, lengths_file=lengths)
    if src.fingerprint != m.data_fingerprint:
        raise FingerprintMismatch(f"{path}: packed for data {m.data_fingerprint}, but {src.path} has fingerprint "
                                  f"{src.fingerprint}; pass the right --data/--lengths or re-pack for this data")
    lens = np.asarray(src.lengths, np.int64)
    t = np.asarray(m.table)
    ids = np.asarray(m.sample_ids)
    # metrics run over the segments in file order: ``seg`` sorts the rows by start
    seg = np.argsort(t[:, COL["start"]], kind="stable")
    count = t[seg, COL["count"]]
    offsets = np.concatenate([[0], np.cumsum(count)]).astype(np.int64)
    problems = []
    if (count < 1).any() or not np.array_equal(t[seg, COL["start"]], offsets[:-1]) or offsets[-1] != len(ids):
        raise FormatError(f"{path}: micro-batch start/count columns do not tile sample_ids; re-pack the epoch")
    if len(ids) and (ids.min() < 0 or ids.max() >= len(lens)):
        raise FormatError(f"{path}: sample ids outside 0..{len(lens) - 1}; the manifest belongs to other data")

    # a continuation (pack --resume-from-step) covers the epoch with its parent
    seen = np.bincount(np.concatenate([ids, m.dropped_ids, consumed_ids(m)]), minlength=len(lens))
    if (seen != 1).any():
        miss, dup = np.flatnonzero(seen == 0), np.flatnonzero(seen > 1)
        problems.append(f"{len(miss)} samples missing (e.g. {miss[:5].tolist()}) and {len(dup)} appear more than once "
                        f"(e.g. {dup[:5].tolist()})")
    if not np.array_equal(np.asarray(m.sample_lens, np.int64), lens[ids]):
        problems.append("sample_lens.npy does not match the dataset's lengths")
    counts, real, mx = metrics.batch_stats(lens, ids, offsets)
    varlen = m.layout == "varlen"
    padded = real if varlen else counts * mx
    sq = np.add.reduceat(lens[ids] ** 2, offsets[:-1]) if len(ids) else np.zeros(0, np.int64)
    for col, want in (("max_len", mx), ("real_tokens", real), ("padded_tokens", padded), ("sum_sq_len", sq)):
        if not np.array_equal(t[seg, COL[col]], want):
            problems.append(f"column {col} disagrees with the lengths in {int((t[seg, COL[col]] != want).sum())} micro-batches")
    b = m.header["budget"]
    used = metrics.batch_cost(lens, ids, offsets, float(b["packing_alpha"]), varlen=varlen)
    over = np.flatnonzero(used > float(b["value"]) * (1 + 1e-12))
    if len(over):
        problems.append(f"{len(over)} micro-batches exceed the budget {b['value']} {b['unit']} (e.g. row {over[0]}: "
                        f"{used[over[0]]:.1f})")
    if b.get("max_batch_size") and (count > int(b["max_batch_size"])).any():
        problems.append(f"micro-batches exceed max_batch_size {b['max_batch_size']}")
    s = m.world_size * m.grad_accum
    pos = np.arange(len(t), dtype=np.int64)
    if len(t) % s or len(t) // s != m.num_steps:
        problems.append(f"{len(t)} micro-batches do not make {m.num_steps} whole steps of {s}")
    elif not (np.array_equal(t[:, COL["step"]], pos // s) and np.array_equal(t[:, COL["rank"]], pos % s // m.grad_accum)
              and np.array_equal(t[:, COL["accum"]], pos % m.grad_accum)):
        problems.append("step/rank/accum columns break the layout (step, then rank, then accum): ranks get unequal counts")
    if varlen and not np.array_equal(np.asarray(m.arrays["cu_seqlens"]), np.concatenate([[0], np.cumsum(lens[ids])])):
        problems.append("cu_seqlens.npy is not the prefix sum of the sample lengths")
    obj, extra, state = objectives.of_header(m.header), {}, None
    if not problems:                                # the objective's own checks (dflash: every anchor)
        problems, extra, state = obj.verify(m, lens, ids, offsets, src)
    if problems:
        raise FormatError(f"{path}: verify failed: " + "; ".join(problems))
    got = _summary_metrics(m, lens, ids, offsets, seg, obj, state) | extra
    return _check_summary(path, m, got, lens, ids, offsets)


def _check_summary(path: Path, m: Manifest, got: dict, lens, ids, offsets) -> dict:
    """Compare every summary field with ``got`` (plus the repeat-pair rate against the epoch
    before); raise on a difference. Returns ``got`` with ``unchecked``: each summary field
    that could not be recomputed, with the reason (:data:`NOT_RECOMPUTED`)."""
    summ = m.summary
    unchecked = {k: why for k, why in NOT_RECOMPUTED.items() if k in summ}
    if "dropped_microbatches" in summ and not len(m.dropped_ids):
        got["dropped_microbatches"] = 0                              # nothing dropped: no micro-batch either
        unchecked.pop("dropped_microbatches")
    if m.epoch == 0 or "resume" in m.header:                         # no epoch before it to compare with
        got["repeat_pair_rate"] = got["repeat_pair_against"] = None
    else:
        prev, rate = epoch_dir(path.parent, m.epoch - 1), summ.get("repeat_pair_rate")
        got["repeat_pair_against"] = None if rate is None else m.epoch - 1
        if rate is None:
            unchecked["repeat_pair_rate"] = f"the summary records none ({prev.name} was not beside it when it was packed)"
        elif not (prev / MANIFEST_FILE).is_file():
            unchecked["repeat_pair_rate"] = f"{prev.name}, the epoch it was measured against, is not beside this one"
        else:
            p = open(prev, data_fingerprint=m.data_fingerprint)
            p_seg = np.argsort(p.table[:, COL["start"]], kind="stable")
            p_off = np.concatenate([[0], np.cumsum(p.table[p_seg, COL["count"]])]).astype(np.int64)
            got["repeat_pair_rate"] = metrics.repeat_pair_rate(np.asarray(p.sample_ids), p_off, ids, offsets,
                                                               len(lens))
    unchecked |= {k: "not a field this dflash-prep writes" for k in summ if k not in got and k not in unchecked}
    wrong = [f"{k}: summary {summ.get(k)!r} vs recomputed {v!r}" for k, v in got.items() if not _same(summ.get(k), v)]
    if wrong:
        raise FormatError(f"{path}: summary disagrees with the arrays: " + "; ".join(wrong) + ". Re-pack the epoch")
    return got | {"unchecked": unchecked}


def _same(recorded, recomputed) -> bool:
    """A summary value equals its recomputation: numbers to 1e-9 (relative above 1: a mean
    of sums of L^2 summed in another order differs in its last bits), anything else exactly."""
    num = (int, float, np.integer, np.floating)
    if isinstance(recorded, bool) or isinstance(recomputed, bool) or not (
            isinstance(recorded, num) and isinstance(recomputed, num)):
        return recorded == recomputed
    return abs(float(recorded) - float(recomputed)) <= 1e-9 * max(1.0, abs(float(recomputed)))


def verify_dataset(folder: str | Path) -> dict:
    """Re-hash every shard and check token ids and loss-mask values; returns counts."""
    ds = open_dataset(folder)
    vocab = int(ds.meta["tokenizer"]["vocab_size"])
    problems = []
    for sh in ds.meta["shards"]:
        p = ds.folder / sh["file"]
        if fingerprint_file(p) != sh["sha256"]:
            problems.append(f"{p}: contents do not match the sha256 in {META_FILE} (corrupt or edited)")
    if problems:
        raise FormatError("; ".join(problems) + "; re-run `dflash-prep tokenize --overwrite`")
    for first, ids, mask, off in ds.record_batches():
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            bad = int(np.flatnonzero((ids < 0) | (ids >= vocab))[0])
            sid = first + int(np.searchsorted(off, bad, side="right")) - 1
            raise FormatError(f"{ds.shard_of(sid)}: sample {sid} holds token id {int(ids[bad])}, outside the "
                              f"tokenizer's vocabulary of {vocab}; re-run `dflash-prep tokenize --overwrite`")
        if len(mask) and int(mask.max()) > 1:
            raise FormatError(f"{ds.shard_of(first)}: loss_mask values other than 0/1; "
                              "re-run `dflash-prep tokenize --overwrite`")
    return {"samples": len(ds), "shards": len(ds.meta["shards"]), "tokens": int(ds.meta["tokens"]["total"]),
            "fingerprint": ds.fingerprint}


def is_dataset(path: str | Path) -> bool:
    return (Path(path) / META_FILE).is_file() and not (Path(path) / MANIFEST_FILE).is_file()


def verify_path(path: str | Path, *, data=None, lengths=None) -> list[tuple[str, dict]]:
    """``[(name, result)]``: a dataset folder, a states cache (:func:`dflash_prep.formats.states.verify_states`),
    an epoch folder, or every epoch of a root."""
    if states.is_states(path):
        return [(Path(path).name, states.verify_states(path, data=data))]
    if is_dataset(path):
        return [(Path(path).name, verify_dataset(path))]
    return [(d.name, verify_epoch(d, data=data, lengths=lengths)) for d in find_epochs(path, strict=True)]
