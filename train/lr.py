"""Learning-rate schedule: linear warmup then cosine decay, a pure function of the step.

``lr(s) = peak * (s + 1) / warmup`` for ``s < warmup``, then cosine from ``peak`` to
``peak * min_ratio`` over ``[warmup, total)``, and ``peak * min_ratio`` from ``total`` on.
Being a pure function of the global step, its checkpointed state is just these fields.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from dflash_prep.errors import ConfigError


@dataclass(frozen=True)
class Schedule:
    """Warmup + cosine."""

    peak: float
    """Peak learning rate."""
    warmup: int
    """Warmup steps (linear from peak / warmup)."""
    total: int
    """Cosine horizon in optimizer steps."""
    min_ratio: float = 0.1
    """Final LR as a fraction of the peak."""

    def __post_init__(self):
        if self.peak <= 0 or self.warmup < 0 or self.total < 1 or not 0 <= self.min_ratio <= 1:
            raise ConfigError(f"invalid LR schedule {self}: need peak > 0, warmup >= 0, total >= 1, "
                              "0 <= min_ratio <= 1")

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        span = max(1, self.total - self.warmup)
        t = min(1.0, (step - self.warmup) / span)
        floor = self.peak * self.min_ratio
        return floor + (self.peak - floor) * 0.5 * (1.0 + math.cos(math.pi * t))

    def state(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state(cls, d: dict) -> "Schedule":
        return cls(**d)
