"""The DFlash objective: anchors -> blocks -> drafter -> weighted block CE (docs/definitions.md "Drafter training").

Per micro-batch (documents packed back to back, ids ``x``, loss mask ``lm``):

1. **Anchors** of each document: ``dflash_prep.objectives.anchors.sample_anchors_batch`` keyed by
   (anchor seed, epoch, sample id), cap ``max_anchors``, policy ``cap``/``density``: sorted
   eligible positions (``lm[a] = lm[a+1] = 1``), the same whatever else shares the batch.
2. **Blocks**: block j is ``[x[a_j], MASK x (B-1)]`` at positions ``a_j .. a_j+B-1``; slot
   ``r = 1..B-1`` predicts ``x[a_j + r]`` (same position, no shift) with weight
   ``w = exp(-(r-1)/gamma) * lm[a_j+r]`` (``--slot-weights decay``; 0 past the document's end)
   or the D-PACE weight of :func:`dpace_weights` (``dpace``: from the drafter's CE on each
   slot in this forward, no gradient, times the same mask); slot 0 has no loss.
3. **Forward**: the frozen target's taps over the packed documents (one forward, document-
   causal) are the context; the target's frozen ``embed_tokens`` embeds the blocks; the
   drafter maps them to hidden states; the target's frozen ``lm_head`` and the loss run in
   chunks over the rows with a label only (:func:`dflash_prep.train.chunked_ce.weighted_ce`,
   or :func:`dflash_prep.train.chunked_kl.row_losses` for ``dpace`` / ``kl``). The slot loss is
   the CE on the data token (``--loss ce``) or ``KL(target || drafter)`` at ``--kl-temperature``
   (``kl``): slot r of block j learns the target's next-token distribution at ``a_j + r - 1``,
   so the target then runs all its layers (attention needs every position) and its final norm,
   and its head only on the labelled rows, fused into the loss's chunks.
4. **Loss** = ``sum w * loss / sum w`` where ``sum w`` is over the whole optimizer step (all
   ranks, all accumulation micro-batches): the trainer all-reduces :attr:`DFlashBatch.weight_sum`
   before any backward, exactly as the LM objective does with its target count; D-PACE's
   ``sum w`` is known after the forward only, so it is all-reduced then and divides the summed
   gradient (:func:`dflash_prep.train.loop.train_step`): the same update for any split.

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

from dflash_prep.errors import ConfigError, FormatError
from dflash_prep.objectives import drafter_cost, options as opt_decl
from dflash_prep.objectives.anchors import SAMPLER_VERSION, sample_anchors_batch
from dflash_prep.objectives.dflash import DrafterOptions

from .chunked_ce import weighted_ce
from .config import TrainConfig
from .data import TensorBatch, _read


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


def dpace_weights(ce: torch.Tensor, mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE slot weights (arXiv 2605.18810, Eq. 7-8) ``[N, B]`` float32, computed without gradient.

    ``ce [N, B]``: the drafter's cross-entropy on each slot's target token (any value where the
    mask is 0); ``mask [N, B]``: the loss mask (0 on slot 0, on unlabelled slots and past the
    document's end). Per block (row), with ``q_r = exp(-CE_r)``:

        q~_r = (1 - alpha) q_r + alpha      on labelled slots, 1 elsewhere (a no-op in the product)
        C_m  = prod_{i <= m} q~_i           (the product starts at slot 1: slot 0 is never labelled)
        w_r  = mask_r * sum_{m >= r} mask_m C_m

    Not normalised per block: the loss divides by the step's ``sum w``. Masked slots are no-ops
    in the product and left out of the sum, as in the public implementations (speculators
    ``dpace_loss_decay``, Model-Optimizer ``_dpace_position_weights``). ``w`` is
    non-increasing over a block's labelled slots (``w_r - w_{r'} = sum`` of positive ``C_m``).
    """
    if not 0.0 < float(alpha) <= 1.0:
        raise ValueError(f"dpace_weights: alpha must be in (0, 1], got {alpha}")
    with torch.no_grad():
        keep = mask > 0                                                     # (N, B)
        q = (1.0 - alpha) * torch.exp(-ce.detach().float()) + alpha
        q = torch.where(keep, q, torch.ones_like(q))
        c = torch.cumprod(q, dim=1) * keep                                  # (N, B) C_m on labelled slots
        return torch.flip(torch.cumsum(torch.flip(c, (1,)), dim=1), (1,)) * keep


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
    """The manifest epoch (the taps message's tag, :mod:`.taps`)."""


