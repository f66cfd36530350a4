"""``pack --objective dflash``: micro-batches for drafter training, budgeted on tokens AND anchors.

A DFlash step costs what its anchors cost (:mod:`dflash_prep.drafter_cost`), so this layout
packs on three resources at once. Every sample ``i`` brings ``L_i`` tokens (target forward
memory), ``k_i`` anchors (:func:`anchors.anchor_counts`: drafter compute and memory) and a
drafter step cost ``c_i`` (FLOPs). Algorithm, per epoch:

1. order: a :func:`bucketing.keyed_permutation` of the samples, keyed by
   ``(seed, epoch, PURPOSE_DFLASH)`` (no bucketing: varlen has no padding to avoid);
2. first-fit into ``open_bins`` open micro-batches: a sample joins the first open one
   where ``sum L <= T``, ``sum k <= anchor_budget``, ``sum c <= cost_budget`` and the count
   stays ``<= max_batch_size``; when none has room, the fullest one (highest of its three
   fill fractions) is closed and its slot reopened. Micro-batches are numbered in closing
   order, members keep their arrival order;
3. the rest is :func:`pack.build_epoch`'s: whole steps, the class-aware schedule, and LPT
   rank assignment on the micro-batches' drafter cost (the sum of their samples' ``c_i``).

The cost budget defaults to ``cost_fill`` x T x (the epoch's mean cost per token): the cost
binds first, so micro-batches carry nearly equal FLOPs and ranks stay balanced even at
``A = 1``, while T stays a hard memory cap. Layout is varlen: every target token and
every anchor slot computed is a real one (useful fractions 1.0 by construction).

Anchor positions are not stored: the trainer regenerates them per micro-batch with
:func:`anchors.sample_anchors_batch`, keyed by ``(anchor_seed, epoch, sample id)``.
``anchor_counts.npy`` (int32 per ``sample_ids`` entry) and the epoch's anchor digest
(:func:`anchors.selection_digest`) are in the manifest; ``store_anchors`` also writes
``anchors.npy`` (int32 positions, concatenated in ``sample_ids`` order).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numba as nb
import numpy as np

from . import anchors
from .bucketing import _group_by_batch, _shuffle_inplace, mix_key
from .drafter_cost import DrafterCostModel, sample_cost
from .errors import ConfigError

OBJECTIVES = ("lm", "dflash")
#: Key tag of the drafter packing order ("dflash").
PURPOSE_DFLASH = 0x64666C617368
#: Default share of the mean-cost micro-batch the cost budget allows (see module docstring).
DEFAULT_COST_FILL = 0.95
#: The default anchor budget's room over a micro-batch of T tokens of mean composition.
ANCHOR_HEADROOM = 1.25


@dataclass(frozen=True)
class DrafterOptions:
    """The drafter part of a pack config (CLI flags of ``pack --objective dflash``).

    Attributes:
        cost_model: model sizes of the step cost (``--target-config`` + ``--draft-layers``,
            or ``--target-dims``); required.
        block_size: B, tokens per draft block (anchor + B - 1 masked slots).
        max_anchors: anchors per sample at most (the public recipe: 512).
        anchor_policy: ``cap`` or ``density`` (:mod:`dflash_prep.anchors`).
        anchor_budget: anchors per micro-batch at most; None: :data:`ANCHOR_HEADROOM` x T x the
            data's anchors per token (at least ``max_anchors``), fixed per epoch by :func:`prepare`.
        cost_fill: cost budget as a share of T x mean cost per token (0 disables it).
        anchor_seed: key of the anchor sampler; None resolves to the plan's seed.
        store_anchors: also write ``anchors.npy`` (reads every loss mask).
    """

    cost_model: DrafterCostModel | None = None
    block_size: int = anchors.DEFAULT_BLOCK_SIZE
    max_anchors: int = anchors.DEFAULT_MAX_ANCHORS
    anchor_policy: str = "cap"
    anchor_budget: int | None = None
    cost_fill: float = DEFAULT_COST_FILL
    anchor_seed: int | None = None
    store_anchors: bool = False

    def __post_init__(self):
        anchors.check_options(self.max_anchors, self.anchor_policy, self.block_size)
        if self.anchor_budget is not None and self.anchor_budget < self.max_anchors:
            raise ConfigError(f"--anchor-budget ({self.anchor_budget}) must hold one full sample's "
                              f"--max-anchors ({self.max_anchors})")
        if not 0.0 <= self.cost_fill <= 1.0:
            raise ConfigError(f"--cost-fill must lie in [0, 1], got {self.cost_fill}")

    def resolve(self, *, seed: int, token_budget: float) -> "DrafterOptions":
        """Defaults filled in from the plan: the anchor seed."""
        if self.cost_model is None:
            raise ConfigError("pack --objective dflash needs the model sizes of its cost model: "
                              "--target-config DIR (a transformers config.json) with --draft-layers N, or --target-dims")
        return replace(self, anchor_seed=int(seed if self.anchor_seed is None else self.anchor_seed))

    @classmethod
    def from_json(cls, d: dict) -> "DrafterOptions":
        d = dict(d)
        cm = d.get("cost_model")
        if cm is not None:
            d["cost_model"] = DrafterCostModel(**cm)
        return cls(**d)


@nb.njit(cache=True)
def _first_fit3(packed, k, c, tok_budget, anc_budget, cost_budget, max_bs, n_open, gen_of, close_rank):
    # First-fit on three resources; packed[i] = L << 32 | id, k[i], c[i] in arrival order.
    tok = np.zeros(n_open, np.float64)
    anc = np.zeros(n_open, np.float64)
    cst = np.zeros(n_open, np.float64)
    cnt = np.zeros(n_open, np.int64)
    gen = np.full(n_open, -1, np.int64)
    n_gen = 0
    m = 0
    for i in range(packed.shape[0]):
        L = np.float64(packed[i] >> np.int64(32))
        a = np.float64(k[i])
        x = c[i]
        s_fit = -1
        for s in range(n_open):
            if (gen[s] >= 0 and tok[s] + L <= tok_budget and anc[s] + a <= anc_budget
                    and cst[s] + x <= cost_budget and cnt[s] + 1 <= max_bs):
                s_fit = s
                break
        if s_fit < 0:
            for s in range(n_open):
                if gen[s] < 0:
                    s_fit = s
                    break
        if s_fit < 0:
            # none has room: close the fullest (highest fill fraction; lowest slot on ties)
            s_fit = 0
            best = -1.0
            for s in range(n_open):
                f = max(tok[s] / tok_budget, anc[s] / anc_budget, cst[s] / cost_budget)
                if f > best:
                    best = f
                    s_fit = s
            close_rank[gen[s_fit]] = m
            m += 1
            gen[s_fit] = -1
        if gen[s_fit] < 0:
            gen[s_fit] = n_gen
            n_gen += 1
            tok[s_fit] = 0.0
            anc[s_fit] = 0.0
            cst[s_fit] = 0.0
            cnt[s_fit] = 0
        tok[s_fit] += L
        anc[s_fit] += a
        cst[s_fit] += x
        cnt[s_fit] += 1
        gen_of[i] = gen[s_fit]
    for s in range(n_open):
        if gen[s] >= 0:
            close_rank[gen[s]] = m
            m += 1
    return m


def pack_drafter(lengths: np.ndarray, counts: np.ndarray, cost: np.ndarray, *, seed: int, epoch: int,
                 token_budget: float, anchor_budget: float, cost_budget: float | None,
                 max_batch_size: int | None = None, open_bins: int = 4):
    """Steps 1-2 of the module docstring. Returns ``(order, offsets, olens)`` as
    :func:`bucketing.pack_varlen` does. ``counts``/``cost`` are per sample id."""
    lengths = np.asarray(lengths)
    n = lengths.shape[0]
    if n >= 2**32:
        raise ConfigError(f"the drafter packer handles up to 2^32 samples, got {n}; split the dataset")
    if open_bins < 1:
        raise ConfigError(f"--open-bins must be at least 1, got {open_bins}")
    big = int(lengths.max())
    if big > token_budget:
        raise ConfigError(f"the longest sample ({big} tokens) exceeds the token budget {token_budget:.0f}; raise "
                          "--budget or truncate with tokenize --max-len")
    if int(np.max(counts)) > anchor_budget:
        raise ConfigError(f"a sample has {int(np.max(counts))} anchors, over --anchor-budget {anchor_budget:.0f}")
    cb = np.inf if not cost_budget else max(float(cost_budget), float(np.max(cost)))
    ids = (lengths.astype(np.int64) << np.int64(32)) | np.arange(n, dtype=np.int64)
    _shuffle_inplace(ids, np.uint64(mix_key(seed, epoch, PURPOSE_DFLASH)))
    sid = ids & np.int64(0xFFFFFFFF)
    k_in = np.asarray(counts)[sid]                        # arrival order, int32
    c_in = np.asarray(cost, np.float64)[sid]
    del sid
    idx = np.int32 if n < 2**31 else np.int64
    gen_of, close_rank = np.empty(n, idx), np.empty(n, idx)
    mbs = np.int64(max_batch_size) if max_batch_size else np.int64(2**62)
    m = _first_fit3(ids, k_in, c_in, float(token_budget), float(anchor_budget), cb, mbs, int(open_bins),
                    gen_of, close_rank)
    del k_in, c_in
    order, offsets, olens = np.empty(n, np.int64), np.empty(m + 1, np.int64), np.empty(n, np.int32)
    _group_by_batch(ids, gen_of, close_rank, m, order, offsets, olens)
    return order, offsets, olens


@dataclass
class DrafterEpoch:
    """Per-sample quantities of one drafter epoch (indexed by sample id)."""

    supervised: np.ndarray      # int32
    candidates: np.ndarray      # int32
    counts: np.ndarray          # int32 anchors per sample
    cost: np.ndarray            # float64 drafter FLOPs per sample
    cost_budget: float | None
    anchor_budget: int


def prepare(lens: np.ndarray, supervised: np.ndarray, candidates: np.ndarray, opts: DrafterOptions,
            token_budget: float) -> DrafterEpoch:
    """Anchor counts, per-sample costs and the cost budget (``opts`` resolved)."""
    counts = anchors.anchor_counts(candidates, supervised, opts.max_anchors, opts.anchor_policy, opts.block_size)
    cost = sample_cost(opts.cost_model, opts.block_size, lens, supervised, counts)
    per_token = float(cost.sum()) / float(np.asarray(lens).sum(dtype=np.int64))
    cb = opts.cost_fill * float(token_budget) * per_token if opts.cost_fill else None
    ab = opts.anchor_budget
    if ab is None:
        per_token_k = float(counts.sum(dtype=np.int64)) / float(np.asarray(lens).sum(dtype=np.int64))
        ab = max(int(np.ceil(ANCHOR_HEADROOM * float(token_budget) * per_token_k)), opts.max_anchors)
    return DrafterEpoch(supervised=supervised, candidates=candidates, counts=counts, cost=cost, cost_budget=cb,
                        anchor_budget=int(ab))


def epoch_extras(de: DrafterEpoch, opts: DrafterOptions, epoch: int, sample_ids: np.ndarray, mb_anchors: np.ndarray,
                 mb_tokens: np.ndarray, token_budget: float) -> tuple[dict, dict, np.ndarray]:
    """The manifest's drafter header and summary entries, and its ``anchor_counts`` array."""
    kc = de.counts[sample_ids]
    header = {"block_size": opts.block_size, "max_anchors": opts.max_anchors, "anchor_policy": opts.anchor_policy,
              "anchor_seed": opts.anchor_seed, "anchor_budget": de.anchor_budget, "cost_budget": de.cost_budget,
              "sampler_version": anchors.SAMPLER_VERSION,
              "cost_model": opts.cost_model.describe(opts.block_size),
              "anchor_digest": anchors.selection_digest(sample_ids, de.candidates, de.counts, seed=opts.anchor_seed,
                                                        epoch=epoch)}
    n_mb = max(len(mb_anchors), 1)
    summary = {"anchors": int(kc.sum(dtype=np.int64)), "useful_target_tokens": 1.0, "useful_anchor_slots": 1.0,
               "anchor_fill": float(mb_anchors.sum()) / (n_mb * de.anchor_budget),
               "token_fill": float(mb_tokens.sum()) / (n_mb * float(token_budget))}
    return header, summary, kc.astype(np.int32)


