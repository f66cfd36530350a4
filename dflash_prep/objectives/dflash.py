"""``pack --objective dflash``: micro-batches for drafter training, budgeted on tokens AND anchors.

A DFlash step costs what its anchors cost (:mod:`dflash_prep.objectives.drafter_cost`), so this layout
packs on three resources at once. Every sample ``i`` brings ``L_i`` tokens (target forward
memory), ``k_i`` anchors (:func:`anchors.anchor_counts`: drafter compute and memory) and a
drafter step cost ``c_i`` (FLOPs). Algorithm, per epoch:

1. order: a :func:`dflash_prep.pack.keyed.keyed_permutation` of the samples, keyed by
   ``(seed, epoch, PURPOSE_DFLASH)`` (no bucketing: varlen has no padding to avoid);
2. first-fit into ``open_bins`` open micro-batches (:func:`bucketing.pack_varlen`, the
   anchors and FLOPs as :class:`bucketing.SideLoads`): a sample joins the first open one
   where ``sum L <= T``, ``sum k <= anchor_budget``, ``sum c <= cost_budget`` and the count
   stays ``<= max_batch_size``; when none has room, the fullest one (highest of its three
   fill fractions) is closed and its slot reopened. Micro-batches are numbered in closing
   order, members keep their arrival order;
3. the rest is :func:`pack.build_epoch`'s: whole steps, the class-aware schedule, and LPT
   rank assignment on the micro-batches' drafter cost (the sum of their samples' ``c_i``).

The cost budget defaults to ``cost_fill`` x T x (the epoch's mean cost per token): the cost
binds first, so micro-batches carry nearly equal FLOPs and ranks stay balanced even at
``A = 1``, while T stays a hard memory cap. Layout is varlen: every target token and
every anchor slot computed is a real one (useful fractions 1.0 by construction). The
trade-off is ``cost_fill``: a lower share balances ranks better and fills fewer tokens per
micro-batch (0 drops the cost budget: the best token fill, ranks balanced by LPT alone).
The anchor digest (:class:`anchor_digest.DigestJob`) runs on the second core while the
first packs. Rank balance, speed and memory at 902K and 100M samples
(``bench/drafter_data.py``): docs/benchmarks.md#drafter-data-paths.

Anchor positions are not stored: the trainer regenerates them per micro-batch with
:func:`anchors.sample_anchors_batch`, keyed by ``(anchor_seed, epoch, sample id)``.
``anchor_counts.npy`` (int32 per ``sample_ids`` entry) and the epoch's anchor digest
(:class:`anchor_digest.AnchorDigest`, over every sample of the dataset) are in the manifest;
``store_anchors`` also writes ``anchors.npy`` (int32 positions, concatenated in
``sample_ids`` order). verify and ``store_anchors`` read the masks once, shard by shard
(:class:`EpochAnchors`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

import numba as nb
import numpy as np

from dflash_prep.errors import ConfigError
from dflash_prep.formats.dataset import open_dataset
from dflash_prep.formats.lengths import read_mask_counts
from dflash_prep.formats.plan import Budget, check_seed
from dflash_prep.objectives import anchor_digest, anchors
from dflash_prep.objectives import options as opt_decl
from dflash_prep.objectives.anchors import anchor_count
from dflash_prep.objectives.base import DataObjective
from dflash_prep.objectives.dflash_anchors import EpochAnchors, differing_rows, store_anchors
from dflash_prep.objectives.drafter_cost import (DrafterCostModel, cost_model_of_record, cost_shares, sample_cost,
                                                 step_flops)
from dflash_prep.objectives.options import PACK, Flag, option
from dflash_prep.objectives.serving import Serving, block_problems
from dflash_prep.objectives.target_taps import dflash_need, states_estimate
from dflash_prep.pack import metrics, steps
from dflash_prep.pack.batch_stats import row_sums, segment_sums
from dflash_prep.pack.bucketing import SideLoads, pack_varlen

#: Key tag of the drafter packing order ("dflash").
PURPOSE_DFLASH = 0x64666C617368
#: The default anchor budget's room over a micro-batch of T tokens of mean composition.
ANCHOR_HEADROOM = 1.25
#: The public recipe's drafter (speculators RFC #979): the cost model's and the trainer's defaults.
RECIPE_DRAFT_LAYERS = 5
RECIPE_SLIDING_WINDOW = 2048


def cost_model_from_flags(target_config: Path | None, target_dims: str | None, draft_layers: int,
                          sliding_window: int) -> DrafterCostModel:
    """The cost model from exactly one of a transformers config (``--target-config``) or explicit
    ``--target-dims``, with the drafter's ``--draft-layers`` and ``--sliding-window`` (0 = full)."""
    if (target_config is None) == (target_dims is None):
        raise ConfigError("--objective dflash needs the cost model's sizes from exactly one of --target-config DIR "
                          "(a transformers config.json) or --target-dims hidden=...,layers=...")
    return (DrafterCostModel.from_config(target_config, draft_layers, sliding_window) if target_config is not None
            else DrafterCostModel.from_dims(target_dims, draft_layers, sliding_window))


