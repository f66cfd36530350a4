"""The DFlash objective's trainer options, declared once (:func:`dflash_prep.objectives.options.option`).

Each field gives the ``python -m dflash_prep.train`` flag (``--field-name``, in the ``--help``
panel ``Objective dflash``), the config-file key (the same name, at the top level of the TOML
file) and its check (``__post_init__``). A field that can also come from the manifests
(``pack --objective dflash`` records the block size, the anchors and the drafter's window) is
``None`` when left unset: the manifest's value, else the pack default. ``dflash2`` extends this
class (:mod:`dflash_prep.train.objectives.dflash2.options`).

What fixes a run beyond its data plan (the run contract, which resume checks) is the resolved
value of these options: :meth:`~dflash_prep.train.objectives.dflash.objective.DFlashObjective.contract`.
The anchor options (the fields of :data:`ANCHOR_OPTIONS`, pack's :class:`DrafterOptions` of the
same names) resolve to an :class:`AnchorSpec` (:func:`anchor_spec`: a manifest's win).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dflash_prep.errors import ConfigError
from dflash_prep.objectives import anchors
from dflash_prep.objectives.dflash import RECIPE_DRAFT_LAYERS, RECIPE_SLIDING_WINDOW, DrafterOptions
from dflash_prep.objectives.options import TRAIN, from_header, option, shared_help

SLOT_WEIGHTS = ("decay", "dpace")
INIT_LAYERS = ("random", "target")
LOSSES = ("ce", "kl")
ANCHOR_OPTIONS = ("block_size", "max_anchors", "anchor_policy", "anchor_seed")
"""The fields that say how anchors are drawn: pack's (:class:`DrafterOptions`, recorded in the
manifest header) and the trainer's of the same names (None: the manifest's)."""


def _train(default, help: str, **kw):
    return option(default, help=help, commands=(TRAIN,), **kw)


@dataclass(frozen=True)
class DFlashTrainOptions:
    """A DFlash drafter on a frozen target: the model, the anchors, the loss (docs/dflash.md)."""

    target: str = _train("", help="the frozen target, a local transformers causal-LM folder with its tokenizer "
                         "(required)")
    draft_layers: int = _train(RECIPE_DRAFT_LAYERS, help="draft layers N (the taps are build_target_layer_ids(L, N) "
                               "unless --target-layer-ids); the recipe's (speculators RFC #979), as pack "
                               "--draft-layers's")
    target_layer_ids: tuple[int, ...] = _train((), help="tapped target layers (0-based, each layer's output); empty "
                                               "= the objective's rule (dflash: build_target_layer_ids(L, N); "
                                               "eagle3: 1, L/2 - 1, L - 4, three distinct ids)")
    block_size: int | None = _train(None, help=shared_help(DrafterOptions, "block_size", None,
                                                           "16 (dflash) or 8 (dflash2)"))
    slot_weights: str = _train("dpace", help="decay (exp(-(r-1)/gamma)) or dpace (D-PACE, from the drafter's "
                               "confidence in the forward)")
    gamma: float | None = _train(None, help="slot-weight decay exp(-(r-1)/gamma); unset = the rule (B - 2) / 2 "
                                 "(7 at B = 16)")
    dpace_alpha: float = _train(0.5, help="D-PACE smoothing alpha in (0, 1] (q~ = (1 - alpha) q + alpha)")
    loss: str = _train("ce", help="ce on the data token, or kl from the target's next-token distribution")
    kl_temperature: float = _train(1.0, help="temperature of both distributions under --loss kl")
    sliding_window: int = _train(RECIPE_SLIDING_WINDOW, help="sliding-window attention W of every draft layer (0 = "
                                 "full, else at least B; the recipe's, pack's default): slot r of block j sees "
                                 "context positions >= a_j + r - W + 1 only (the public sliding_attention rule)")
    max_anchors: int | None = _train(None, help=shared_help(DrafterOptions, "max_anchors", None))
    anchor_policy: str | None = _train(None, help=shared_help(DrafterOptions, "anchor_policy", None))
    anchor_seed: int | None = _train(None, help=shared_help(
        DrafterOptions, "anchor_seed", None, "--seed; a value that contradicts the manifest is refused (its budgets "
        "assume its anchors)"))
    init_layers: str = _train("random", help="how the draft layers start: random (N(0, 0.02), the public init) or "
                              "target (copies of the target's last N layers and final norm, fc the mean of the "
                              "taps: docs/real-target.md#what-moves-tau)")
    mask_token_id: int | None = _train(None, help="mask token id, refused if it occurs in the data; unset = a resumed "
                                       "run's, else the tokenizer's mask token, <|mask|>, the first row past the "
                                       "tokenizer, or the lowest special token unused in the data")

    #: the optimizer of the recipe when ``--optimizer`` is left empty
    optimizer = "muon"
    #: block size when neither the flag nor a manifest sets it (pack's default)
    default_block_size = anchors.DEFAULT_BLOCK_SIZE

    def __post_init__(self):
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if not self.target:
            raise ConfigError(f"--objective {self.objective_name()} needs --target DIR (a local transformers "
                              "causal-LM folder)")
        if self.draft_layers < 1:
            raise ConfigError(f"--draft-layers must be at least 1, got {self.draft_layers}")
        anchors.check_options(self.max_anchors or 1, self.anchor_policy or anchors.DEFAULT_POLICY,
                              self.block_size or 2)
        if self.gamma is not None and not (math.isfinite(self.gamma) and self.gamma > 0):
            raise ConfigError(f"--gamma must be a finite number > 0 (unset = the default rule), got {self.gamma}")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise ConfigError(f"--mask-token-id must be >= 0 (unset = the tokenizer's), got {self.mask_token_id}")
        if self.sliding_window < 0:
            raise ConfigError(f"--sliding-window must be >= 0 (0 = full attention), got {self.sliding_window}")
        for flag, v, ok in (("--slot-weights", self.slot_weights, SLOT_WEIGHTS), ("--loss", self.loss, LOSSES),
                            ("--init-layers", self.init_layers, INIT_LAYERS)):
            if v not in ok:
                raise ConfigError(f"{flag} must be one of {', '.join(ok)}, got {v!r}")
        if isinstance(self.dpace_alpha, bool) or not isinstance(self.dpace_alpha, (int, float)) \
                or not 0.0 < self.dpace_alpha <= 1.0:
            raise ConfigError(f"--dpace-alpha must be in (0, 1], got {self.dpace_alpha!r}")
        kt = self.kl_temperature
        if isinstance(kt, bool) or not isinstance(kt, (int, float)) or not math.isfinite(kt) or kt <= 0:
            raise ConfigError(f"--kl-temperature must be a finite number > 0, got {kt!r}")

    @classmethod
    def objective_name(cls) -> str:
        return "dflash"


@dataclass(frozen=True)
class AnchorSpec:
    """How anchors are drawn (:func:`dflash_prep.objectives.anchors.sample_anchors_batch`'s keys):
    the anchor options resolved, part of the run contract."""

    seed: int
    max_anchors: int
    policy: str
    block_size: int

    def to_dict(self) -> dict:
        return {"seed": int(self.seed), "max_anchors": int(self.max_anchors), "policy": self.policy,
                "block_size": int(self.block_size), "sampler_version": anchors.SAMPLER_VERSION}


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
    if int(d.get("sampler_version", -1)) != anchors.SAMPLER_VERSION:
        raise ConfigError(f"manifest epoch {manifest.epoch} was packed with anchor sampler v{d.get('sampler_version')}, "
                          f"this trainer draws with v{anchors.SAMPLER_VERSION}; re-pack it "
                          "(`dflash-prep pack ... --overwrite`)")
    o = from_header(DrafterOptions, d)
    for name in ANCHOR_OPTIONS:
        want, theirs = getattr(mine, name), getattr(o, name)
        if want is not None and want != theirs:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} {want} contradicts the manifest, packed with {theirs} (pack --objective "
                              f"dflash); drop {flag} or re-pack with it")
    return AnchorSpec(seed=int(o.anchor_seed), max_anchors=o.max_anchors, policy=o.anchor_policy,
                      block_size=o.block_size), "the manifest"
