"""The DFlash2 objective: DFlash's loss plus the candidate selector's, on a DFlash2 drafter.

Everything of DFlash applies unchanged (:mod:`dflash_prep.train.objectives.dflash.objective`:
anchors, blocks, the slot weights ``decay``/``dpace``, ``ce``/``kl``, the window, the step
normaliser ``sum w``, target ranks). On top, per micro-batch, for slot r = 1..B-1 of every block:

- **unary**: the top-K (``--selector-top-k``) of the target head's logits of the drafter's
  state ``h_r`` (:func:`~.selector.unary_topk_from_hidden`, value descending, id ascending);
- **selector loss**, teacher-forced (:func:`~.selector.selector_loss`): the predecessor of slot
  r is the data token ``x[a + r - 1]`` (the anchor for r = 1), the label the gold token's
  candidate index; a K-way cross-entropy over the edge scores, weighted by the slot's DFlash
  weight ``w`` (decay, or D-PACE's from this forward) and summed. A slot whose gold token is not
  among the K is dropped or injected (``--selector-missing``). The micro-batch's loss is
  ``sum w * unary + alpha * sum w * selector``, divided by the whole step's ``sum w`` like the
  unary loss: one normaliser over ranks and accumulation, so the update is the same however the
  step is split (partition-invariant, as D-PACE's normaliser is);
- **metrics** (sums all-reduced per step): ``topk_recall`` (gold among the K, over weighted
  slots), ``selector_acc`` (teacher-forced argmax = gold, over covered slots), ``selector_loss``
  (its weighted mean CE over the slots it trained), and ``path_tau``: the acceptance length of the
  path the drafter would propose, walked greedily from the anchor through its own choices
  (self-conditioned, the public walk), against the data tokens; ``tau`` stays DFlash's (the
  per-slot argmax).

Cost: the head's logits of each slot row are computed twice (once by the unary loss's chunks,
once for the top-K); the step cost model (:class:`~dflash_prep.objectives.drafter_cost.DFlash2CostModel`)
prices the selector's own work.
"""

from __future__ import annotations

import torch

from dflash_prep.errors import ConfigError, FormatError
from dflash_prep.objectives import drafter_cost
from dflash_prep.train.objectives.dflash.objective import DFlashObjective, block_stats, block_tau, build, dflash_forward, flops_coefficients, stats_width, summarize_stats
from dflash_prep.train.objectives.dflash2.drafter import DFlash2Config, DFlash2Drafter
from dflash_prep.train.objectives.dflash2.selector import Unary, selector_loss, unary_topk_from_hidden