def _spell_cost_model(cm: DrafterCostModel | None) -> dict:
    if cm is None:
        return {}
    sizes = {k: v for k, v in asdict(cm).items() if k not in ("draft_layers", "sliding_window")}
    return {"target_dims": ",".join(f"{k}={v}" for k, v in sizes.items()), "draft_layers": cm.draft_layers,
            "sliding_window": cm.sliding_window}


_COST_MODEL_FLAGS = (
    Flag("target_config", Optional[Path], None, "cost model: the target's folder or config.json"),
    Flag("target_dims", Optional[str], None, "cost model, the target's sizes as name=value pairs joined by commas: "
         "hidden, layers, intermediate, heads, kv_heads, head_dim, vocab", metavar="SIZES"),
    Flag("draft_layers", int, RECIPE_DRAFT_LAYERS, "cost model: drafter decoder layers (the recipe's)"),
    Flag("sliding_window", int, RECIPE_SLIDING_WINDOW,
         "cost model: the drafter's sliding-window attention W (0 = full; the recipe's)"))


@dataclass(frozen=True)
class DrafterOptions:
    """The drafter part of a pack config: the flags of ``pack`` / ``analyze --objective dflash``,
    their defaults and help, declared once (:mod:`dflash_prep.objectives.options`).

    ``cost_model`` is required by ``pack``; ``anchor_budget`` None is :data:`ANCHOR_HEADROOM` x
    T x the data's anchors per token (at least ``max_anchors``), fixed per epoch by
    :func:`prepare`; ``anchor_seed`` None resolves to the plan's seed.
    """

    cost_model: DrafterCostModel | None = option(
        None, help="model sizes of the step cost", flags=_COST_MODEL_FLAGS, build=cost_model_from_flags,
        spell=_spell_cost_model)
    block_size: int = option(anchors.DEFAULT_BLOCK_SIZE, header=True, help="B, tokens per draft block (an anchor "
                             "and B - 1 masked slots)")
    max_anchors: int = option(anchors.DEFAULT_MAX_ANCHORS, header=True, help="anchors per sample at most")
    anchor_policy: str = option(anchors.DEFAULT_POLICY, header=True, help="cap (min(max_anchors, candidates)) or "
                                "density (one per B supervised tokens, capped)")
    anchor_budget: int | None = option(None, commands=(PACK,), help="anchors per micro-batch at most (default: "
                                       f"{ANCHOR_HEADROOM:g} x T x anchors per token)")
    cost_fill: float = option(0.95, commands=(PACK,), help="cost budget as a share of T x mean drafter cost per "
                              "token (0: none)")
    anchor_seed: int | None = option(None, commands=(PACK,), header=True, help="anchor sampler seed (pack: the plan's "
                                     "by default)")
    store_anchors: bool = option(False, commands=(PACK,), help="also write anchors.npy (every position; reads all "
                                 "masks)")

    def __post_init__(self):
        anchors.check_options(self.max_anchors, self.anchor_policy, self.block_size)
        if self.anchor_budget is not None and self.anchor_budget < self.max_anchors:
            raise ConfigError(f"--anchor-budget ({self.anchor_budget}) must hold one full sample's "
                              f"--max-anchors ({self.max_anchors})")
        if not 0.0 <= self.cost_fill <= 1.0:
            raise ConfigError(f"--cost-fill must lie in [0, 1], got {self.cost_fill}")
        if self.anchor_seed is not None:
            check_seed(self.anchor_seed, "--anchor-seed")

    def resolve(self, *, seed: int, token_budget: float) -> "DrafterOptions":
        """Defaults filled in from the plan: the anchor seed."""
        if self.cost_model is None:
            raise ConfigError("pack --objective dflash needs the model sizes of its cost model: "
                              "--target-config DIR (a transformers config.json) with --draft-layers N, or --target-dims")
        return replace(self, anchor_seed=int(seed if self.anchor_seed is None else self.anchor_seed))

    def step_cost_model(self) -> DrafterCostModel | None:
        """The cost model of one training step, what pack balances ranks on and the manifest
        records: :attr:`cost_model` here; a variant whose drafter adds work (DFlash2) extends it."""
        return self.cost_model

    @classmethod
    def from_json(cls, d: dict) -> "DrafterOptions":
        d = dict(d)
        cm = d.get("cost_model")
        if cm is not None:
            d["cost_model"] = DrafterCostModel(**cm)
        return cls(**d)


