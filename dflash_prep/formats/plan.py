"""``plan.json``: what ``analyze`` decided and ``pack`` consumes.

Format ``dflash-prep/plan`` version 2. The fingerprint covers the data fingerprint and
every field that changes the batches (boundaries, budget, unit, alpha, caps, seed, window),
so two plans with equal fingerprints produce identical manifests, and a checkpoint can
refuse to resume under a different plan.

``file_fingerprint`` covers every field (so an edited ``predicted`` or ``data.path`` is
refused too). ``data.path`` is recorded relative to the plan file's folder and resolved against it on
:func:`load`, so pack and verify work from any working directory and the tree can move.
:func:`save` never replaces a file that is not a dflash-prep plan, and replaces a plan
with another fingerprint only with ``overwrite``.
"""

from __future__ import annotations

import math
import operator
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from dflash_prep.errors import ConfigError, DflashError, FingerprintMismatch
from dflash_prep.formats.fileio import atomic_write_json, fingerprint_json, holds_marker, read_json
from dflash_prep.formats.lengths import LengthSource

MAX_BUDGET = 2.0 ** 53  # a float that still counts tokens exactly

PLAN_FORMAT = "dflash-prep/plan"
PLAN_VERSION = 2  # v2: file_fingerprint over every field, data.path relative to the plan
PLAN_FILE = "plan.json"
#: Default limit on the repeat-pair rate (``analyze --max-repeat-pair``): at least 95% of the
#: pairs that share a micro-batch in one epoch share none in the next. ``pack`` warns above
#: the limit its plan records in ``predicted["max_repeat_pair"]``.
MAX_REPEAT_PAIR = 0.05
#: Largest seed: the keyed RNG (:func:`dflash_prep.pack.bucketing.mix_key`) folds 64-bit words.
SEED_MAX = 2 ** 64 - 1


def check_seed(seed, flag: str = "--seed") -> int:
    """``seed`` (or an epoch, which keys the shuffles too) as an int in ``[0, 2^64)``, else
    :class:`ConfigError`. The shuffles and anchor draws are keyed by its 64 bits, so a negative
    or larger value would shuffle exactly like another one (``2^64`` like ``0``) while its
    plan's (or epoch's) fingerprint claims it differs."""
    try:
        v = operator.index(seed)
    except TypeError:
        raise ConfigError(f"{flag} must be an integer, got {seed!r}") from None
    if not 0 <= v <= SEED_MAX:
        raise ConfigError(f"{flag} {v} is outside 0..{SEED_MAX} (2^64 - 1): the shuffles are keyed by 64 bits, "
                          f"so it would shuffle exactly like {flag} {v & SEED_MAX}; pass a value in that range")
    return v


@dataclass(frozen=True)
class Budget:
    """How much one micro-batch may hold.

    Attributes:
        unit: ``"tokens"``: ``n * max_len <= value``; ``"cost"``:
            ``n * (max_len + alpha * max_len**2) <= value``.
        value: T (tokens) or C (cost units).
        model_dim: d_model used for ``alpha = 1 / (12 * d_model)``; None means alpha = 0.
        max_batch_size: optional cap on samples per micro-batch.
    """

    unit: str = "tokens"
    value: float = 65536
    model_dim: int | None = None
    max_batch_size: int | None = None

    def __post_init__(self):
        if self.unit not in ("tokens", "cost"):
            raise ConfigError(f"--budget-unit must be 'tokens' or 'cost', got {self.unit!r}")
        if not isinstance(self.value, (int, float)) or not math.isfinite(self.value) or not 0 < self.value <= MAX_BUDGET:
            raise ConfigError(f"the budget must be a positive finite number (at most 2**53), got {self.value}")
        if self.unit == "cost" and not self.model_dim:
            raise ConfigError("--budget-unit cost needs --model-dim (alpha = 1 / (12 * d_model))")
        if self.model_dim is not None and self.model_dim <= 0:
            raise ConfigError(f"--model-dim must be positive, got {self.model_dim}")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ConfigError(f"--max-batch-size must be at least 1, got {self.max_batch_size}")

    @property
    def alpha(self) -> float:
        """The cost model's alpha (always from model_dim, used for balance reporting)."""
        return 0.0 if not self.model_dim else 1.0 / (12.0 * self.model_dim)

    @property
    def packing_alpha(self) -> float:
        """The alpha the budget check uses: 0 for a token budget."""
        return self.alpha if self.unit == "cost" else 0.0

    @property
    def batch_cap(self) -> int:
        """Samples per micro-batch at most: ``max_batch_size``, or 2^62 (no cap) for the kernels."""
        return int(self.max_batch_size) if self.max_batch_size else 2**62

    def to_json(self) -> dict:
        """The budget as manifests record it: its fields plus both alphas."""
        return dict(asdict(self), packing_alpha=self.packing_alpha, cost_alpha=self.alpha)


