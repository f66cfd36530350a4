"""What every drafter objective trained on a frozen target shares (DFlash, DFlash2, EAGLE-3).

:class:`DrafterObjective` is the loop's objective protocol (:mod:`dflash_prep.train.objectives`)
for a drafter reading a frozen target through a taps provider (:mod:`dflash_prep.train.split.taps`:
the target in this process, or a split job's target rank): the step normaliser read from the
all-reduced stats (their last entry), the per-step metrics a log record keeps (:attr:`log_keys`,
plus where the step's time went on a split job), the acceptance-length history ``summary.json``
reports (``tau_first`` / ``tau_last``: means of the first and last up-to-5 steps), the optimizer
line of the start-up description, and the export that ``python -m dflash_prep.train.export``
writes from the checkpoint (nothing is written at the end of the run itself).
"""

from __future__ import annotations

import torch


class DrafterObjective:
    """A drafter on a frozen target; a subclass sets ``model``, ``target`` (a taps provider) and
    ``cfg``, builds batches, and computes the loss and metrics (its stats' last entry is ``sum w``)."""

    #: the step metrics a log record keeps (those the step has)
    log_keys: tuple[str, ...] = ("tau", "acc")

    def __init__(self):
        self._taus: list[float] = []

    @staticmethod
    def denominator_from(stats: torch.Tensor) -> float:
        """The step's ``sum w`` from the all-reduced stats (their last entry)."""
        return float(stats[-1])

    @staticmethod
    def targets(denom: float) -> float:
        return denom

    def read_ahead(self, b) -> None:
        """On the prefetch thread, after ``build``: what the taps provider reads ahead for micro-batch
        ``b`` (a states cache: its states, train/cached_taps.py; a live target: nothing)."""
        ahead = getattr(self.target, "read_ahead", None)
        if ahead is not None:
            ahead(b)

    def close(self) -> None:
        """At the run's end, however it ends: stop what the taps provider started (the target in
        vLLM, train/engine_taps.py; the other providers hold no process)."""
        close = getattr(self.target, "close", None)
        if close is not None:
            close()

    def head_shape(self) -> tuple[int, int]:
        """``(V, H)`` of the target's head, the loss's biggest matmul (a CPU run's measured matmul,
        train/matmul_peak.py)."""
        return tuple(self.target.lm_head.weight.shape)

    def optimizer_text(self) -> str:
        from dflash_prep.train.optim import muon_lr

        cfg = self.cfg
        return f"muon lr={muon_lr(cfg):g} + adamw lr={cfg.lr:g}" if cfg.optimizer == "muon" else f"adamw lr={cfg.lr:g}"

    def log_fields(self, st: dict, dt: float) -> dict:
        """The step's :attr:`log_keys` for its log record (tau kept for :meth:`run_summary`)."""
        rec = {k: st[k] for k in self.log_keys if k in st}
        if self.target.remote:   # where the step's time went between the target rank and this one
            rec.update(self.target.log_fields(st["epoch"], st["step"], dt))
        if not st["skipped"] and "tau" in st:
            self._taus.append(st["tau"])
        return rec

    def run_summary(self, time_s: float) -> dict:
        taus = self._taus
        if not taus:
            return {}
        k = max(1, min(5, len(taus) // 2))
        summary = getattr(self.target, "summary", None)   # a split job's time, or a states cache's reads
        split = summary() if summary is not None else {}
        return split | {"tau_first": sum(taus[:k]) / k, "tau_last": sum(taus[-k:]) / k}

    def model_config(self) -> dict:
        return self.model.config.to_dict()

    def finish(self, out) -> None:
        pass  # `python -m dflash_prep.train.export RUN --out DIR` writes the engines' format from the checkpoint