def drafter_options(**flags) -> DrafterOptions:
    """:class:`DrafterOptions` from ``pack``'s flag values by name (``target_dims=...``,
    ``block_size=...``); a flag left out takes its declared default."""
    known = {fl.name for fl in opt_decl.flags(DrafterOptions, PACK)}
    if set(flags) - known:
        raise ConfigError(f"unknown drafter option(s) {sorted(set(flags) - known)}; known: {', '.join(sorted(known))}")
    return opt_decl.from_flags(DrafterOptions, PACK, flags)


def pack_drafter(lengths: np.ndarray, counts: np.ndarray, cost: np.ndarray, *, seed: int, epoch: int,
                 budget: Budget, anchor_budget: float, cost_budget: float | None, open_bins: int = 4):
    """Steps 1-2 of the module docstring under the token ``budget`` (its value T and
    ``max_batch_size``): :func:`bucketing.pack_varlen` with the anchors and the step FLOPs as
    side loads. Returns ``(order, offsets, olens)``. ``counts``/``cost`` are per sample id;
    ``cost_budget`` None means no cost budget (a lone sample over it still gets its own)."""
    if len(counts) and int(np.max(counts)) > anchor_budget:
        raise ConfigError(f"a sample has {int(np.max(counts))} anchors, over --anchor-budget {anchor_budget:.0f}")
    cb = max(float(cost_budget), float(np.max(cost))) if cost_budget else None
    side = SideLoads(counts=counts, count_budget=float(anchor_budget), weights=None if cb is None else cost,
                     weight_budget=np.inf if cb is None else cb)
    return pack_varlen(lengths, seed=seed, epoch=epoch, budget=budget, open_bins=open_bins, side=side,
                       purpose=PURPOSE_DFLASH)


@nb.njit(cache=True, parallel=True)
def _counts_and_cost(lens, sup, cand, max_anchors, density, block_size, coef, counts, cost):
    for i in nb.prange(lens.shape[0]):
        k = anchor_count(cand[i], sup[i], max_anchors, density, block_size)
        counts[i] = k
        cost[i] = step_flops(coef, lens[i], sup[i], k)


@dataclass
class DrafterEpoch:
    """Per-sample quantities of one drafter epoch (indexed by sample id)."""

    supervised: np.ndarray      # int32
    candidates: np.ndarray      # int32
    counts: np.ndarray          # int32 anchors per sample
    cost: np.ndarray            # float64 drafter FLOPs per sample
    cost_budget: float | None
    anchor_budget: int
    digest: "anchor_digest.DigestJob | None" = None    # the epoch's anchor digest, being computed


def prepare(lens: np.ndarray, supervised: np.ndarray, candidates: np.ndarray, opts: DrafterOptions,
            token_budget: float) -> DrafterEpoch:
    """Anchor counts, per-sample costs and the budgets (``opts`` resolved): one pass, two arrays."""
    lens, sup, cand = (np.ascontiguousarray(a) for a in (lens, supervised, candidates))
    if not lens.shape == sup.shape == cand.shape:
        raise ConfigError(f"{len(lens)} lengths, {len(sup)} supervised and {len(cand)} candidate counts: the "
                          "dataset folder is inconsistent, re-run `dflash-prep tokenize --overwrite`")
    n = lens.shape[0]
    counts, cost = np.empty(n, np.int32), np.empty(n, np.float64)
    _counts_and_cost(lens, sup, cand, np.int64(opts.max_anchors), opts.anchor_policy == "density",
                     np.int64(opts.block_size), opts.step_cost_model().coefficient_array(opts.block_size), counts, cost)
    tokens = float(lens.sum(dtype=np.int64))
    per_token = float(cost.sum()) / tokens
    cb = opts.cost_fill * float(token_budget) * per_token if opts.cost_fill else None
    ab = opts.anchor_budget
    if ab is None:
        per_token_k = float(counts.sum(dtype=np.int64)) / tokens
        ab = max(int(np.ceil(ANCHOR_HEADROOM * float(token_budget) * per_token_k)), opts.max_anchors)
    return DrafterEpoch(supervised=sup, candidates=cand, counts=counts, cost=cost, cost_budget=cb,
                        anchor_budget=int(ab))


