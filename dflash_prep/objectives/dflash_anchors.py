"""Anchor positions of a ``pack --objective dflash`` epoch, regenerated from the loss masks.

Pack stores only anchor counts; positions are a pure function of (anchor seed, epoch, sample
id) and the masks. :class:`EpochAnchors` regenerates every position of an epoch in one
sequential pass over the shards (verify, ``--store-anchors``); :func:`microbatch_anchors`
regenerates one micro-batch's, as the trainer does. ``opts`` are the epoch's
:class:`dflash_prep.objectives.dflash.DrafterOptions` (seed, cap, policy, block size).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from dflash_prep.errors import ConfigError
from dflash_prep.objectives import anchors
from dflash_prep.pack.batch_stats import prefix_sum


@nb.njit(cache=True)
def _scatter_rows(pos, poff, rows, off, out):
    # sample i of a batch (its positions pos[poff[i]:poff[i + 1]]) goes to out[off[row]:...]
    # at its manifest entry row = rows[i] (-1: not in this epoch)
    for i in range(rows.shape[0]):
        r = rows[i]
        if r >= 0:
            o = off[r]
            for j in range(poff[i], poff[i + 1]):
                out[o + j - poff[i]] = pos[j]


@nb.njit(cache=True)
def differing_rows(pos, poff, rows, off, stored):
    # how many of a batch's samples have stored positions other than the regenerated ones
    n = 0
    for i in range(rows.shape[0]):
        r = rows[i]
        if r < 0:
            continue
        k = poff[i + 1] - poff[i]
        same = off[r + 1] - off[r] == k
        j = 0
        while same and j < k:
            same = stored[off[r] + j] == pos[poff[i] + j]
            j += 1
        n += 0 if same else 1
    return n


class EpochAnchors:
    """Every anchor of one epoch regenerated from the dataset's masks, one record batch at a
    time in id order (the shards are read once, sequentially, whatever the epoch's order).

    Yields per batch ``(first_id, mask, cu, positions, offsets, S, C)``: the batch's
    concatenated masks, its samples' anchors and the mask counts they were drawn from
    (:func:`anchors.sample_anchors_batch`), every sample of the dataset included. ``rows`` maps a sample id to its ``sample_ids`` entry (-1 when
    the epoch does not hold it) and ``offsets`` are each entry's start in ``anchors.npy``.
    """

    def __init__(self, ds, opts, epoch: int, sample_ids: np.ndarray, counts: np.ndarray):
        self.ds, self.opts, self.epoch = ds, opts, int(epoch)
        ids = np.asarray(sample_ids, np.int64)
        self.rows = np.full(len(ds), -1, np.int64)
        self.rows[ids] = np.arange(len(ids), dtype=np.int64)
        self.offsets = prefix_sum(np.asarray(counts))          # anchors.npy: in sample_ids order

    def __iter__(self):
        for first, _, mask, off in self.ds.record_batches(check=True):
            cu = off.astype(np.int64)
            ids = np.arange(first, first + len(cu) - 1, dtype=np.int64)
            yield (first, mask, cu) + anchors.sample_anchors_batch(
                mask, cu, ids, seed=self.opts.anchor_seed, epoch=self.epoch, max_anchors=self.opts.max_anchors,
                policy=self.opts.anchor_policy, block_size=self.opts.block_size, with_counts=True)


def store_anchors(ds, sample_ids: np.ndarray, opts, epoch: int, counts: np.ndarray) -> np.ndarray:
    """``anchors.npy``: every anchor position, concatenated in ``sample_ids`` order (int32);
    ``counts`` is ``anchor_counts.npy``, checked against the masks' counts."""
    ea = EpochAnchors(ds, opts, epoch, sample_ids, counts)
    out = np.empty(int(ea.offsets[-1]), np.int32)
    for first, _, _, pos, poff, _, _ in ea:
        rows = ea.rows[first:first + len(poff) - 1]
        held = rows >= 0
        if not np.array_equal(np.diff(poff)[held], np.diff(ea.offsets)[rows[held]]):
            raise ConfigError(f"the loss masks of samples {first}..{first + len(rows) - 1} give other anchor counts "
                              "than supervised.npy/anchor_candidates.npy; the dataset folder is inconsistent, re-run "
                              "`dflash-prep tokenize --overwrite`")
        _scatter_rows(pos, poff, rows, ea.offsets, out)
    return out


def microbatch_anchors(header: dict, loss_mask: np.ndarray, cu_seqlens: np.ndarray,
                       sample_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A micro-batch's anchors as the trainer regenerates them: the options, seed and epoch
    come from the epoch's ``manifest.json`` header (``Manifest.header``); ``loss_mask`` holds
    the micro-batch's masks concatenated (varlen). Returns :func:`anchors.sample_anchors_batch`'s
    ``(positions, offsets)``; refuses a manifest packed by another sampler version."""
    d = header.get("dflash")
    if d is None:
        raise ConfigError("this manifest was not packed with --objective dflash: it records no anchor options")
    if int(d.get("sampler_version", -1)) != anchors.SAMPLER_VERSION:
        raise ConfigError(f"manifest packed with anchor sampler v{d.get('sampler_version')}, this dflash-prep has "
                          f"v{anchors.SAMPLER_VERSION}; re-pack the epoch (`dflash-prep pack ... --overwrite`)")
    return anchors.sample_anchors_batch(loss_mask, cu_seqlens, sample_ids, seed=int(d["anchor_seed"]),
                                        epoch=int(header["epoch"]), max_anchors=int(d["max_anchors"]),
                                        policy=d["anchor_policy"], block_size=int(d["block_size"]))