def build_dflash_batch(ds, mb, *, epoch: int, spec: AnchorSpec, gamma: float | None, mask_token_id: int,
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
                       weight_sum=float(w.astype(np.float64).sum()), real_tokens=T, padded_tokens=T, n_anchors=N,
                       epoch=int(epoch), **t)


def stats_width(block_size: int) -> int:
    """Length of the per-step stats vector: loss, blocks, tau sum, correct/valid per slot, sum w."""
    return 4 + 2 * (block_size - 1)


@dataclass(frozen=True)
class LossSpec:
    """What the loss of a block slot is: part of the run contract (module docstring of :mod:`.objectives`)."""

    slot_weights: str = "decay"
    """``decay`` (``exp(-(r-1)/gamma)``, fixed in the batch) or ``dpace`` (:func:`dpace_weights`)."""
    dpace_alpha: float = 0.5
    """D-PACE's smoothing ``alpha``."""
    loss: str = "ce"
    """``ce`` on the data token, or ``kl`` from the target's next-token distribution."""
    kl_temperature: float = 1.0
    """Temperature of both distributions under ``kl``."""


def _teacher_rows(b: "DFlashBatch", block_size: int) -> torch.Tensor:
    """``[N * B]`` int64: the packed index of the target position whose next-token distribution
    slot (j, r) is taught (``a_j + r - 1`` of its document; clamped at 0 for slot 0 of a first anchor)."""
    rows = torch.arange(b.n_anchors * block_size, device=b.blk_pos.device)
    doc = torch.searchsorted(b.cu_blk[1:].to(torch.int64), rows, right=True)    # (N*B,) document of each row
    return (b.cu_seqlens.to(torch.int64)[doc] + b.blk_pos - 1).clamp_min(0)