def epoch_extras(de: DrafterEpoch, opts: DrafterOptions, kc: np.ndarray, mb_anchors: np.ndarray,
                 mb_tokens: np.ndarray, token_budget: float) -> tuple[dict, dict]:
    """The manifest's drafter header and summary entries; ``kc`` is ``anchor_counts.npy``
    (the anchors of each ``sample_ids`` entry) and ``de.digest`` the epoch's running
    :class:`anchor_digest.DigestJob`."""
    header = {**opt_decl.header(opts), "anchor_budget": de.anchor_budget, "cost_budget": de.cost_budget,
              "sampler_version": anchors.SAMPLER_VERSION,
              "cost_model": opts.step_cost_model().describe(opts.block_size),
              "anchor_digest": de.digest.result()}
    n_mb = max(len(mb_anchors), 1)
    summary = {"anchors": int(kc.sum(dtype=np.int64)), "useful_target_tokens": 1.0, "useful_anchor_slots": 1.0,
               "anchor_fill": float(mb_anchors.sum()) / (n_mb * de.anchor_budget),
               "token_fill": float(mb_tokens.sum()) / (n_mb * float(token_budget))}
    return header, summary


# ----------------------------------------------------------------------------- verify
def microbatch_cost(header: dict, lens: np.ndarray, supervised: np.ndarray, counts: np.ndarray,
                    offsets: np.ndarray) -> np.ndarray:
    """Drafter FLOPs per micro-batch from the cost model ``manifest.json`` records; the
    per-sample arrays are in micro-batch order (``offsets`` cut them)."""
    d = header["dflash"]
    c = sample_cost(cost_model_of_record(d["cost_model"]), int(d["block_size"]), lens, supervised, counts)
    return np.add.reduceat(c, offsets[:-1]) if len(c) else np.zeros(0)


