"""One DFlash micro-batch as tensors: anchors -> blocks -> weights (docs/dflash.md).

:func:`build_dflash_batch` turns a manifest micro-batch into a :class:`DFlashBatch` (steps 1-2
of :mod:`dflash_prep.train.objectives.dflash.objective`'s docstring), its anchors drawn as an
:class:`~.options.AnchorSpec` says (:func:`~.options.anchor_spec`: the anchor options are declared
in :mod:`.options`); :func:`default_gamma` and :func:`slot_weights` are the decay rule. A split job's target rank
builds the same batches (:mod:`dflash_prep.train.split.worker`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dflash_prep.errors import FormatError
from dflash_prep.objectives.anchors import sample_anchors_batch
from dflash_prep.train.data import TensorBatch, read_documents
from dflash_prep.train.objectives.dflash.options import AnchorSpec, anchor_spec

__all__ = ["AnchorSpec", "DFlashBatch", "anchor_spec", "build_dflash_batch", "default_gamma", "slot_weights"]


def default_gamma(block_size: int) -> float:
    """The documented rule: ``(B - 2) / 2`` (7 at B = 16), at least 0.5 (B = 2: one slot, unused)."""
    return max(0.5, (int(block_size) - 2) / 2.0)


def slot_weights(block_size: int, gamma: float | None) -> np.ndarray:
    """``[B]`` float32: 0 for slot 0, ``exp(-(r-1)/gamma)`` for r >= 1 (1 when ``gamma`` is None:
    D-PACE, whose weights come from the forward, keeps only the loss mask here)."""
    r = np.arange(block_size, dtype=np.float64)
    w = np.ones(block_size) if gamma is None else np.exp(-(r - 1.0) / float(gamma))
    w[0] = 0.0
    return w.astype(np.float32)


@dataclass
class DFlashBatch(TensorBatch):
    """One micro-batch for the DFlash objective (CPU tensors; ``to`` moves them).

    Documents: ``input_ids``/``position_ids`` ``[T]`` int64 (positions restart per document),
    ``cu_seqlens`` int32 ``[D + 1]``. Blocks: ``anchors`` int32 ``[N]`` (within-document
    positions), ``cu_blk`` int32 ``[D + 1]`` (multiples of B), ``noise_ids``/``blk_pos``/
    ``targets`` int64 ``[N * B]``, ``weights`` float32 ``[N * B]`` (the loss weights, 0 on slot 0;
    under D-PACE the loss mask, the weights coming from the forward).
    ``weight_sum`` is the float64 sum of ``weights``, the micro-batch's share of the normaliser
    (under D-PACE the forward's ``sum w`` replaces it: the last entry of the stats vector).
    """

    step: int
    accum: int
    sample_ids: np.ndarray
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    anchors: torch.Tensor
    cu_blk: torch.Tensor
    noise_ids: torch.Tensor
    blk_pos: torch.Tensor
    targets: torch.Tensor
    weights: torch.Tensor
    weight_sum: float
    real_tokens: int
    padded_tokens: int
    n_anchors: int
    epoch: int = 0
    """The manifest epoch (the taps message's tag, :mod:`dflash_prep.train.split.taps`)."""
    states: tuple | None = None
    """The target's states read ahead from a states cache (train/cached_taps.py), else None."""


def build_dflash_batch(ds, mb, *, epoch: int, spec: AnchorSpec, gamma: float | None, mask_token_id: int,
                       vocab_size: int, pin: bool = False) -> DFlashBatch:
    """Documents, anchors and blocks of one manifest micro-batch (any layout: documents are packed)."""
    docs = read_documents(ds, mb, epoch=epoch, vocab_size=vocab_size)
    sids, ids, mask, lens, cu, pos = docs.sids, docs.ids, docs.mask, docs.lens, docs.cu, docs.pos
    T = int(ids.shape[0])
    if np.any(ids == mask_token_id):
        raise FormatError(f"{docs.where}: the mask token id {mask_token_id} occurs in the data; pass a "
                          "--mask-token-id that never occurs (an unused embedding row)")
    anc, off = sample_anchors_batch(mask, cu, sids, seed=spec.seed, epoch=epoch, max_anchors=spec.max_anchors,
                                    policy=spec.policy, block_size=spec.block_size)
    B = spec.block_size
    N = int(anc.shape[0])
    doc = np.repeat(np.arange(len(lens)), np.diff(off))                 # (N,) document of each block
    r = np.arange(B, dtype=np.int64)
    bpos = anc.astype(np.int64)[:, None] + r[None, :]                   # (N, B) in-document positions
    inside = bpos < lens[doc][:, None]                                   # (N, B)
    gidx = np.where(inside, cu[doc][:, None] + bpos, 0)                  # (N, B) packed index (0 when outside)
    tgt = np.where(inside, ids[gidx], 0)
    lm = np.where(inside, mask[gidx], 0).astype(np.float32)
    w = slot_weights(B, gamma)[None, :] * lm                             # (N, B) float32
    noise = np.full((N, B), mask_token_id, np.int64)
    noise[:, 0] = tgt[:, 0]                                              # slot 0: the anchor token itself
    t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in dict(
        input_ids=ids, position_ids=pos, cu_seqlens=cu.astype(np.int32), anchors=anc.astype(np.int32),
        cu_blk=(off * B).astype(np.int32), noise_ids=noise.reshape(-1), blk_pos=bpos.reshape(-1),
        targets=tgt.reshape(-1), weights=w.reshape(-1)).items()}
    if pin:
        t = {k: v.pin_memory() for k, v in t.items()}
    return DFlashBatch(step=int(mb.step), accum=int(mb.accum), sample_ids=sids, max_seqlen=int(lens.max()),
                       weight_sum=float(w.astype(np.float64).sum()), real_tokens=T, padded_tokens=T, n_anchors=N,
                       epoch=int(epoch), **t)
