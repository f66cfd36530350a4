"""The pack options, declared once: :class:`PackConfig`, and its file ``pack_config.json``.

The CLI builds a :class:`PackConfig` from its flags, :func:`dflash_prep.pack.pack_epochs`
packs with it, and the trainer reads it back from the manifest root (:func:`load`) to pack
a missing epoch exactly as its neighbours were packed. :meth:`PackConfig.resolve` fills
what the plan decides (window, budget, layout, anchor seed); the fingerprint of the
resolved config is part of every epoch's ``inputs_fingerprint``.

``<root>/pack_config.json``: format ``dflash-prep/pack-config`` version 1, the resolved
config (:meth:`PackConfig.to_json`), its ``plan_fingerprint`` and its ``fingerprint``.
Written atomically by every ``pack`` call; :func:`load` checks format, version and
fingerprint.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

from . import steps
from .errors import ConfigError, FingerprintMismatch
from .fileio import atomic_write_json, fingerprint_json, read_json
from .pack_dflash import OBJECTIVES, DrafterOptions
from .manifest import LAYOUTS
from .plan import Budget, Plan

PACK_CONFIG_FORMAT = "dflash-prep/pack-config"
PACK_CONFIG_VERSION = 1
PACK_CONFIG_FILE = "pack_config.json"


@dataclass(frozen=True)
class PackConfig:
    """How an epoch's micro-batches are formed and become steps (the plan fixes buckets,
    budget and seed).

    Attributes:
        world_size: W, ranks per optimizer step.
        grad_accum: A, accumulation micro-batches per rank per step.
        layout: ``"padded"`` (bucketed, ``n * max_len <= T``) or ``"varlen"``
            (concatenated with ``cu_seqlens``, ``sum L <= T``); None: padded, or varlen
            under the ``dflash`` objective (the only layout it packs).
        schedule: one of :data:`steps.SCHEDULES`; ``class-aware`` mixes lengths best.
        window: local sort window (padded); None uses the plan's.
        drop_last: drop the last ``M mod (W*A)`` scheduled micro-batches (their samples are
            listed in ``dropped_ids.npy`` and counted) instead of splitting micro-batches.
        open_bins: open bins of the varlen first-fit (4 fills 0.9975 on seedlike).
        budget: replaces the plan's budget (unit, value, model_dim, max_batch_size); None
            keeps it. Analyze's efficiency prediction then no longer applies.
        objective: ``lm`` (token budgets) or ``dflash`` (drafter training: token and anchor
            budgets, ranks balanced on the drafter step cost, :mod:`dflash_prep.pack_dflash`).
        drafter: the drafter options; required by ``objective="dflash"``, else None.
    """

    world_size: int = 1
    grad_accum: int = 1
    layout: str | None = None
    schedule: str = "class-aware"
    window: int | None = None
    drop_last: bool = False
    open_bins: int = 4
    budget: Budget | None = None
    objective: str = "lm"
    drafter: DrafterOptions | None = None

    def __post_init__(self):
        if self.world_size < 1 or self.grad_accum < 1:
            raise ConfigError(f"--world-size and --grad-accum must be >= 1, got {self.world_size} and {self.grad_accum}")
        if self.layout is not None and self.layout not in LAYOUTS:
            raise ConfigError(f"--layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.schedule not in steps.SCHEDULES:
            raise ConfigError(f"--schedule must be one of {', '.join(steps.SCHEDULES)}, got {self.schedule!r}")
        if self.window is not None and self.window < 0:
            raise ConfigError(f"--window must be >= 0, got {self.window}")
        if self.open_bins < 1:
            raise ConfigError(f"--open-bins must be >= 1, got {self.open_bins}")
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.objective == "dflash":
            if self.layout == "padded":
                raise ConfigError("--objective dflash packs the varlen layout only (padding wastes target tokens "
                                  "and anchor slots); drop --layout padded")
            if self.drafter is None:
                raise ConfigError("--objective dflash needs drafter options (DrafterOptions)")
        elif self.drafter is not None:
            raise ConfigError("drafter options (--block-size, --max-anchors, ...) need --objective dflash")

    @property
    def step_size(self) -> int:
        return self.world_size * self.grad_accum

    def resolve(self, plan: Plan) -> "PackConfig":
        """Every default filled in from ``plan``: what an epoch is actually packed with."""
        budget = self.budget or plan.budget
        drafter = None
        if self.objective == "dflash":
            if budget.unit != "tokens":
                raise ConfigError("--objective dflash takes a token budget T (target forward memory); the cost "
                                  "budget is its own (--cost-fill): pass --budget-unit tokens")
            drafter = self.drafter.resolve(seed=plan.seed, token_budget=budget.value)
        return replace(self, layout=self.layout or ("varlen" if self.objective == "dflash" else "padded"),
                       window=plan.window if self.window is None else self.window, budget=budget, drafter=drafter)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "PackConfig":
        d = dict(d)
        if d.get("budget") is not None:
            d["budget"] = Budget(**d["budget"])
        if d.get("drafter") is not None:
            d["drafter"] = DrafterOptions.from_json(d["drafter"])
        try:
            return cls(**d)
        except TypeError as e:
            raise ConfigError(f"pack config: unknown or missing field ({e}); re-pack with this dflash-prep") from None

    def fingerprint(self) -> str:
        return fingerprint_json(self.to_json())

    def cli_flags(self) -> str:
        """The ``dflash-prep pack`` flags that reproduce this config (for messages)."""
        f = f" --world-size {self.world_size} --grad-accum {self.grad_accum} --schedule {self.schedule}"
        f += f" --layout {self.layout}" if self.layout else ""
        f += f" --window {self.window}" if self.window is not None else ""
        f += " --drop-last" if self.drop_last else ""
        if self.budget is not None:
            b = self.budget
            f += f" --budget-unit {b.unit} --budget {b.value:g}" + (f" --model-dim {b.model_dim}" if b.model_dim else "")
        if self.drafter is not None:
            d = self.drafter
            f += (f" --objective dflash --block-size {d.block_size} --max-anchors {d.max_anchors} "
                  f"--anchor-policy {d.anchor_policy} --cost-fill {d.cost_fill:g}")
            f += f" --anchor-budget {d.anchor_budget}" if d.anchor_budget is not None else ""
            f += f" --anchor-seed {d.anchor_seed}" if d.anchor_seed is not None else ""
            f += " --store-anchors" if d.store_anchors else ""
            if d.cost_model is not None:
                cm = asdict(d.cost_model)
                layers, window = cm.pop("draft_layers"), cm.pop("sliding_window")
                f += " --target-dims " + ",".join(f"{k}={v}" for k, v in cm.items()) + f" --draft-layers {layers}"
                f += f" --sliding-window {window}" if window else ""
        return f


def save(root: str | Path, cfg: PackConfig, plan: Plan) -> Path:
    """Write ``<root>/pack_config.json`` (the config resolved against ``plan``)."""
    r = cfg.resolve(plan)
    path = Path(root) / PACK_CONFIG_FILE
    atomic_write_json(path, {"config": r.to_json(), "plan_fingerprint": plan.fingerprint,
                             "fingerprint": r.fingerprint()}, format=PACK_CONFIG_FORMAT, version=PACK_CONFIG_VERSION)
    return path


def load(root: str | Path) -> PackConfig | None:
    """The config the epochs under ``root`` were packed with, or None when there is none."""
    path = Path(root) / PACK_CONFIG_FILE
    if not path.is_file():
        return None
    d = read_json(path, format=PACK_CONFIG_FORMAT, versions=(PACK_CONFIG_VERSION,))
    cfg = PackConfig.from_json(d.get("config", {}))
    if cfg.fingerprint() != d.get("fingerprint"):
        raise FingerprintMismatch(f"{path}: contents do not match its fingerprint (edited by hand?); re-run "
                                  "`dflash-prep pack` for this root")
    return cfg