def verify_epoch(header: dict, arrays: dict, lens: np.ndarray, order: np.ndarray, offsets: np.ndarray,
                 ds, mask_counts, epoch: int) -> tuple[list[str], dict]:
    """The drafter checks of ``dflash-prep verify`` over one epoch; returns (problems, metrics).

    ``order``/``offsets`` are the micro-batches in file order; ``ds`` is the dataset
    (:class:`dflash_prep.formats.dataset.Dataset`). Regenerates every anchor from the masks with the
    recorded seed and options (:class:`EpochAnchors`: one sequential pass over the shards)
    and checks: the masks' counts against ``supervised.npy``/``anchor_candidates.npy``;
    ``anchor_counts.npy`` against the sampler's counts; every anchor sorted, distinct and
    eligible; the recorded digest against the digest of the regenerated positions
    (:func:`anchor_digest.position_hashes`) and against the one the counts give
    (:func:`anchor_digest.selection_digest`, pack's way); ``anchors.npy`` (when present) equal to
    the regenerated positions; the anchor and cost budgets.
    """
    d = header["dflash"]
    opts = opt_decl.from_header(DrafterOptions, d)
    ids = np.asarray(arrays["sample_ids"])
    problems = []
    if int(d.get("sampler_version", -1)) != anchors.SAMPLER_VERSION:
        problems.append(f"packed with anchor sampler v{d.get('sampler_version')}, this dflash-prep has "
                        f"v{anchors.SAMPLER_VERSION}: the trainer would draw other anchors; re-pack the epoch")
    recorded = str(d.get("anchor_digest"))
    if not recorded.startswith(anchor_digest.DIGEST_PREFIX):
        problems.append(f"anchor digest {recorded!r} is not of this dflash-prep's kind ({anchor_digest.DIGEST_PREFIX}...: "
                        "packed by another version); re-pack the epoch to verify its anchors")
    sup_all, cand_all = mask_counts.supervised, mask_counts.anchor_candidates
    k = anchors.anchor_counts(cand_all, sup_all, opts.max_anchors, opts.anchor_policy, opts.block_size)
    stored = np.asarray(arrays["anchor_counts"])
    if not np.array_equal(stored, k[ids]):
        problems.append(f"anchor_counts.npy disagrees with the sampler in {int((stored != k[ids]).sum())} samples")
        return problems, {}
    job = anchor_digest.DigestJob(cand_all, k, seed=opts.anchor_seed, epoch=epoch)      # pack's way, beside the pass
    ea = EpochAnchors(ds, opts, epoch, ids, stored)
    kept = arrays.get("anchors")
    if kept is not None and len(kept) != ea.offsets[-1]:
        problems.append(f"anchors.npy holds {len(kept)} positions, the counts say {int(ea.offsets[-1])}")
        kept = None
    from_positions = anchor_digest.AnchorDigest(len(ds))
    bad_counts, bad_anchors, differ = [], [], 0
    try:
        for first, mask, cu, pos, poff, s, c in ea:
            n = len(cu) - 1
            if not (np.array_equal(s, sup_all[first:first + n]) and np.array_equal(c, cand_all[first:first + n])):
                bad_counts.append(first)
            bad = anchors.ineligible(mask, cu, pos, poff)
            if len(bad):
                bad_anchors.append(first + int(bad[0]))
            from_positions.update(anchor_digest.position_hashes(mask, cu, np.arange(first, first + n), pos, poff))
            if kept is not None:
                differ += differing_rows(pos, poff, ea.rows[first:first + n], ea.offsets, kept)
        from_counts = job.result()
    finally:
        job.cancel()
    if bad_counts:
        problems.append(f"the loss masks disagree with supervised.npy/anchor_candidates.npy (from sample "
                        f"{bad_counts[0]}); re-tokenize the dataset")
    if bad_anchors:
        problems.append(f"the sampler gave anchors that are unsorted, repeated or not eligible (e.g. sample "
                        f"{bad_anchors[0]})")
    regenerated = from_positions.hexdigest()
    if regenerated != from_counts:
        problems.append(f"the anchors regenerated from the masks digest to {regenerated}, the counts' draw to "
                        f"{from_counts}: the sampler is not reproducing itself; report this with the dataset")
    if recorded != from_counts and recorded.startswith(anchor_digest.DIGEST_PREFIX):
        problems.append(f"anchor digest {recorded} recorded, {from_counts} regenerated from the seed")
    if differ:
        problems.append(f"anchors.npy differs from the anchors the sampler regenerates from the seed in {differ} "
                        "samples")
    ko = np.asarray(k, np.int64)[order]
    problems += budget_problems(header, ko, np.asarray(lens)[order], sup_all[order], offsets)
    return problems, {"anchors": int(ko.sum())}


def budget_problems(header: dict, ko: np.ndarray, lens: np.ndarray, supervised: np.ndarray,
                    offsets: np.ndarray) -> list[str]:
    """Micro-batches over the recorded anchor or cost budget (a lone sample may exceed the cost
    budget); the per-sample arrays are in micro-batch order (``offsets`` cut them)."""
    d, problems = header["dflash"], []
    mb_k = np.add.reduceat(ko, offsets[:-1]) if len(ko) else np.zeros(0, np.int64)
    if len(mb_k) and mb_k.max() > int(d["anchor_budget"]):
        problems.append(f"{int((mb_k > int(d['anchor_budget'])).sum())} micro-batches exceed the anchor budget "
                        f"{d['anchor_budget']}")
    cost = microbatch_cost(header, lens, supervised, ko, offsets)
    cb = d.get("cost_budget")
    if cb and len(cost) and cost.max() > max(float(cb), 0.0) * (1 + 1e-9):
        one = np.add.reduceat(np.ones(len(ko), np.int64), offsets[:-1])
        if (cost[one > 1] > float(cb) * (1 + 1e-9)).any():
            problems.append(f"micro-batches exceed the cost budget {cb:.4g}")
    return problems


# ----------------------------------------------------------------------------- analyze
#: World size of analyze's drafter-cost balance prediction (definitions.md's benchmark W).
PREDICT_WORLD_SIZE = 8


