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
from dflash_prep.formats.target import load_target_config, load_tokenizer, target_identity
from dflash_prep.objectives import drafter_cost
from dflash_prep.objectives.target_taps import repeated_taps

from dflash_prep.train.chunked_ce import weighted_ce
from dflash_prep.train.config import TrainConfig
from dflash_prep.train.objectives.dflash.batch import (AnchorSpec, DFlashBatch, anchor_spec, build_dflash_batch,
                                                       default_gamma)
from dflash_prep.train.objectives.drafter import DrafterObjective


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


def stats_width(block_size: int) -> int:
    """Length of the per-step stats vector: loss, blocks, tau sum, correct/valid per slot, sum w."""
    return 4 + 2 * (block_size - 1)


@dataclass(frozen=True)
class LossSpec:
    """What the loss of a block slot is: part of the run contract (module docstring of :mod:`dflash_prep.train.objectives`)."""

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


@dataclass
class BlockForward:
    """What one micro-batch's DFlash forward gives (:func:`dflash_forward`): the drafter's hidden
    states ``hid [N * B, H]``, the rows with a loss ``sel`` (int64 indices into ``N * B``) and
    their targets ``tg``, weights ``w`` (D-PACE's from this forward, else the batch's) and
    argmax predictions ``pred``, the weighted slot-loss sum ``loss``, and the target's head."""

    hid: torch.Tensor
    sel: torch.Tensor
    tg: torch.Tensor
    w: torch.Tensor
    pred: torch.Tensor
    loss: torch.Tensor
    head: torch.Tensor


def dflash_forward(drafter, target, b: DFlashBatch, *, block_size: int, ce_chunk: int,
                   spec: LossSpec = LossSpec()) -> BlockForward:
    """The forward and weighted slot loss of one micro-batch (under the caller's autocast).

    ``decay`` + ``ce`` runs :func:`~dflash_prep.train.chunked_ce.weighted_ce` with the batch's
    weights; ``dpace`` or ``kl`` run :func:`~dflash_prep.train.chunked_kl.row_losses` and weight
    the rows afterwards (D-PACE from the rows' CE). ``kl`` runs the target to its end
    (``FrozenTarget.features(final=True)``); its head is applied to the labelled rows only.
    ``target`` is a taps provider (:mod:`dflash_prep.train.split.taps`: the local target, or the target rank serving
    this drafter) or a :class:`~dflash_prep.train.target.FrozenTarget`.
    """
    from dflash_prep.train.chunked_kl import row_losses
    from dflash_prep.train.split.taps import provider_of

    target = provider_of(target)

    B = block_size
    N = b.n_anchors
    kl = spec.loss == "kl"
    got = target.taps(b, epoch=b.epoch, final=kl)                                          # no grad
    feats, last = got if kl else (got, None)                                                # (T, k*H), (T, H)
    with torch.no_grad():
        noise = target.embed_tokens(b.noise_ids)                                            # (Q, H)
    hid = drafter(noise, feats, b.position_ids, b.blk_pos, b.cu_seqlens, b.cu_blk, b.anchors, B)  # (Q, H)
    sel = torch.nonzero(b.weights > 0).squeeze(1)                                           # rows with a loss
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
    return BlockForward(hid=hid, sel=sel, tg=tg, w=w, pred=pred, loss=loss, head=head)


def block_tau(correct: torch.Tensor) -> torch.Tensor:
    """``sum`` over blocks of ``1 + sum_r prod_{i <= r} correct_i`` for ``correct [N, B-1]`` (0/1,
    float64): the expected acceptance length's numerator."""
    if correct.shape[0] == 0:
        return correct.new_zeros(())
    return (1.0 + torch.cumprod(correct, dim=1).sum(dim=1)).sum()