#: selector stats: loss sum, its weight sum, weighted slots, covered, correct, unary correct, path tau sum
SELECTOR_STATS = 7
#: the DFlash2 sizes a manifest's ``dflash`` section records (pack --objective dflash2)
SIZES = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def selector_terms(drafter, f, b, *, block_size: int, options, ce_chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum w * selector CE (with grad), stats float64 [SELECTOR_STATS])`` of one micro-batch
    from its DFlash forward ``f`` (:class:`~dflash_prep.train.objectives.dflash.objective.BlockForward`)."""
    B, N, H = block_size, b.n_anchors, f.hid.shape[-1]
    sel = drafter.candidate_selector
    blocks = b.targets.view(N, B)                                                       # (N, B) x[a .. a+B-1]
    pred_ids, gold = blocks[:, :-1], blocks[:, 1:]                                      # (N, B-1) each
    w = torch.zeros(N * B, dtype=torch.float32, device=f.hid.device)
    w[f.sel] = f.w.detach().float()
    w = w.view(N, B)[:, 1:]                                                             # (N, B-1)
    hs = f.hid.view(N, B, H)[:, 1:]                                                     # (N, B-1, H)
    unary = unary_topk_from_hidden(hs, f.head, sel.top_k, gold=gold, chunk_rows=ce_chunk)
    sl = selector_loss(sel, hs, unary, pred_ids, gold, w, missing=options.selector_missing,
                       detach=options.selector_detach)
    with torch.no_grad():          # the path the drafter would propose: the greedy walk from the anchor
        prev, correct = blocks[:, 0], []
        valid = w > 0
        for r in range(B - 1):
            one = Unary(unary.values[:, r].detach(), unary.ids[:, r])
            k = sel.scores(hs[:, r].detach(), one, prev).argmax(dim=-1)                  # (N,) first maximum
            prev = unary.ids[:, r].gather(1, k[:, None])[:, 0]
            correct.append(((prev == gold[:, r]) & valid[:, r]).double())
        path = block_tau(torch.stack(correct, 1)) if correct else f.hid.new_zeros((), dtype=torch.float64)
    stats = torch.cat([torch.stack([sl.loss.detach().double(), sl.weight_sum.double()]),
                       sl.stat_vector()[1:].double(), path.double().reshape(1)])
    return sl.loss, stats


class DFlash2Objective(DFlashObjective):
    """DFlash's objective on a :class:`~.drafter.DFlash2Drafter`, plus the selector (module docstring)."""

    name = "dflash2"

    def __init__(self, drafter, target, cfg, **kw):
        super().__init__(drafter, target, cfg, **kw)
        self.stats_width = stats_width(self.block_size) + SELECTOR_STATS

    def cost_coefficients(self):
        c = self.model.config
        return flops_coefficients(c, self.target.num_layers, self.cfg.options.loss, drafter_cost.DFlash2CostModel,
                                  **{k: getattr(c, k) for k in SIZES})

    def loss(self, b, autocast):
        o, B = self.cfg.options, self.block_size
        with autocast():
            f = dflash_forward(self.model, self.target, b, block_size=B, ce_chunk=self.cfg.ce_chunk,
                               spec=self.loss_spec)
            sel_loss, sel_stats = selector_terms(self.model, f, b, block_size=B, options=o,
                                                 ce_chunk=self.cfg.ce_chunk)
            loss = f.loss + float(o.selector_loss_alpha) * sel_loss.to(f.loss.dtype)
        head, wsum = block_stats(f, b, B)
        head[0] = loss.detach().double()
        return loss, torch.cat([head, sel_stats, wsum])

    def metrics(self, stats: torch.Tensor, denom: float) -> dict:
        n = stats_width(self.block_size) - 1
        out = summarize_stats(torch.cat([stats[:n], stats[-1:]]), denom, self.block_size)
        s = stats[n:n + SELECTOR_STATS].tolist()
        loss_sum, w_sum, slots, covered, correct, unary_correct, path = s
        ratio = (lambda a, c: a / c if c > 0 else float("nan"))
        return out | {"selector_loss": ratio(loss_sum, w_sum), "topk_recall": ratio(covered, slots),
                      "selector_acc": ratio(correct, covered), "unary_acc": ratio(unary_correct, slots),
                      "path_tau": ratio(path, float(stats[1]))}

    def log_fields(self, st: dict, dt: float) -> dict:
        rec = super().log_fields(st, dt)
        return rec | {k: st[k] for k in ("selector_loss", "topk_recall", "selector_acc", "path_tau") if k in st}

    def contract(self) -> dict:
        o, c = self.cfg.options, self.model.config
        return super().contract() | {k: getattr(c, k) for k in SIZES} | {
            "selector_loss_alpha": float(o.selector_loss_alpha), "selector_missing": o.selector_missing,
            "selector_detach": bool(o.selector_detach), "selector_init": c.selector_init,
            "init_from_drafter": self.warm_start}

    def describe(self) -> str:
        o, c = self.cfg.options, self.model.config
        start = f", warm start from {o.init_from_drafter}" if o.init_from_drafter else ""
        return (super().describe() + f"; convolutions {c.conv_kernel_size} taps / groups of {c.conv_group_size}, "
                f"selector rank {c.selector_rank} top-{c.selector_top_k} init {c.selector_init}, loss alpha "
                f"{o.selector_loss_alpha:g}, missing gold {o.selector_missing}"
                f"{', detached' if o.selector_detach else ''}{start}")

    def check_epoch(self, epoch: int, manifest) -> None:
        super().check_epoch(epoch, manifest)
        check_manifest_sizes(self.model.config, manifest, epoch)

    warm_start: str | None = None
    """The fingerprint of the DFlash export the run started from (``--init-from-drafter``), or None."""


