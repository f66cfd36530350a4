"""The pack options, declared once: :class:`PackConfig`, and its file ``pack_config.json``.

The CLI builds a :class:`PackConfig` from its flags, :func:`dflash_prep.pack.pack.pack_epochs`
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

from dflash_prep import objectives
from dflash_prep.errors import ConfigError, FingerprintMismatch
from dflash_prep.formats.fileio import atomic_write_json, fingerprint_json, read_json
from dflash_prep.formats.manifest import LAYOUTS
from dflash_prep.formats.plan import Budget, Plan
from dflash_prep.pack import steps

PACK_CONFIG_FORMAT = "dflash-prep/pack-config"
PACK_CONFIG_VERSION = 1
PACK_CONFIG_FILE = "pack_config.json"
#: the JSON key of the objective's options: named when dflash was the only objective with
#: options, and kept so that every existing root and epoch keeps its fingerprint
OPTIONS_KEY = "drafter"


@dataclass(frozen=True)
class PackConfig:
    """How an epoch's micro-batches are formed and become steps (the plan fixes buckets,
    budget and seed).

    Attributes:
        world_size: W, ranks per optimizer step.
        grad_accum: A, accumulation micro-batches per rank per step.
        layout: ``"padded"`` (bucketed, ``n * max_len <= T``) or ``"varlen"``
            (concatenated with ``cu_seqlens``, ``sum L <= T``); None: the objective's
            first layout (padded for ``lm``, varlen for ``dflash``, the only one it packs).
        schedule: one of :data:`steps.SCHEDULES`; ``class-aware`` mixes lengths best.
        window: local sort window (padded); None uses the plan's.
        drop_last: drop the last ``M mod (W*A)`` scheduled micro-batches (their samples are
            listed in ``dropped_ids.npy`` and counted) instead of splitting micro-batches.
        open_bins: open bins of the varlen first-fit (more bins fill better, with diminishing
            returns; the default's fill: docs/benchmarks.md#pack).
        budget: replaces the plan's budget (unit, value, model_dim, max_batch_size); None
            keeps it. Analyze's efficiency prediction then no longer applies.
        objective: a registered objective (:mod:`dflash_prep.objectives`): ``lm`` (token
            budgets) or ``dflash`` (drafter training: token and anchor budgets, ranks balanced
            on the drafter step cost, :mod:`dflash_prep.objectives.dflash`).
        options: the objective's options (``dflash``: its ``DrafterOptions``); None for
            an objective without options.
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
    options: object | None = None

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
        objectives.get(self.objective).check(self.layout, self.options)

    @property
    def step_size(self) -> int:
        return self.world_size * self.grad_accum

    def resolve(self, plan: Plan) -> "PackConfig":
        """Every default filled in from ``plan``: what an epoch is actually packed with."""
        budget = self.budget or plan.budget
        obj = objectives.get(self.objective)
        opts = obj.resolve(self.options, plan=plan, budget=budget)
        return replace(self, layout=self.layout or obj.layouts[0],
                       window=plan.window if self.window is None else self.window, budget=budget, options=opts)

    def to_json(self) -> dict:
        d = asdict(self)
        d[OPTIONS_KEY] = d.pop("options")
        return d

    @classmethod
    def from_json(cls, d: dict) -> "PackConfig":
        d = dict(d)
        if d.get("budget") is not None:
            d["budget"] = Budget(**d["budget"])
        try:
            d["options"] = objectives.get(d.get("objective", "lm")).options_from_json(d.pop(OPTIONS_KEY, None))
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
        if self.options is not None:
            f += f" --objective {self.objective}" + objectives.get(self.objective).cli_flags(self.options)
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