def block_stats(f: BlockForward, b: DFlashBatch, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(head, wsum)`` of the stats vector (:func:`stats_width`): ``head`` = loss, blocks, tau
    sum, correct and valid per slot; ``wsum`` = the step normaliser's share, last."""
    B, N = block_size, b.n_anchors
    correct = torch.zeros(N * B, dtype=torch.float64, device=f.hid.device)
    correct[f.sel] = (f.pred == f.tg).double()
    valid = (b.weights > 0).double().view(N, B)[:, 1:]                                      # (N, B-1)
    correct = correct.view(N, B)[:, 1:]                                                     # (N, B-1)
    head = torch.cat([torch.stack([f.loss.detach().double(), correct.new_tensor(float(N)), block_tau(correct)]),
                      correct.sum(0), valid.sum(0)])
    return head, f.w.detach().double().sum().reshape(1)


def dflash_loss(drafter, target, b: DFlashBatch, *, block_size: int, ce_chunk: int, autocast,
                spec: LossSpec = LossSpec()) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum w * loss, stats)`` for one micro-batch: stats float64 ``[stats_width(B)]`` (no grad);
    :func:`dflash_forward` under ``autocast``, then :func:`block_stats`."""
    with autocast():
        f = dflash_forward(drafter, target, b, block_size=block_size, ce_chunk=ce_chunk, spec=spec)
    head, wsum = block_stats(f, b, block_size)
    return f.loss, torch.cat([head, wsum])


def summarize_stats(stats: torch.Tensor, denom: float, block_size: int) -> dict:
    """Per-step metrics from the all-reduced stats vector."""
    s = stats.tolist()
    n = block_size - 1
    corr, valid = s[3:3 + n], s[3 + n:3 + 2 * n]
    return {"loss": s[0] / denom if denom > 0 else float("nan"), "anchors": int(s[1]),
            "tau": s[2] / s[1] if s[1] else float("nan"),
            "slot_acc": [c / v if v else None for c, v in zip(corr, valid)],
            "acc": sum(corr) / sum(valid) if sum(valid) else float("nan")}


def flops_coefficients(c, target_layers: int, loss: str, cost_type=drafter_cost.DrafterCostModel,
                       **extra) -> np.ndarray:
    """The cost model's coefficients (:meth:`DrafterCostModel.coefficient_array`) for drafter config
    ``c``: the target forward runs to the last tap (``ce``) or through all ``target_layers``
    (``kl``: the target's distribution needs its final norm). ``cost_type``/``extra``: a variant's
    cost model and its own sizes."""
    run = target_layers if loss == "kl" else max(c.target_layer_ids) + 1
    cm = cost_type(hidden=c.hidden, layers=run, intermediate=c.intermediate, heads=c.heads, kv_heads=c.kv_heads,
                   head_dim=c.head_dim, vocab=c.vocab_size, draft_layers=c.num_layers,
                   sliding_window=c.sliding_window, **extra)
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
class DFlashObjective(DrafterObjective):
    """Drafter training on a frozen target (module docstring), behind the loop's objective
    protocol (:mod:`dflash_prep.train.objectives`). The block size is ``anchor_spec``'s: the
    drafter is built for it, and every use reads :attr:`block_size`."""

    name = "dflash"
    log_keys = ("tau", "acc", "slot_acc", "anchors")

    def __init__(self, drafter, target, cfg: TrainConfig, *, anchor_spec: AnchorSpec, gamma: float, identity: dict,
                 anchor_source: str = "the options", mask_line: str = ""):  # mask_line: MaskChoice.line()
        from dflash_prep.train.split.taps import provider_of

        super().__init__()
        if drafter.config.block_size != anchor_spec.block_size:
            raise ConfigError(f"the drafter is built for B = {drafter.config.block_size}, the anchors are drawn for "
                              f"B = {anchor_spec.block_size}")
        # target: a FrozenTarget or a taps provider (:mod:`dflash_prep.train.split.taps`; RemoteTaps on a split job's drafter rank)
        self.model, self.target, self.cfg = drafter, provider_of(target), cfg
        self.spec, self.gamma, self.identity = anchor_spec, float(gamma), identity
        self.anchor_source, self.mask_line = anchor_source, mask_line
        o = cfg.options
        self.loss_spec = LossSpec(slot_weights=o.slot_weights, dpace_alpha=float(o.dpace_alpha), loss=o.loss,
                                  kl_temperature=float(o.kl_temperature))
        # D-PACE weights come out of the forward: the loop all-reduces sum w after it (train_step)
        self.deferred_denominator = cfg.options.slot_weights == "dpace"
        self.stats_width = stats_width(self.block_size)
        self._p_drafter = sum(p.numel() for p in drafter.parameters())
        self._coef = self.cost_coefficients()
        self._anchors = 0

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    def cost_coefficients(self) -> np.ndarray:
        """The step cost's coefficients (:func:`flops_coefficients`), for MFU."""
        return flops_coefficients(self.model.config, self.target.num_layers, self.cfg.options.loss)

    def build(self, ds, mb, epoch: int, layout: str, pin: bool):
        c = self.model.config
        gamma = None if self.deferred_denominator else self.gamma
        return build_dflash_batch(ds, mb, epoch=epoch, spec=self.spec, gamma=gamma,
                                  mask_token_id=c.mask_token_id, vocab_size=c.vocab_size, pin=pin)

    @staticmethod
    def denominator(b) -> float:
        return b.weight_sum

    def loss(self, b, autocast):
        return dflash_loss(self.model, self.target, b, block_size=self.block_size, ce_chunk=self.cfg.ce_chunk,
                           autocast=autocast, spec=self.loss_spec)

    def metrics(self, stats: torch.Tensor, denom: float) -> dict:
        return summarize_stats(stats, denom, self.block_size)

    def flops(self, b) -> float:
        return step_flops(self._coef, b)

    def contract(self) -> dict:
        c = self.model.config
        return {"objective": self.name, **self.identity, "target_layer_ids": list(c.target_layer_ids),
                "mask_token_id": c.mask_token_id, "block_size": self.block_size,
                "sliding_window": c.sliding_window, **self.recipe_fields(),
                "anchors": self.spec.to_dict(), **self.target.contract(),
                **({"init_layers": "target"} if self.cfg.options.init_layers == "target" else {})}

    def describe(self) -> str:
        """What the run resolved, printed at start: the mask token's line (:mod:`.mask`), then the
        recipe (defaults filled in) on one line."""
        cfg, c, ls = self.cfg, self.model.config, self.loss_spec
        weights = f"dpace alpha={ls.dpace_alpha:g}" if ls.slot_weights == "dpace" else f"decay gamma={self.gamma:g}"
        loss = f"kl T={ls.kl_temperature:g}" if ls.loss == "kl" else "ce"
        opt = self.optimizer_text()
        window = f"window {c.sliding_window}" if c.sliding_window else "full attention"
        head = f"{self.mask_line}\n" if self.mask_line else ""
        return head + (f"{self.name} recipe: B={self.block_size}, {c.num_layers} draft layer(s), {window}, "
                f"slot weights {weights}, "
                f"loss {loss}, optimizer {opt}; target {cfg.options.target} ({self.target.num_layers} layers), taps "
                f"{list(c.target_layer_ids)}, mask id {c.mask_token_id}, anchors {self.spec.policy}<="
                f"{self.spec.max_anchors} drawn by the library sampler with seed {self.spec.seed} "
                f"(from {self.anchor_source})" + (f"; WARNING: {again}" if (again := repeated_taps(c.target_layer_ids)) else ""))

    def recipe_fields(self) -> dict:
        """What the loss is (contract fields; the ones a setting leaves unused are None)."""
        ls = self.loss_spec
        return {"slot_weights": ls.slot_weights, "gamma": self.gamma if ls.slot_weights == "decay" else None,
                "dpace_alpha": ls.dpace_alpha if ls.slot_weights == "dpace" else None, "loss": ls.loss,
                "kl_temperature": ls.kl_temperature if ls.loss == "kl" else None}

    def check_epoch(self, epoch: int, manifest) -> None:
        """Every epoch after the first draws anchors as the first did (its budgets assume them),
        and every epoch's cost model has this drafter's window and depth
        (:func:`~dflash_prep.objectives.drafter_cost.check_drafter_shape`)."""
        drafter_cost.check_drafter_shape(manifest, sliding_window=self.cfg.options.sliding_window,
                                         draft_layers=self.cfg.options.draft_layers, objective=self.name)
        if epoch > 0:
            spec = anchor_spec(self.cfg, manifest)[0]
            if spec != self.spec:
                raise FormatError(f"epoch {epoch} manifest draws anchors with {spec}, epoch 0 "
                                  f"with {self.spec}; pack every epoch with the same drafter options")

    def log_fields(self, st: dict, dt: float) -> dict:
        """tau, accuracies and anchors of a step for its log record; kept for :meth:`run_summary`."""
        rec = super().log_fields(st, dt)
        if "anchors" in st:
            rec["anchors_per_s"] = st["anchors"] / dt
            self._anchors += st["anchors"]
        return rec

    def run_summary(self, time_s: float) -> dict:
        out = super().run_summary(time_s)
        return out | {"anchors": self._anchors, "anchors_per_s": self._anchors / max(time_s, 1e-9)} if out else out

    def num_parameters(self) -> int:
        return self._p_drafter


def drafter_config(cfg: TrainConfig, manifest=None, data=None):
    """``(DrafterConfig, AnchorSpec, where the anchor seed came from, tokenizer, MaskChoice)`` of a run: what a
    drafter rank builds and a target rank (:mod:`dflash_prep.train.split.worker`) needs to build the same batches.
    ``data``: the dataset folder the mask token is checked against (:mod:`.mask`; None: in-memory data)."""
    from dflash_prep.train.objectives.dflash import mask
    from dflash_prep.train.objectives.dflash.drafter import DrafterConfig

    spec, source = anchor_spec(cfg, manifest)
    hc = load_target_config(cfg.options.target)
    tok = load_tokenizer(cfg.options.target)
    choice = mask.decide(cfg, tok, hc, data)
    ids = list(cfg.options.target_layer_ids) or None
    dcfg = DrafterConfig.from_target_config(hc, cfg.options.draft_layers, spec.block_size, choice.id,
                                            target_layer_ids=ids, sliding_window=cfg.options.sliding_window)
    return dcfg, spec, source, tok, choice


def build(cfg: TrainConfig, ds, device: torch.device, manifest=None, place=None, *, objective_type=None,
          make_drafter=None) -> DFlashObjective:
    """The drafter for ``cfg.options.target`` (a transformers folder), with the anchors of ``manifest``;
    on a split job's drafter rank (``place``, :mod:`dflash_prep.train.split`) its taps come from
    the target rank. A variant passes its objective class and ``make_drafter(dcfg) -> module``
    (on the CPU; built after the target, with torch seeded by the caller)."""
    from dflash_prep.train.objectives.dflash.drafter import Drafter
    from dflash_prep.train.objectives.dflash.mask import dataset_folder
    from dflash_prep.train.target import target_provider

    drafter_cost.check_drafter_shape(manifest, sliding_window=cfg.options.sliding_window,
                                     draft_layers=cfg.options.draft_layers, objective=cfg.objective)
    dcfg, spec, source, tok, choice = drafter_config(cfg, manifest, dataset_folder(ds))
    identity = target_identity(cfg.options.target, tok)
    target = target_provider(cfg, ds, dcfg.target_layer_ids, final=cfg.options.loss == "kl", identity=identity,
                             device=device, place=place)
    drafter = (make_drafter or Drafter)(dcfg).to(device)
    warm = ""
    if cfg.options.init_layers == "target":
        from dflash_prep.train.objectives.dflash.warm_start import copy_target_layers
        warm = copy_target_layers(drafter, cfg.options.target)
    gamma = cfg.options.gamma or default_gamma(spec.block_size)
    return (objective_type or DFlashObjective)(drafter, target, cfg, anchor_spec=spec, gamma=gamma,
                                               identity=identity, anchor_source=source,
                                               mask_line="\n".join(x for x in (choice.line(), warm) if x))