def dataset_masks(ds):
    """A mask reader over a :class:`dflash_prep.dataset.Dataset`: ids -> (masks, cu_seqlens)."""
    def read(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        parts = [ds.sample(int(i))[1] for i in ids]
        cu = np.zeros(len(parts) + 1, np.int64)
        np.cumsum([len(p) for p in parts], out=cu[1:])
        return (np.concatenate(parts) if parts else np.zeros(0, np.uint8)), cu
    return read


def regenerate(ids: np.ndarray, masks, opts: DrafterOptions, epoch: int, chunk: int = 4096):
    """Every anchor of ``ids`` from their masks, in order: ``(positions int32, offsets int64,
    supervised int32, candidates int32)``, read ``chunk`` samples at a time."""
    pos, counts, sup, cand = [], [], [], []
    for a in range(0, len(ids), chunk):
        part = np.asarray(ids[a:a + chunk], np.int64)
        m, cu = masks(part)
        p, off = anchors.sample_anchors_batch(m, cu, part, seed=opts.anchor_seed, epoch=epoch,
                                              max_anchors=opts.max_anchors, policy=opts.anchor_policy,
                                              block_size=opts.block_size)
        s, c = anchors.mask_counts(m, cu)
        pos.append(p)
        counts.append(np.diff(off))
        sup.append(s)
        cand.append(c)
    cat = (lambda xs, dt: np.concatenate(xs) if xs else np.zeros(0, dt))
    k = cat(counts, np.int64)
    offsets = np.zeros(len(k) + 1, np.int64)
    np.cumsum(k, out=offsets[1:])
    return cat(pos, np.int32), offsets, cat(sup, np.int32), cat(cand, np.int32)


def store_anchors(ids: np.ndarray, masks, opts: DrafterOptions, epoch: int, counts: np.ndarray) -> np.ndarray:
    """``anchors.npy``: every anchor position, concatenated in ``ids`` order (int32)."""
    pos, offsets, _, _ = regenerate(ids, masks, opts, epoch)
    if not np.array_equal(np.diff(offsets), np.asarray(counts, np.int64)):
        raise ConfigError("the loss masks give other anchor counts than supervised.npy/anchor_candidates.npy; "
                          "the dataset folder is inconsistent, re-run `dflash-prep tokenize --overwrite`")
    return pos


def drafter_options(*, target_config=None, target_dims: str | None = None, draft_layers: int = 1,
                    **options) -> DrafterOptions:
    """:class:`DrafterOptions` from the CLI's flags: the cost model from exactly one of a
    transformers config (``--target-config``) or explicit ``--target-dims``."""
    if (target_config is None) == (target_dims is None):
        raise ConfigError("--objective dflash needs the cost model's sizes from exactly one of --target-config DIR "
                          "(a transformers config.json) or --target-dims hidden=...,layers=...")
    cm = (DrafterCostModel.from_config(target_config, draft_layers) if target_config is not None
          else DrafterCostModel.from_dims(target_dims, draft_layers))
    return DrafterOptions(cost_model=cm, **options)


# ----------------------------------------------------------------------------- verify
def microbatch_cost(header: dict, lens: np.ndarray, supervised: np.ndarray, counts: np.ndarray,
                    offsets: np.ndarray) -> np.ndarray:
    """Drafter FLOPs per micro-batch from the cost model ``manifest.json`` records; the
    per-sample arrays are in micro-batch order (``offsets`` cut them)."""
    d = header["dflash"]
    sizes = {k: v for k, v in d["cost_model"].items() if k in DrafterCostModel.__dataclass_fields__}
    c = sample_cost(DrafterCostModel(**sizes), int(d["block_size"]), lens, supervised, counts)
    return np.add.reduceat(c, offsets[:-1]) if len(c) else np.zeros(0)


def verify_epoch(header: dict, arrays: dict, lens: np.ndarray, order: np.ndarray, offsets: np.ndarray,
                 masks, mask_counts, epoch: int) -> tuple[list[str], dict]:
    """The drafter checks of ``dflash-prep verify`` over one epoch; returns (problems, metrics).

    ``order``/``offsets`` are the micro-batches in file order. Regenerates every anchor from
    the masks with the recorded seed and options, and checks: the masks' counts against
    ``supervised.npy``/``anchor_candidates.npy``; ``anchor_counts.npy`` against the
    sampler's counts; every anchor sorted, distinct and eligible; the digest; ``anchors.npy``
    (when present) equal to the regenerated positions; the anchor and cost budgets.
    """
    d = header["dflash"]
    opts = DrafterOptions(block_size=int(d["block_size"]), max_anchors=int(d["max_anchors"]),
                          anchor_policy=d["anchor_policy"], anchor_seed=int(d["anchor_seed"]))
    ids = np.asarray(arrays["sample_ids"])
    problems = []
    if int(d.get("sampler_version", -1)) != anchors.SAMPLER_VERSION:
        problems.append(f"packed with anchor sampler v{d.get('sampler_version')}, this dflash-prep has "
                        f"v{anchors.SAMPLER_VERSION}: the trainer would draw other anchors; re-pack the epoch")
    sup_all, cand_all = mask_counts.supervised, mask_counts.anchor_candidates
    pos, off, sup, cand = regenerate(ids, masks, opts, epoch)
    if not (np.array_equal(sup, sup_all[ids]) and np.array_equal(cand, cand_all[ids])):
        problems.append("the loss masks disagree with supervised.npy/anchor_candidates.npy; re-tokenize the dataset")
    k = anchors.anchor_counts(cand_all, sup_all, opts.max_anchors, opts.anchor_policy, opts.block_size)
    stored = np.asarray(arrays["anchor_counts"])
    if not np.array_equal(stored, k[ids]) or not np.array_equal(np.diff(off), stored.astype(np.int64)):
        problems.append(f"anchor_counts.npy disagrees with the sampler in {int((stored != k[ids]).sum())} samples")
    for name, (p, o) in {"regenerated": (pos, off), "anchors.npy": (arrays.get("anchors"), off)}.items():
        if p is None or len(p) != o[-1]:
            if p is not None:
                problems.append(f"anchors.npy holds {len(p)} positions, the counts say {int(o[-1])}")
            continue
        bad = []
        for a in range(0, len(ids), 4096):
            m, cu = masks(ids[a:a + 4096])
            sub = o[a:a + 4097] - o[a]
            bad += (anchors.ineligible(m, cu, p[o[a]:o[min(a + 4096, len(ids))]], sub) + a).tolist()
        if bad:
            problems.append(f"{name}: {len(bad)} samples have anchors that are unsorted, repeated or not eligible "
                            f"(e.g. sample {int(ids[bad[0]])})")
    if "anchors" in arrays and len(arrays["anchors"]) == len(pos) and not np.array_equal(arrays["anchors"], pos):
        problems.append("anchors.npy differs from the anchors the sampler regenerates from the seed")
    digest = anchors.selection_digest(ids, cand_all, k, seed=opts.anchor_seed, epoch=epoch)
    if digest != d.get("anchor_digest"):
        problems.append(f"anchor digest {d.get('anchor_digest')} recorded, {digest} regenerated from the seed")
    ko = np.asarray(k, np.int64)[order]
    mb_k = np.add.reduceat(ko, offsets[:-1]) if len(order) else np.zeros(0, np.int64)
    if len(mb_k) and mb_k.max() > int(d["anchor_budget"]):
        problems.append(f"{int((mb_k > int(d['anchor_budget'])).sum())} micro-batches exceed the anchor budget "
                        f"{d['anchor_budget']}")
    cost = microbatch_cost(header, np.asarray(lens)[order], sup_all[order], ko, offsets)
    cb = d.get("cost_budget")
    if cb and len(cost) and cost.max() > max(float(cb), 0.0) * (1 + 1e-9):
        one = np.add.reduceat(np.ones(len(order), np.int64), offsets[:-1])
        if (cost[one > 1] > float(cb) * (1 + 1e-9)).any():      # a lone sample may exceed it
            problems.append(f"micro-batches exceed the cost budget {cb:.4g}")
    return problems, {"anchors": int(ko.sum())}


# ----------------------------------------------------------------------------- analyze
#: World size of analyze's drafter-cost balance prediction (DESIGN.md's benchmark W).
PREDICT_WORLD_SIZE = 8


def predict(lens: np.ndarray, supervised: np.ndarray, candidates: np.ndarray, opts: DrafterOptions,
            token_budget: float, *, seed: int, world_size: int = PREDICT_WORLD_SIZE) -> dict:
    """What ``pack --objective dflash`` will give, from one simulated epoch (epoch 0 of the
    real packer; ``analyze --objective dflash``): useful target tokens and anchor slots
    (1.0: varlen), token / anchor / cost fill, micro-batches, and the drafter-cost rank
    imbalance of LPT over ``world_size`` ranks at one micro-batch per rank."""
    from . import metrics, steps

    opts = opts.resolve(seed=seed, token_budget=token_budget)
    de = prepare(lens, supervised, candidates, opts, token_budget)
    order, offsets, _ = pack_drafter(lens, de.counts, de.cost, seed=seed, epoch=0, token_budget=token_budget,
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
    from .drafter_cost import cost_shares
    return {"useful_target_tokens": 1.0, "useful_anchor_slots": 1.0, "microbatches": int(len(cost)),
            "token_fill": float(tok.mean()) / token_budget, "anchor_fill": float(k.mean()) / de.anchor_budget,
            "cost_fill": float(cost.mean()) / de.cost_budget if de.cost_budget else None,
            "anchors": int(de.counts.sum(dtype=np.int64)), "anchor_budget": de.anchor_budget,
            "rank_imbalance": imb, "world_size": world_size,
            "anchor_cost_share": cost_shares(opts.cost_model, opts.block_size, lens, supervised, de.counts)["anchors"]}


def predict_source(src, opts: DrafterOptions, token_budget: float, *, seed: int) -> dict:
    """:func:`predict` for a tokenized dataset (a :class:`lengths.LengthSource` of kind dataset)."""
    from .lengths import read_mask_counts

    if src.kind != "dataset":
        raise ConfigError(f"{src.path}: --objective dflash needs a tokenized dataset folder (its loss-mask counts), "
                          "not a lengths file")
    mc = read_mask_counts(src.path)
    return predict(np.asarray(src.lengths), mc.supervised, mc.anchor_candidates, opts, token_budget, seed=seed)


# ----------------------------------------------------------------------------- trainer
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