def check_manifest_sizes(c: DFlash2Config, manifest, epoch: int) -> None:
    """A ``pack --objective dflash2`` manifest balanced ranks on these sizes: a run with others
    trains on a cost model that is not its own, so it is refused with the pack flags that fix it.
    A manifest of another objective (no sizes recorded) is only balanced on another cost: allowed."""
    header = getattr(manifest, "header", None) or {}
    d = header.get("dflash") or {}
    if (header.get("options") or {}).get("objective") != "dflash2":
        return
    diff = [(k, d.get(k), getattr(c, k)) for k in SIZES if d.get(k) != getattr(c, k)]
    if diff:
        flags = " ".join(f"--{k.replace('_', '-')} {mine}" for k, _, mine in diff)
        theirs = ", ".join(f"{k} {t}" for k, t, _ in diff)
        raise ConfigError(f"manifest epoch {epoch} was packed for a DFlash2 drafter with {theirs}; this run's "
                          f"differ, so its ranks are balanced on another step cost: re-pack with `dflash-prep pack "
                          f"--objective dflash2 {flags}` or train with the manifest's sizes")


def _drafter_maker(cfg):
    o = cfg.options

    def make(dcfg):
        c = DFlash2Config(**dcfg.to_dict(), conv_kernel_size=o.conv_kernel_size, conv_group_size=o.conv_group_size,
                          selector_rank=o.selector_rank, selector_top_k=o.selector_top_k,
                          selector_init=o.selector_init)
        return DFlash2Drafter(c)
    return make


def warm_start(drafter: DFlash2Drafter, folder: str) -> str:
    """Load an exported DFlash (v1) drafter into ``drafter``: every DFlash tensor, strictly, the
    convolutions and the selector kept as initialised. Refuses a drafter of another shape.
    Returns the export's folder fingerprint (part of the run contract)."""
    from dflash_prep.train.objectives.dflash.export import folder_fingerprint, load_export

    v1, _ = load_export(folder)
    mine, theirs = drafter.config.to_dict(), v1.config.to_dict()
    diff = {k: (theirs[k], mine[k]) for k in theirs if theirs[k] != mine[k]}
    if diff:
        shown = ", ".join(f"{k}: {a} (export) vs {b} (run)" for k, (a, b) in diff.items())
        raise ConfigError(f"--init-from-drafter {folder}: its drafter differs from this run's ({shown}); train with "
                          "its target, taps, block size, window and mask id, or start from scratch")
    state = v1.state_dict()
    own = drafter.state_dict()
    extra = sorted(set(state) - set(own))
    if extra:
        raise FormatError(f"--init-from-drafter {folder}: tensors {extra[:5]} are not a DFlash2 drafter's")
    drafter.load_state_dict({**own, **{k: v.to(own[k].dtype) for k, v in state.items()}}, strict=True)
    return folder_fingerprint(folder)


def build_dflash2(cfg, ds, device: torch.device, manifest=None, place=None) -> DFlash2Objective:
    """DFlash's builder with the DFlash2 drafter, warm-started when ``--init-from-drafter``."""
    obj = build(cfg, ds, device, manifest, place, objective_type=DFlash2Objective, make_drafter=_drafter_maker(cfg))
    if cfg.options.init_from_drafter:
        obj.warm_start = warm_start(obj.model, cfg.options.init_from_drafter)
    if manifest is not None:
        check_manifest_sizes(obj.model.config, manifest, int(getattr(manifest, "epoch", 0)))
    return obj