def dflash_loss(drafter, target, b: DFlashBatch, *, block_size: int, ce_chunk: int, autocast,
                spec: LossSpec = LossSpec()) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum w * loss, stats)`` for one micro-batch: stats float64 ``[stats_width(B)]`` (no grad).

    ``decay`` + ``ce`` runs :func:`~dflash_prep.train.chunked_ce.weighted_ce` with the batch's
    weights; ``dpace`` or ``kl`` run :func:`~dflash_prep.train.chunked_kl.row_losses` and weight
    the rows afterwards (D-PACE from the rows' CE). ``kl`` runs the target to its end
    (``FrozenTarget.features(final=True)``); its head is applied to the labelled rows only.
    ``target`` is a taps provider (:mod:`.taps`: the local target, or the target rank serving
    this drafter) or a :class:`~.target.FrozenTarget`.
    """
    from .chunked_kl import row_losses
    from .taps import provider_of

    target = provider_of(target)

    B = block_size
    N = b.n_anchors
    kl = spec.loss == "kl"
    with autocast():
        got = target.taps(b, epoch=b.epoch, final=kl)                                      # no grad
        feats, last = got if kl else (got, None)                                            # (T, k*H), (T, H)
        with torch.no_grad():
            noise = target.embed_tokens(b.noise_ids)                                        # (Q, H)
        hid = drafter(noise, feats, b.position_ids, b.blk_pos, b.cu_seqlens, b.cu_blk, b.anchors, B)  # (Q, H)
        sel = torch.nonzero(b.weights > 0).squeeze(1)                                       # rows with a loss
        h, tg, w = hid.index_select(0, sel), b.targets.index_select(0, sel), b.weights.index_select(0, sel)
        head = target.lm_head.weight
        if spec.slot_weights == "decay" and not kl:
            loss, pred = weighted_ce(h, head, tg, w, chunk=ce_chunk)
        else:
            teacher = last.index_select(0, _teacher_rows(b, B).index_select(0, sel)) if kl else None
            rl, ce, pred = row_losses(h, head, tg, teacher=teacher, temperature=spec.kl_temperature, chunk=ce_chunk)
            if spec.slot_weights == "dpace":
                full = torch.zeros(N * B, dtype=torch.float32, device=hid.device)
                full[sel] = ce.float()
                w = dpace_weights(full.view(N, B), b.weights.view(N, B), spec.dpace_alpha).view(-1).index_select(0, sel)
            loss = (w.to(rl.dtype) * rl).sum()
    correct = torch.zeros(N * B, dtype=torch.float64, device=hid.device)
    correct[sel] = (pred == tg).double()
    valid = (b.weights > 0).double().view(N, B)[:, 1:]                                      # (N, B-1)
    correct = correct.view(N, B)[:, 1:]                                                     # (N, B-1)
    tau = (1.0 + torch.cumprod(correct, dim=1).sum(dim=1)).sum() if N else correct.new_zeros(())
    stats = torch.cat([torch.stack([loss.detach().double(), correct.new_tensor(float(N)), tau]),
                       correct.sum(0), valid.sum(0), w.detach().double().sum().reshape(1)])
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


def flops_coefficients(c, target_layers: int, loss: str) -> np.ndarray:
    """The cost model's coefficients (:meth:`DrafterCostModel.coefficient_array`) for drafter config
    ``c``: the target forward runs to the last tap (``ce``) or through all ``target_layers``
    (``kl``: the target's distribution needs its final norm)."""
    run = target_layers if loss == "kl" else max(c.target_layer_ids) + 1
    cm = drafter_cost.DrafterCostModel(hidden=c.hidden, layers=run, intermediate=c.intermediate, heads=c.heads,
                                       kv_heads=c.kv_heads, head_dim=c.head_dim, vocab=c.vocab_size,
                                       draft_layers=c.num_layers, sliding_window=c.sliding_window)
    return cm.coefficient_array(c.block_size)


def step_flops(coef: np.ndarray, b: DFlashBatch) -> float:
    """Model FLOPs of one micro-batch: :func:`dflash_prep.objectives.drafter_cost.flops` (the count
    pack balances ranks on) over what ``b`` holds: its tokens and documents, its anchors, the
    context keys its blocks see (``min(a_j, W)``) and its rows with a loss weight."""
    docs = torch.diff(b.cu_seqlens.long()).double()
    seen = b.anchors.double() if coef[5] == 0 else b.anchors.double().clamp(max=float(coef[5]))
    return float(drafter_cost.flops(coef, float(b.real_tokens), float((docs * docs).sum()), float(b.n_anchors),
                                    float(seen.sum()), float(int((b.weights > 0).sum()))))


# ----------------------------------------------------------------------------- the trainer objective
class DFlashObjective:
    """Drafter training on a frozen target (module docstring), behind the loop's objective
    protocol (:mod:`dflash_prep.train.objectives`). The block size is ``anchor_spec``'s: the
    drafter is built for it, and every use reads :attr:`block_size`."""

    name = "dflash"

    def __init__(self, drafter, target, cfg: TrainConfig, *, anchor_spec: AnchorSpec, gamma: float, identity: dict,
                 anchor_source: str = "the options"):
        from .taps import provider_of

        if drafter.config.block_size != anchor_spec.block_size:
            raise ConfigError(f"the drafter is built for B = {drafter.config.block_size}, the anchors are drawn for "
                              f"B = {anchor_spec.block_size}")
        # target: a FrozenTarget or a taps provider (:mod:`.taps`; RemoteTaps on a split job's drafter rank)
        self.model, self.target, self.cfg = drafter, provider_of(target), cfg
        self.spec, self.gamma, self.identity = anchor_spec, float(gamma), identity
        self.anchor_source = anchor_source
        self.loss_spec = LossSpec(slot_weights=cfg.slot_weights, dpace_alpha=float(cfg.dpace_alpha), loss=cfg.loss,
                                  kl_temperature=float(cfg.kl_temperature))
        # D-PACE weights come out of the forward: the loop all-reduces sum w after it (train_step)
        self.deferred_denominator = cfg.slot_weights == "dpace"
        self.stats_width = stats_width(self.block_size)
        self._p_drafter = sum(p.numel() for p in drafter.parameters())
        self._coef = flops_coefficients(drafter.config, self.target.num_layers, cfg.loss)
        self._taus: list[float] = []
        self._anchors = 0

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    def build(self, ds, mb, epoch: int, layout: str, pin: bool):
        c = self.model.config
        gamma = None if self.deferred_denominator else self.gamma
        return build_dflash_batch(ds, mb, epoch=epoch, spec=self.spec, gamma=gamma,
                                  mask_token_id=c.mask_token_id, vocab_size=c.vocab_size, pin=pin)

    @staticmethod
    def denominator(b) -> float:
        return b.weight_sum

    @staticmethod
    def denominator_from(stats: torch.Tensor) -> float:
        """The step's ``sum w`` from the all-reduced stats (its last entry): D-PACE's normaliser."""
        return float(stats[-1])

    @staticmethod
    def targets(denom: float) -> float:
        return denom

    def loss(self, b, autocast):
        return dflash_loss(self.model, self.target, b, block_size=self.block_size, ce_chunk=self.cfg.ce_chunk,
                           autocast=autocast, spec=self.loss_spec)

    def metrics(self, stats: torch.Tensor, denom: float) -> dict:
        return summarize_stats(stats, denom, self.block_size)

    def flops(self, b) -> float:
        return step_flops(self._coef, b)

    def contract(self) -> dict:
        c = self.model.config
        return {"objective": "dflash", **self.identity, "target_layer_ids": list(c.target_layer_ids),
                "mask_token_id": c.mask_token_id, "block_size": self.block_size,
                "sliding_window": c.sliding_window, **self.recipe_fields(),
                "anchors": self.spec.to_dict()}

    def describe(self) -> str:
        """The recipe the run resolved (defaults filled in), one line printed at start."""
        from .optim import muon_lr

        cfg, c, ls = self.cfg, self.model.config, self.loss_spec
        weights = f"dpace alpha={ls.dpace_alpha:g}" if ls.slot_weights == "dpace" else f"decay gamma={self.gamma:g}"
        loss = f"kl T={ls.kl_temperature:g}" if ls.loss == "kl" else "ce"
        opt = f"muon lr={muon_lr(cfg):g} + adamw lr={cfg.lr:g}" if cfg.optimizer == "muon" else f"adamw lr={cfg.lr:g}"
        window = f"window {c.sliding_window}" if c.sliding_window else "full attention"
        return (f"dflash recipe: B={self.block_size}, {c.num_layers} draft layer(s), {window}, slot weights {weights}, "
                f"loss {loss}, optimizer {opt}; target {cfg.target} ({self.target.num_layers} layers), taps "
                f"{list(c.target_layer_ids)}, mask id {c.mask_token_id}, anchors {self.spec.policy}<="
                f"{self.spec.max_anchors} drawn by the library sampler with seed {self.spec.seed} "
                f"(from {self.anchor_source})")

    def recipe_fields(self) -> dict:
        """What the loss is (contract fields; the ones a setting leaves unused are None)."""
        ls = self.loss_spec
        return {"slot_weights": ls.slot_weights, "gamma": self.gamma if ls.slot_weights == "decay" else None,
                "dpace_alpha": ls.dpace_alpha if ls.slot_weights == "dpace" else None, "loss": ls.loss,
                "kl_temperature": ls.kl_temperature if ls.loss == "kl" else None}

    def check_epoch(self, epoch: int, manifest) -> None:
        """Every epoch after the first draws anchors as the first did (its budgets assume them),
        and every epoch's cost model has this drafter's window (:func:`~dflash_prep.objectives.drafter_cost.check_window`)."""
        drafter_cost.check_window(manifest, self.cfg.sliding_window)
        if epoch > 0:
            spec = anchor_spec(self.cfg, manifest)[0]
            if spec != self.spec:
                raise FormatError(f"epoch {epoch} manifest draws anchors with {spec}, epoch 0 "
                                  f"with {self.spec}; pack every epoch with the same drafter options")

    def log_fields(self, st: dict, dt: float) -> dict:
        """tau, accuracies and anchors of a step for its log record; kept for :meth:`run_summary`."""
        rec = {k: st[k] for k in ("tau", "acc", "slot_acc", "anchors") if k in st}
        if self.target.remote:   # where the step's time went between the target rank and this one
            rec.update(self.target.log_fields(st["epoch"], st["step"], dt))
        if not st["skipped"] and "tau" in st:
            self._taus.append(st["tau"])
        if "anchors" in st:
            rec["anchors_per_s"] = st["anchors"] / dt
            self._anchors += st["anchors"]
        return rec

    def run_summary(self, time_s: float) -> dict:
        taus = self._taus
        if not taus:
            return {}
        k = max(1, min(5, len(taus) // 2))
        split = self.target.summary() if self.target.remote else {}
        return split | {"tau_first": sum(taus[:k]) / k, "tau_last": sum(taus[-k:]) / k, "anchors": self._anchors,
                "anchors_per_s": self._anchors / max(time_s, 1e-9)}

    def model_config(self) -> dict:
        return self.model.config.to_dict()

    def num_parameters(self) -> int:
        return self._p_drafter

    def finish(self, out) -> None:
        pass  # `export RUN --out DIR` writes the public format from the checkpoint


def drafter_config(cfg: TrainConfig, manifest=None):
    """``(DrafterConfig, AnchorSpec, where the anchor seed came from, tokenizer)`` of a run: what a
    drafter rank builds and a target rank (:mod:`.target_worker`) needs to build the same batches."""
    from transformers import AutoConfig

    from .drafter import DrafterConfig
    from .target import load_tokenizer, pick_mask_token

    spec, source = anchor_spec(cfg, manifest)
    hc = AutoConfig.from_pretrained(cfg.target)
    tok = load_tokenizer(cfg.target)
    mask_id = pick_mask_token(tok, int(hc.vocab_size), cfg.mask_token_id)
    ids = list(cfg.target_layer_ids) or None
    dcfg = DrafterConfig.from_target_config(hc, cfg.draft_layers, spec.block_size, mask_id, target_layer_ids=ids,
                                            sliding_window=cfg.sliding_window)
    return dcfg, spec, source, tok


def build(cfg: TrainConfig, ds, device: torch.device, manifest=None, place=None) -> DFlashObjective:
    """The drafter for ``cfg.target`` (a transformers folder), with the anchors of ``manifest``;
    on a split job's drafter rank (``place``, :mod:`.split`) its taps come from the target rank."""
    from .drafter import Drafter
    from .target import FrozenTarget, target_identity

    drafter_cost.check_window(manifest, cfg.sliding_window)
    dcfg, spec, source, tok = drafter_config(cfg, manifest)
    if place is None:
        target = FrozenTarget(cfg.target, dcfg.target_layer_ids, device=device)
    else:
        from .taps import remote_taps

        target = remote_taps(place, cfg.target, timeout=cfg.target_timeout, device=device)
    drafter = Drafter(dcfg).to(device)
    gamma = cfg.gamma or default_gamma(spec.block_size)
    return DFlashObjective(drafter, target, cfg, anchor_spec=spec, gamma=gamma,
                           identity=target_identity(cfg.target, tok), anchor_source=source)


def anchor_spec(cfg: TrainConfig, manifest=None):
    """``(AnchorSpec, where the seed came from)``: a ``pack --objective dflash`` manifest's anchor
    options (its header's ``dflash``) win; a flag that contradicts them is refused, since the
    manifest's anchor budgets and digest assume them. Otherwise the flags, with the defaults of
    :class:`dflash_prep.objectives.dflash.DrafterOptions` (pack's), and ``--anchor-seed``
    or else ``--seed``."""
    header = getattr(manifest, "header", None) if manifest is not None else None
    d = header.get("dflash") if isinstance(header, dict) else None
    if d is None:
        seed = cfg.anchor_seed if cfg.anchor_seed >= 0 else cfg.seed
        where = "--anchor-seed" if cfg.anchor_seed >= 0 else "--seed (the manifests are not pack --objective dflash)"
        o = DrafterOptions()                    # the pack defaults: one source
        return AnchorSpec(seed=seed, max_anchors=cfg.max_anchors or o.max_anchors,
                          policy=cfg.anchor_policy or o.anchor_policy, block_size=cfg.block_size or o.block_size), where
    if int(d.get("sampler_version", -1)) != SAMPLER_VERSION:
        raise ConfigError(f"manifest epoch {manifest.epoch} was packed with anchor sampler v{d.get('sampler_version')}, "
                          f"this trainer draws with v{SAMPLER_VERSION}; re-pack it (`dflash-prep pack ... --overwrite`)")
    o = opt_decl.from_header(DrafterOptions, d)
    for flag, mine, theirs in (("--block-size", cfg.block_size, o.block_size),
                               ("--max-anchors", cfg.max_anchors, o.max_anchors),
                               ("--anchor-policy", cfg.anchor_policy, o.anchor_policy),
                               ("--anchor-seed", cfg.anchor_seed if cfg.anchor_seed >= 0 else None, o.anchor_seed)):
        if mine and mine != theirs:
            raise ConfigError(f"{flag} {mine} contradicts the manifest, packed with {theirs} (pack --objective "
                              f"dflash); drop {flag} or re-pack with it")
    return AnchorSpec(seed=int(o.anchor_seed), max_anchors=o.max_anchors, policy=o.anchor_policy,
                      block_size=o.block_size), "the manifest"
