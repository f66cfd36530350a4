"""Named length distributions for the demo corpus, tests and benchmarks.

``seedlike`` is definitions.md's benchmark distribution: 902,087 lengths from a lognormal body
(median 1150, sigma 0.60); 0.2% of samples uniform on [4000, 8191] and 0.05% exactly at
8191; clipped to [65, 8191]. That gives p50 ~1152, p99 ~4890, mean ~1390.

``mini`` is seedlike's shape at a quarter of the length (median ~288, max 2048), for the CPU
demo. ``bimodal``, ``heavytail`` and ``uniform`` stress the optimizer and the packers.

Every profile is a pure function of (name, n, seed): the same call gives the same array on
any machine (NumPy's PCG64 stream is stable across platforms).
"""

from __future__ import annotations

import numpy as np

from dflash_prep.errors import ConfigError

SEEDLIKE_N = 902_087
MAX_LEN = 8191
MIN_LEN = 65


def _seedlike(rng: np.random.Generator, n: int) -> np.ndarray:
    x = rng.lognormal(mean=np.log(1150.0), sigma=0.60, size=n)
    u = rng.random(n)
    tail = u < 0.002
    x[tail] = rng.uniform(4000, MAX_LEN + 1, size=int(tail.sum()))
    pile = (u >= 0.002) & (u < 0.0025)
    x[pile] = MAX_LEN
    return np.clip(np.floor(x), MIN_LEN, MAX_LEN)


def _mini(rng: np.random.Generator, n: int) -> np.ndarray:
    # seedlike's shape at a quarter of its lengths: CPU demos train on it in minutes
    return np.clip(np.floor(_seedlike(rng, n) / 4), 16, (MAX_LEN + 1) // 4)


def _bimodal(rng: np.random.Generator, n: int) -> np.ndarray:
    short = rng.random(n) < 0.7
    x = np.where(short, rng.lognormal(np.log(300.0), 0.4, n), rng.lognormal(np.log(4000.0), 0.3, n))
    return np.clip(np.floor(x), MIN_LEN, MAX_LEN)


def _heavytail(rng: np.random.Generator, n: int) -> np.ndarray:
    x = MIN_LEN + rng.pareto(1.3, n) * 400.0
    return np.clip(np.floor(x), MIN_LEN, MAX_LEN)


def _uniform(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(MIN_LEN, MAX_LEN + 1, n).astype(np.float64)


PROFILES = {
    "seedlike": _seedlike,
    "mini": _mini,
    "bimodal": _bimodal,
    "heavytail": _heavytail,
    "uniform": _uniform,
}


def make_lengths(profile: str = "seedlike", n: int = SEEDLIKE_N, seed: int = 0) -> np.ndarray:
    """Return ``n`` int32 token lengths drawn from the named profile with ``seed``."""
    if profile not in PROFILES:
        raise ConfigError(f"unknown length profile {profile!r}; choose one of {', '.join(PROFILES)}")
    if n < 1:
        raise ConfigError(f"--n must be at least 1, got {n}")
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5EED]))
    return PROFILES[profile](rng, int(n)).astype(np.int32)
