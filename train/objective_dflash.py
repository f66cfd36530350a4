"""The DFlash objective: anchors -> blocks -> drafter -> weighted block CE (docs/definitions.md "Drafter training").

Per micro-batch (documents packed back to back, ids ``x``, loss mask ``lm``):

1. **Anchors** of each document: ``dflash_prep.anchors.sample_anchors_batch`` keyed by
   (anchor seed, epoch, sample id), cap ``max_anchors``, policy ``cap``/``density``: sorted
   eligible positions (``lm[a] = lm[a+1] = 1``), the same whatever else shares the batch.
2. **Blocks**: block j is ``[x[a_j], MASK x (B-1)]`` at positions ``a_j .. a_j+B-1``; slot
   ``r = 1..B-1`` predicts ``x[a_j + r]`` (same position, no shift) with weight
   ``w = exp(-(r-1)/gamma) * lm[a_j+r]`` (0 past the document's end); slot 0 has no loss.
3. **Forward**: the frozen target's taps over the packed documents (one forward, document-
   causal) are the context; the target's frozen ``embed_tokens`` embeds the blocks; the
   drafter maps them to hidden states; the target's frozen ``lm_head`` and CE run in chunks
   over the rows with ``w > 0`` only (:func:`dflash_prep.train.chunked_ce.weighted_ce`).
4. **Loss** = ``sum w * CE / sum w`` where ``sum w`` is over the whole optimizer step (all
   ranks, all accumulation micro-batches): the trainer all-reduces :attr:`DFlashBatch.weight_sum`
   before any backward, exactly as the LM objective does with its target count.

**gamma rule**: ``gamma = (B - 2) / 2`` (7 at B = 16, 3 at B = 8), i.e. the last slot always
weighs ``e^-2`` of the first; B = 2 has one slot, weight 1. ``--gamma`` overrides it.

**Metrics** (sums, all-reduced over the step): per-slot accuracy ``correct_r / valid_r`` over
slots with ``w > 0``; expected acceptance length ``tau = 1 + sum_r prod_{i<=r} correct_i`` per
block (a slot without a target, masked or past the end, counts as a miss), averaged over
blocks; anchors (= blocks) and target tokens for the throughput figures.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dflash_prep.anchors import SAMPLER_VERSION, sample_anchors_batch
from dflash_prep.errors import FormatError

from .chunked_ce import weighted_ce
from .data import _read


def default_gamma(block_size: int) -> float:
    """The documented rule: ``(B - 2) / 2`` (7 at B = 16), at least 0.5 (B = 2: one slot, unused)."""
    return max(0.5, (int(block_size) - 2) / 2.0)


def slot_weights(block_size: int, gamma: float) -> np.ndarray:
    """``[B]`` float32: 0 for slot 0, ``exp(-(r-1)/gamma)`` for r >= 1."""
    r = np.arange(block_size, dtype=np.float64)
    w = np.exp(-(r - 1.0) / float(gamma))
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
class DFlashBatch:
    """One micro-batch for the DFlash objective (CPU tensors; ``to`` moves them).

    Documents: ``input_ids``/``position_ids`` ``[T]`` int64 (positions restart per document),
    ``cu_seqlens`` int32 ``[D + 1]``. Blocks: ``anchors`` int32 ``[N]`` (within-document
    positions), ``cu_blk`` int32 ``[D + 1]`` (multiples of B), ``noise_ids``/``blk_pos``/
    ``targets`` int64 ``[N * B]``, ``weights`` float32 ``[N * B]`` (the loss weights, 0 on slot 0).
    ``weight_sum`` is the float64 sum of ``weights``, the micro-batch's share of the normaliser.
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

    def to(self, device: torch.device) -> "DFlashBatch":
        kw = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
              for k, v in self.__dict__.items()}
        return DFlashBatch(**kw)


