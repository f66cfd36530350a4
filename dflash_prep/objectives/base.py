"""The data side of a training objective, and the registry that finds one by name.

An objective (``lm``, ``dflash``, one a user registers) decides what ``pack`` optimises for
and what ``verify`` checks beyond the common layout. :class:`DataObjective` is its protocol;
its defaults are the plain next-token objective (token budgets, padded or varlen), so
``lm`` is the base class itself and another objective overrides what it changes. The core
(``pack``, ``verify``, ``analyze``, the CLI) asks only ``get(name)`` and calls these hooks;
it never tests which objective runs. The trainer side has its own registry
(:func:`dflash_prep.train.objectives.register_trainer`); both are keyed by the same name.

Register with :func:`register` (an instance); ``dflash_prep.objectives`` registers the
built-in ones on import.
"""

from __future__ import annotations

import numpy as np

from dflash_prep.errors import ConfigError
from dflash_prep.objectives import options as option_decl
from dflash_prep.pack import bucketing, metrics

_REGISTRY: dict[str, "DataObjective"] = {}


class DataObjective:
    """Hooks of one objective's data side; the defaults are the LM objective's."""

    name = "lm"
    #: layouts it packs; the first is the default
    layouts: tuple[str, ...] = ("padded", "varlen")
    #: its options (a frozen dataclass with ``from_json``, fields declared with
    #: :func:`dflash_prep.objectives.options.option`), or None: it has none
    options_type: type | None = None
    #: extra summary rows of ``analyze``'s prediction table (empty: no prediction)
    summary_keys: tuple[str, ...] = ()

    # --- options -------------------------------------------------------------------------
    def check(self, layout: str | None, options) -> None:
        """Refuse a layout or options this objective cannot pack (``PackConfig.__post_init__``)."""
        if layout is not None and layout not in self.layouts:
            raise ConfigError(f"--objective {self.name} packs the {' or '.join(self.layouts)} layout only; "
                              f"drop --layout {layout}")
        if self.options_type is None and options is not None:
            raise ConfigError(f"--objective {self.name} takes no objective options; they belong to another "
                              "--objective")
        if self.options_type is not None and not isinstance(options, self.options_type):
            raise ConfigError(f"--objective {self.name} needs its options ({self.options_type.__name__})")

    def resolve(self, options, *, plan, budget):
        """``options`` with what the plan decides filled in (``PackConfig.resolve``)."""
        return options

    def options_from_flags(self, command: str, values: dict):
        """Its options from ``command``'s flag values (None: it has none); the flags are the
        ones :attr:`options_type` declares (:func:`dflash_prep.objectives.options.flags`)."""
        return None if self.options_type is None else option_decl.from_flags(self.options_type, command, values)

    def options_from_json(self, d: dict | None):
        return None if d is None or self.options_type is None else self.options_type.from_json(d)

    def cli_flags(self, options) -> str:
        """The ``pack`` flags that reproduce ``options`` (after ``--objective NAME``)."""
        return "" if options is None else option_decl.to_flags(options, option_decl.PACK)

    # --- pack ------------------------------------------------------------------------------
    def inputs(self, cfg, src):
        """What an epoch reads besides the lengths: ``(mask_counts, dataset)``, each or None."""
        return None, None

    def begin_epoch(self, lens: np.ndarray, cfg, epoch: int, mask_counts):
        """Per-epoch state for the hooks below (None: none); :meth:`end_epoch` always follows."""
        return None

    def end_epoch(self, state) -> None:
        pass

    def pack(self, lens: np.ndarray, plan, cfg, epoch: int, state):
        """``(order, offsets, bucket, olens)``: micro-batches in packing order."""
        if cfg.layout == "padded":
            return bucketing.pack_padded(lens, plan.boundaries, seed=plan.seed, epoch=epoch, budget=cfg.budget,
                                         window=cfg.window)
        order, offsets, olens = bucketing.pack_varlen(lens, seed=plan.seed, epoch=epoch, budget=cfg.budget,
                                                      open_bins=cfg.open_bins)
        return order, offsets, np.full(len(offsets) - 1, -1, np.int64), olens

    def rank_cost(self, cfg, state, order, offsets, se):
        """``(cost, padded)`` per packed micro-batch: what ranks are balanced on, and the padded
        tokens (``se``: :class:`dflash_prep.pack.steps.ScheduledEpoch`)."""
        alpha = cfg.budget.alpha
        if cfg.layout == "padded":
            mxf = se.mx.astype(np.float64)
            return se.count * (mxf + alpha * mxf * mxf), se.count * se.mx
        return se.real + alpha * se.sq.astype(np.float64), se.real

    #: the manifest summary's ``rank_imbalance_cost``
    rank_cost_name = "tokens"

    def finish_epoch(self, state, cfg, epoch: int, arrays: dict, header: dict, summary: dict, rows, dataset) -> None:
        """Add this objective's arrays, header section and summary entries to an epoch
        (``rows``: :class:`dflash_prep.pack.pack.Rows`, the manifest rows' start, count, real)."""

    def predicts_plan(self, cfg) -> bool:
        """Does analyze's efficiency prediction hold for this packing (``cfg`` resolved)?"""
        return cfg.layout == "padded"

    # --- manifest and verify ---------------------------------------------------------------
    def required_arrays(self, header: dict) -> list[str]:
        return []

    def verify(self, m, lens, ids, offsets, src):
        """``(problems, extra metrics, state)`` of this objective's checks of a manifest."""
        return [], {}, None

    def verify_rank_cost(self, m, lens, order, offsets, state) -> np.ndarray:
        """What ranks were balanced on, per micro-batch, recomputed from scratch."""
        b = m.header["budget"]
        return metrics.batch_cost(lens, order, offsets, float(b["cost_alpha"]), varlen=m.layout == "varlen")

    # --- analyze -----------------------------------------------------------------------------
    def states_estimate(self, options, tokens: int) -> str | None:
        """One line: the size of the target's states cache (``dflash-prep extract``) for ``tokens``
        tokens with ``options``' target sizes; None: this objective reads no target states, or the
        options do not say the target's sizes."""
        return None

    def predict(self, src, options, budget, *, seed: int) -> dict | None:
        """``analyze``'s prediction of ``pack --objective NAME`` (None: nothing beyond the plan)."""
        return None

    # --- a frozen target's hidden states (extract, the states cache, a target in an engine) ---
    #: does it train on a frozen target's hidden states (``dflash-prep extract --objective NAME``)?
    reads_states = False
    #: what it always reads of the target, in words (EAGLE-3: its three taps and the final state),
    #: when ``--draft-layers`` and ``--loss`` do not choose it; None: they do (DFlash)
    fixed_states: str | None = None
    #: the draft layers whose taps a states cache holds when ``extract --draft-layers`` is unset
    default_draft_layers: int | None = None

    def states_need(self, num_target_layers: int, *, draft_layers: int | None = None, target_layer_ids=(),
                    loss: str = "ce"):
        """What it reads of an ``L``-layer target, a :class:`~.target_taps.StatesNeed`
        (:mod:`.target_taps` has the rules); only an objective that :attr:`reads_states` has one."""
        raise ConfigError(f"--objective {self.name} reads no target hidden states; one of "
                          f"{', '.join(state_readers())} does")

    # --- its exports in an inference engine (dflash-prep evaluate) --------------------------------
    #: how an engine serves its exports (:class:`~.serving.Serving`; None: none is served as a drafter)
    serving = None


def register(objective: DataObjective) -> DataObjective:
    """Make ``objective`` findable by ``objective.name`` (a second one of a name replaces it)."""
    _REGISTRY[objective.name] = objective
    return objective


def get(name: str) -> DataObjective:
    if name not in _REGISTRY:
        raise ConfigError(f"--objective must be one of {', '.join(_REGISTRY)}, got {name!r}")
    return _REGISTRY[name]


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def registered() -> tuple["DataObjective", ...]:
    """Every registered objective, in registration order."""
    return tuple(_REGISTRY.values())


def state_readers() -> tuple[str, ...]:
    """The objectives trained on a frozen target's hidden states, in registration order."""
    return tuple(o.name for o in _REGISTRY.values() if o.reads_states)


def served() -> dict[str, "DataObjective"]:
    """Export architecture -> the objective whose exports declare it (those an engine serves)."""
    return {o.serving.architecture: o for o in _REGISTRY.values() if o.serving is not None}


def of_header(header: dict) -> DataObjective:
    """The objective a manifest header was packed for."""
    return get((header.get("options") or {}).get("objective", "lm"))
