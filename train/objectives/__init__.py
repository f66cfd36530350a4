"""What a run trains and how one micro-batch becomes a loss: the trainer side of an objective.

Each objective is one folder here (``lm/``, ``dflash/``, ...: its options, model, objective,
export and decoding pieces) registered by one line at the bottom of this file
(:func:`~.registry.register` of its :class:`~.registry.TrainerSpec`; the data side of the same
name is in :mod:`dflash_prep.objectives`).
The training loop (:mod:`dflash_prep.train.loop`) is objective-agnostic: it builds the one
``cfg.objective`` names (:func:`build_objective`) and asks it for

- ``model``: the trainable module (optimizer, checkpoint, gradient all-reduce);
- ``build(ds, mb, epoch, pin)``: one manifest micro-batch as tensors (run on the prefetch thread);
- ``denominator(batch)``: the batch's share of the step's loss normaliser (LM: target tokens;
  DFlash: the sum of block weights), all-reduced over ranks and accumulation before any backward;
  an objective with ``deferred_denominator`` (DFlash under D-PACE, whose weights come out of the
  forward) gives it after the forward instead, ``denominator_from(stats)`` of the all-reduced stats;
- ``loss(batch, autocast)``: ``(loss_sum, stats)``; the loop backpropagates ``loss_sum / N``
  and all-reduces ``stats`` (float64, ``stats_width`` entries) once per step;
- ``metrics(stats, N)``: the step's logged metrics; ``flops(batch)`` for MFU; ``targets(N)``:
  the normaliser as logged; ``head_shape()``: ``(V, H)`` of the LM head the loss runs through,
  the matmul a CPU run measures its rate on (:mod:`dflash_prep.train.matmul_peak`);
- ``describe()``: a line for the log at the start (or None); ``check_epoch(epoch, manifest)``:
  refuse an epoch packed otherwise; ``log_fields(step, dt)``: its own entries of a step's
  log record; ``run_summary(time_s)``: its own entries of ``summary.json``;
- ``contract()``: what besides the data plan fixes the run (resume refuses a change, naming it);
- ``model_config()``: the module's shape (resume refuses a change); ``finish(out)``: final exports.

:class:`~dflash_prep.train.objectives.lm.LMObjective` trains the small decoder or a transformers LM;
:class:`~dflash_prep.train.objectives.dflash.objective.DFlashObjective` trains a drafter on a frozen target.
"""

from __future__ import annotations

import torch

from dflash_prep.errors import ConfigError
from dflash_prep.train.objectives import dflash, dflash2, eagle3, lm
from dflash_prep.train.objectives.lm import LMObjective
from dflash_prep.train.objectives.registry import TrainerSpec, get, register, specs


def _split_spec(cfg) -> TrainerSpec:
    spec = get(cfg.objective)
    if spec.serve is None:
        servers = [s.name for s in specs() if s.serve is not None]
        raise ConfigError(f"--target-ranks {cfg.target_ranks}: --objective {cfg.objective} has no frozen target to "
                          f"put on its own ranks; drop --target-ranks or use --objective {' / '.join(servers)}")
    return spec


def build_objective(cfg, ds, device: torch.device, manifest=None, place=None):
    """The objective ``cfg`` asks for, its module on ``device`` (seeded with ``cfg.seed``); ``place``:
    a split job's drafter rank (:mod:`dflash_prep.train.split`), whose objective gets its target's
    output from a target rank."""
    spec = get(cfg.objective)
    torch.manual_seed(cfg.seed)
    if place is None:
        return spec.build(cfg, ds, device, manifest)
    return _split_spec(cfg).build(cfg, ds, device, manifest, place=place)


def serve_target(cfg, place, d, source=None) -> dict:
    """Run a split job's target rank for ``cfg.objective`` (:mod:`dflash_prep.train.split`) over
    ``source`` (None: the files ``cfg`` names); returns its summary."""
    return _split_spec(cfg).serve(cfg, place, d, source)


register(lm.SPEC)
register(dflash.SPEC)
register(dflash2.SPEC)
register(eagle3.SPEC)

__all__ = ["LMObjective", "TrainerSpec", "build_objective", "register", "serve_target"]