def predict(lens: np.ndarray, supervised: np.ndarray, candidates: np.ndarray, opts: DrafterOptions,
            budget: Budget, *, seed: int, world_size: int = PREDICT_WORLD_SIZE) -> dict:
    """What ``pack --objective dflash`` will give, from one simulated epoch (epoch 0 of the
    real packer; ``analyze --objective dflash``): useful target tokens and anchor slots
    (1.0: varlen), token / anchor / cost fill, micro-batches, and the drafter-cost rank
    imbalance of LPT over ``world_size`` ranks at one micro-batch per rank."""
    token_budget = float(budget.value)
    opts = opts.resolve(seed=seed, token_budget=token_budget)
    de = prepare(lens, supervised, candidates, opts, token_budget)
    order, offsets, _ = pack_drafter(lens, de.counts, de.cost, seed=seed, epoch=0, budget=budget,
                                     anchor_budget=de.anchor_budget, cost_budget=de.cost_budget)
    cut = offsets[:-1]
    cost = np.add.reduceat(de.cost[order], cut)
    tok = np.add.reduceat(np.asarray(lens, np.int64)[order], cut)
    k = np.add.reduceat(de.counts[order].astype(np.int64), cut)
    m = len(cost) - len(cost) % world_size
    imb = None
    if m:
        perm, step, rank, _ = steps.assign_ranks(cost[:m], world_size, 1)
        imb = metrics.rank_imbalance(cost[:m][perm], step, rank, world_size)
    return {"useful_target_tokens": 1.0, "useful_anchor_slots": 1.0, "microbatches": int(len(cost)),
            "token_fill": float(tok.mean()) / token_budget, "anchor_fill": float(k.mean()) / de.anchor_budget,
            "cost_fill": float(cost.mean()) / de.cost_budget if de.cost_budget else None,
            "anchors": int(de.counts.sum(dtype=np.int64)), "anchor_budget": de.anchor_budget,
            "rank_imbalance": imb, "world_size": world_size,
            "anchor_cost_share": cost_shares(opts.step_cost_model(), opts.block_size, lens, supervised,
                                             de.counts)["anchors"]}


def predict_source(src, opts: DrafterOptions, budget: Budget, *, seed: int) -> dict:
    """:func:`predict` for a tokenized dataset (a :class:`lengths.LengthSource` of kind dataset)."""
    if src.kind != "dataset":
        raise ConfigError(f"{src.path}: --objective dflash needs a tokenized dataset folder (its loss-mask counts), "
                          "not a lengths file")
    mc = read_mask_counts(src.path)
    return predict(np.asarray(src.lengths), mc.supervised, mc.anchor_candidates, opts, budget, seed=seed)