@dataclass(frozen=True)
class Plan:
    """Bucket boundaries and everything else ``pack`` needs to reproduce an epoch.

    ``boundaries`` has K-1 strictly increasing entries; bucket k holds lengths in
    ``[boundaries[k-1], boundaries[k])`` with an implicit 0 before and max_len + 1 after.
    """

    data: dict                      # LengthSource.describe(): kind, path, fingerprint, counts
    boundaries: tuple[int, ...]
    budget: Budget
    seed: int = 0
    window: int = 0                 # local sort window pack uses by default (0 = off)
    buckets: tuple[dict, ...] = ()  # per bucket: lo, hi, count, tokens, expected micro-batches
    predicted: dict = field(default_factory=dict)  # efficiency, fill, microbatches, how
    fingerprint: str = ""

    def __post_init__(self):
        b = list(self.boundaries)
        if any(int(x) <= 0 for x in b) or any(b2 <= b1 for b1, b2 in zip(b, b[1:])):
            raise ConfigError(f"bucket boundaries must be positive and strictly increasing, got {b}")
        if self.window < 0:
            raise ConfigError(f"--window must be >= 0, got {self.window}")
        check_seed(self.seed)

    @property
    def num_buckets(self) -> int:
        return len(self.boundaries) + 1

    def identity(self) -> dict:
        """The fields that determine the batches (what the fingerprint covers)."""
        return {"data_fingerprint": self.data["fingerprint"], "boundaries": [int(x) for x in self.boundaries],
                "budget": asdict(self.budget), "seed": int(self.seed), "window": int(self.window)}

    def with_fingerprint(self) -> "Plan":
        return replace(self, fingerprint=fingerprint_json(self.identity()))

    def check_data(self, src: LengthSource) -> None:
        if src.fingerprint != self.data["fingerprint"]:
            raise FingerprintMismatch(
                f"the plan was made for data {self.data['fingerprint']} ({self.data.get('path')}), but "
                f"{src.path} has fingerprint {src.fingerprint}; run `dflash-prep analyze` on this data first")

    def to_json(self) -> dict:
        d = asdict(self)
        d["boundaries"] = [int(x) for x in self.boundaries]
        d["buckets"] = list(self.buckets)
        return d


def _file_fingerprint(d: dict) -> str:
    """Covers every field of plan.json (``fingerprint`` covers only those that change batches)."""
    return fingerprint_json({k: v for k, v in d.items() if k not in ("format", "version", "file_fingerprint")})


def save(plan: Plan, path: str | Path, *, overwrite: bool = True) -> Path:
    """Write ``plan.json`` (into a folder, or to a ``.json`` path) atomically.

    Refuses a path that is a file of another kind, and, without ``overwrite``, a plan with
    another fingerprint; rewriting the same plan is allowed (a re-run of analyze).
    """
    path = Path(path)
    if path.is_dir() or path.suffix != ".json":
        if path.exists() and not path.is_dir():
            raise ConfigError(f"{path} is a file, not a folder; it was left untouched. Choose another --out")
        path = path / PLAN_FILE
    plan = plan.with_fingerprint()
    if path.exists():
        if path.is_dir() or not holds_marker(path.parent, path.name, PLAN_FORMAT):
            raise ConfigError(f"{path} exists and is not a dflash-prep plan; it was left untouched. Choose another --out")
        try:
            same = load(path).fingerprint == plan.fingerprint
        except DflashError:
            same = False
        if not same and not overwrite:
            raise ConfigError(f"{path} holds another plan (other data or options); pass --overwrite to replace it, "
                              "or choose another --out")
    d = plan.to_json()
    d["data"] = dict(d["data"])
    if d["data"].get("path"):
        d["data"]["path"] = os.path.relpath(Path(d["data"]["path"]).resolve(), path.parent.resolve())
    d["file_fingerprint"] = _file_fingerprint(d)
    atomic_write_json(path, d, format=PLAN_FORMAT, version=PLAN_VERSION)
    return path


def load(path: str | Path) -> Plan:
    path = Path(path)
    if path.is_dir():
        path = path / PLAN_FILE
    if not path.exists():
        raise ConfigError(f"{path}: plan not found; run `dflash-prep analyze DATA` to create it")
    d = read_json(path, format=PLAN_FORMAT, versions=(PLAN_VERSION,))
    if d.get("file_fingerprint") != _file_fingerprint(d):
        raise FingerprintMismatch(f"{path}: the plan's fields do not match its file_fingerprint (edited by hand or "
                                  "corrupt); re-run `dflash-prep analyze`")
    if isinstance(d.get("data"), dict) and d["data"].get("path"):
        d["data"] = dict(d["data"], path=str(path.parent / d["data"]["path"]))  # recorded relative to the plan
    try:
        plan = Plan(data=d["data"], boundaries=tuple(int(x) for x in d["boundaries"]), budget=Budget(**d["budget"]),
                    seed=int(d["seed"]), window=int(d.get("window", 0)), buckets=tuple(d.get("buckets", ())),
                    predicted=d.get("predicted", {}), fingerprint=d["fingerprint"])
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{path}: plan is missing or has a malformed field ({e}); re-run `dflash-prep analyze`") from e
    if plan.with_fingerprint().fingerprint != plan.fingerprint:
        raise FingerprintMismatch(f"{path}: the plan's contents do not match its fingerprint (edited by hand?); "
                                  "re-run `dflash-prep analyze`")
    return plan
