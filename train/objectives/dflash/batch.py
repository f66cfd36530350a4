"""One DFlash micro-batch as tensors: anchors -> blocks -> weights (docs/dflash.md).

:func:`build_dflash_batch` turns a manifest micro-batch into a :class:`DFlashBatch` (steps 1-2
of :mod:`dflash_prep.train.objectives.dflash.objective`'s docstring); :func:`anchor_spec` says
how the anchors are drawn (a ``pack --objective dflash`` manifest's options win over the flags);
:func:`default_gamma` and :func:`slot_weights` are the decay rule. A split job's target rank
builds the same batches (:mod:`dflash_prep.train.split.worker`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dflash_prep.errors import ConfigError, FormatError
from dflash_prep.objectives import options as opt_decl
from dflash_prep.objectives.anchors import SAMPLER_VERSION, sample_anchors_batch
from dflash_prep.objectives.dflash import DrafterOptions
from dflash_prep.train.data import TensorBatch, read_documents


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


@dataclass(frozen=True)
class AnchorSpec:
    """How anchors are drawn: part of the run contract."""

    seed: int
    max_anchors: int
    policy: str
    block_size: int

    def to_dict(self) -> dict:
        return {"seed": int(self.seed), "max_anchors": int(self.max_anchors), "policy": self.policy,
                "block_size": int(self.block_size), "sampler_version": SAMPLER_VERSION}


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


def anchor_spec(cfg, manifest=None):
    """``(AnchorSpec, where the seed came from)``: a ``pack --objective dflash`` manifest's anchor
    options (its header's ``dflash``) win; a flag that contradicts them is refused, since the
    manifest's anchor budgets and digest assume them. Otherwise the flags, with the defaults of
    :class:`dflash_prep.objectives.dflash.DrafterOptions` (pack's), and ``--anchor-seed``
    or else ``--seed``."""
    header = getattr(manifest, "header", None) if manifest is not None else None
    d = header.get("dflash") if isinstance(header, dict) else None
    mine = cfg.options
    if d is None:
        seed = cfg.seed if mine.anchor_seed is None else mine.anchor_seed
        where = "--seed (the manifests are not pack --objective dflash)" if mine.anchor_seed is None else "--anchor-seed"
        o = DrafterOptions()                    # the pack defaults: one source
        return AnchorSpec(seed=seed, max_anchors=mine.max_anchors or o.max_anchors,
                          policy=mine.anchor_policy or o.anchor_policy,
                          block_size=mine.block_size or mine.default_block_size), where
    if int(d.get("sampler_version", -1)) != SAMPLER_VERSION:
        raise ConfigError(f"manifest epoch {manifest.epoch} was packed with anchor sampler v{d.get('sampler_version')}, "
                          f"this trainer draws with v{SAMPLER_VERSION}; re-pack it (`dflash-prep pack ... --overwrite`)")
    o = opt_decl.from_header(DrafterOptions, d)
    for flag, want, theirs in (("--block-size", mine.block_size, o.block_size),
                               ("--max-anchors", mine.max_anchors, o.max_anchors),
                               ("--anchor-policy", mine.anchor_policy, o.anchor_policy),
                               ("--anchor-seed", mine.anchor_seed, o.anchor_seed)):
        if want is not None and want != theirs:
            raise ConfigError(f"{flag} {want} contradicts the manifest, packed with {theirs} (pack --objective "
                              f"dflash); drop {flag} or re-pack with it")
    return AnchorSpec(seed=int(o.anchor_seed), max_anchors=o.max_anchors, policy=o.anchor_policy,
                      block_size=o.block_size), "the manifest"