# ----------------------------------------------------------------------------- the plugin
class DFlashObjective(DataObjective):
    """``pack --objective dflash`` (module docstring): varlen, token + anchor + cost budgets,
    ranks balanced on the drafter step cost; verify regenerates every anchor."""

    name = "dflash"
    #: the manifest header section it writes and reads: one for the DFlash family, so a variant
    #: (dflash2) keeps every reader of anchors, budgets and the cost model
    section = "dflash"
    layouts = ("varlen",)
    options_type = DrafterOptions
    summary_keys = ("useful_target_tokens", "useful_anchor_slots", "token_fill", "anchor_fill", "cost_fill",
                    "anchors", "anchor_budget", "microbatches", "rank_imbalance", "world_size", "anchor_cost_share")
    rank_cost_name = "drafter"
    reads_states = True
    default_draft_layers = RECIPE_DRAFT_LAYERS
    serving = Serving("DFlashDraftModel", "DFlash", block_problems)

    def states_estimate(self, options, tokens: int) -> str | None:
        cm = getattr(options, "cost_model", None)
        if cm is None:
            return None
        return states_estimate(self.name, cm.layers, cm.hidden, tokens, draft_layers=cm.draft_layers)

    def states_need(self, num_target_layers, *, draft_layers=None, target_layer_ids=(), loss="ce"):
        return dflash_need(self.name, num_target_layers, draft_layers=draft_layers, target_layer_ids=target_layer_ids,
                           loss=loss)

    def check(self, layout, options) -> None:
        if layout == "padded":
            raise ConfigError("--objective dflash packs the varlen layout only (padding wastes target tokens "
                              "and anchor slots); drop --layout padded")
        if options is None:
            raise ConfigError("--objective dflash needs drafter options (DrafterOptions)")

    def resolve(self, options, *, plan, budget):
        if budget.unit != "tokens":
            raise ConfigError("--objective dflash takes a token budget T (target forward memory); the cost "
                              "budget is its own (--cost-fill): pass --budget-unit tokens")
        return options.resolve(seed=plan.seed, token_budget=budget.value)

    #: the recipe the field converged on (speculators RFC #979): D-PACE slot weights, Muon
    def inputs(self, cfg, src):
        if src.kind != "dataset":
            raise ConfigError(f"{src.path}: --objective dflash needs a tokenized dataset folder (its loss-mask "
                              "counts), not a lengths file")
        dataset = open_dataset(src.path) if cfg.options.store_anchors else None
        return read_mask_counts(src.path), dataset

    def begin_epoch(self, lens, cfg, epoch, mask_counts):
        if mask_counts is None:
            raise ConfigError("--objective dflash needs the per-sample mask counts of a tokenized dataset "
                              "(supervised.npy, anchor_candidates.npy); pack a dataset folder, not a lengths file")
        de = prepare(lens, mask_counts.supervised, mask_counts.anchor_candidates, cfg.options, cfg.budget.value)
        # the anchor digest needs only the counts: it runs on the other core while this one packs
        de.digest = anchor_digest.DigestJob(de.candidates, de.counts, seed=cfg.options.anchor_seed, epoch=epoch)
        return de

    def end_epoch(self, de) -> None:
        de.digest.cancel()                # a no-op once the digest is taken

    def pack(self, lens, plan, cfg, epoch, de):
        order, offsets, olens = pack_drafter(
            lens, de.counts, de.cost, seed=plan.seed, epoch=epoch, budget=cfg.budget, anchor_budget=de.anchor_budget,
            cost_budget=de.cost_budget, open_bins=cfg.open_bins)
        return order, offsets, np.full(len(offsets) - 1, -1, np.int64), olens

    def rank_cost(self, cfg, de, order, offsets, se):
        return segment_sums(de.cost, order, offsets), se.real       # drafter FLOPs per micro-batch

    def finish_epoch(self, de, cfg, epoch, arrays, header, summary, rows, dataset) -> None:
        ids = arrays["sample_ids"]
        arrays["anchor_counts"] = kc = de.counts[ids]               # int32, in sample_ids order
        mb_k = row_sums(kc, rows.start, rows.count)                 # anchors per manifest row
        header[self.section], extra = epoch_extras(de, cfg.options, kc, mb_k, rows.real, cfg.budget.value)
        summary.update(extra)
        if cfg.options.store_anchors:
            if dataset is None:
                raise ConfigError("--store-anchors reads every loss mask: pack a tokenized dataset folder")
            arrays["anchors"] = store_anchors(dataset, ids, cfg.options, epoch, kc)

    def predicts_plan(self, cfg) -> bool:
        return False

    def required_arrays(self, header: dict) -> list[str]:
        return ["anchor_counts"]

    def verify(self, m, lens, ids, offsets, src):
        """(problems, metrics, supervised) of :func:`verify_epoch` against the dataset's masks."""
        if src.kind != "dataset":
            return [f"{src.path}: a dflash manifest is verified against its dataset folder (the loss masks); "
                    "pass --data"], {}, None
        mc = read_mask_counts(src.path)
        problems, got = verify_epoch(m.header, m.arrays, lens, ids, offsets, open_dataset(src.path), mc, m.epoch)
        t = np.asarray(m.table)                     # every row's anchors and tokens against its budgets
        n_mb, k = max(len(t), 1), int(np.asarray(m.arrays["anchor_counts"]).sum(dtype=np.int64))
        got |= {"useful_target_tokens": 1.0, "useful_anchor_slots": 1.0,
                "anchor_fill": k / (n_mb * int(m.header[self.section]["anchor_budget"])),
                "token_fill": int(np.asarray(lens, np.int64)[ids].sum()) / (n_mb * float(m.header["budget"]["value"]))}
        return problems, got, mc.supervised

    def verify_rank_cost(self, m, lens, order, offsets, supervised):
        return microbatch_cost(m.header, lens[order], supervised[order], np.asarray(m.arrays["anchor_counts"]),
                               offsets)

    def predict(self, src, options, budget, *, seed: int):
        return predict_source(src, options, budget, seed=seed)