def build_dflash_batch(ds, mb, *, epoch: int, spec: AnchorSpec, gamma: float, mask_token_id: int,
                       vocab_size: int, pin: bool = False) -> DFlashBatch:
    """Documents, anchors and blocks of one manifest micro-batch (any layout: documents are packed)."""
    sids = np.asarray(mb.sample_ids, np.int64)
    where = f"epoch {epoch} step {mb.step} rank {mb.rank} accum {mb.accum}"
    if sids.shape[0] == 0:
        raise FormatError(f"{where}: empty micro-batch; the manifest is corrupt, re-run `dflash-prep pack`")
    samples = [_read(ds, s, None, where) for s in sids]
    lens = np.fromiter((a.shape[0] for a, _ in samples), np.int64, len(samples))
    T = int(lens.sum())
    if T > np.iinfo(np.int32).max:
        raise FormatError(f"{where}: {T} tokens overflow int32 cu_seqlens; lower the pack budget")
    ids = np.concatenate([a for a, _ in samples]).astype(np.int64)      # (T,)
    mask = np.concatenate([m for _, m in samples]).astype(np.uint8)     # (T,)
    if ids.size and (ids.max() >= vocab_size or ids.min() < 0):
        raise FormatError(f"{where}: token id {int(ids.max())} is outside the target's vocabulary ({vocab_size}); "
                          "the dataset was tokenized with another tokenizer: re-tokenize with the target's")
    if np.any(ids == mask_token_id):
        raise FormatError(f"{where}: the mask token id {mask_token_id} occurs in the data; pass a "
                          "--mask-token-id that never occurs (an unused embedding row)")
    cu = np.zeros(len(samples) + 1, np.int64)
    np.cumsum(lens, out=cu[1:])
    pos = np.arange(T, dtype=np.int64) - np.repeat(cu[:-1], lens)      # (T,) restarts per document
    anc, off = sample_anchors_batch(mask, cu, sids, seed=spec.seed, epoch=epoch, max_anchors=spec.max_anchors,
                                    policy=spec.policy, block_size=spec.block_size)
    B = spec.block_size
    N = int(anc.shape[0])
    doc = np.repeat(np.arange(len(samples)), np.diff(off))              # (N,) document of each block
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
                       weight_sum=float(w.astype(np.float64).sum()), real_tokens=T, padded_tokens=T, n_anchors=N, **t)


def stats_width(block_size: int) -> int:
    """Length of the per-step stats vector: loss, blocks, tau sum, then correct/valid per slot."""
    return 3 + 2 * (block_size - 1)


def dflash_loss(drafter, target, b: DFlashBatch, *, block_size: int, ce_chunk: int,
                autocast) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum w * CE, stats)`` for one micro-batch: stats float64 ``[stats_width(B)]`` (no grad)."""
    B = block_size
    with autocast():
        feats = target.features(b.input_ids, b.position_ids, b.cu_seqlens, b.max_seqlen)  # (T, k*H), no grad
        with torch.no_grad():
            noise = target.embed_tokens(b.noise_ids)                                        # (Q, H)
        hid = drafter(noise, feats, b.position_ids, b.blk_pos, b.cu_seqlens, b.cu_blk, b.anchors, B)  # (Q, H)
        sel = torch.nonzero(b.weights > 0).squeeze(1)                                       # rows with a loss
        loss, pred = weighted_ce(hid.index_select(0, sel), target.lm_head.weight, b.targets.index_select(0, sel),
                                 b.weights.index_select(0, sel), chunk=ce_chunk)
    N = b.n_anchors
    correct = torch.zeros(N * B, dtype=torch.float64, device=hid.device)
    correct[sel] = (pred == b.targets.index_select(0, sel)).double()
    valid = (b.weights > 0).double().view(N, B)[:, 1:]                                      # (N, B-1)
    correct = correct.view(N, B)[:, 1:]                                                     # (N, B-1)
    tau = (1.0 + torch.cumprod(correct, dim=1).sum(dim=1)).sum() if N else correct.new_zeros(())
    stats = torch.cat([torch.stack([loss.detach().double(), correct.new_tensor(float(N)), tau]),
                       correct.sum(0), valid.sum(0)])
    return loss, stats


def summarize_stats(stats: torch.Tensor, denom: float, block_size: int) -> dict:
    """Per-step metrics from the all-reduced stats vector."""
    s = stats.tolist()
    n = block_size - 1
    corr, valid = s[3:3 + n], s[3 + n:3 + 2 * n]
    return {"loss": s[0] / denom if denom > 0 else float("nan"), "anchors": int(s[1]),
            "tau": s[2] / s[1] if s[1] else float("nan"),
            "slot_acc": [c / v if v else None for c, v in zip(corr, valid)],
            "acc": sum(corr) / sum(valid) if sum(valid) else float("nan")}


def step_flops(target_params_tapped: int, drafter_params: int, lm_head_params: int, b: DFlashBatch,
               heads: int, head_dim: int, num_layers: int, block_size: int, *, window: int = 0) -> float:
    """Model FLOPs of one micro-batch (docs/definitions.md "Drafter step cost"): target forward
    ``2 P_t T``; drafter ``6 P_d N B`` plus attention ``3 * 4 Hq D B (min(a_j, W) + B)`` per block
    and layer (``a_j`` when the window W is 0); LM head ``4 n H V`` (forward + input gradient; the head is frozen) over the ``n``
    rows with a loss."""
    B = block_size
    n_rows = int((b.weights > 0).sum())
    seen = b.anchors.double() if window == 0 else b.anchors.double().clamp(max=float(window))
    attn = 3.0 * 4.0 * heads * head_dim * B * float((seen + B).sum()) * num_layers
    return 2.0 * target_params_tapped * b.real_tokens + 6.0 * drafter_params * b.n_anchors * B + attn \
        + 4.0 * n_rows * lm_head_params


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of the GPU model, for MFU; None when unknown (or on CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in (("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("L40", 181e12), ("A10", 125e12)):
        if key in name:
            return peak
    return None

