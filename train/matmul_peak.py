"""A CPU's measured matmul rate: what a CPU run's achieved FLOP/s is compared with.

A CUDA run's ``mfu`` divides the step's model FLOPs by the card's dense bf16 peak
(:func:`dflash_prep.train.distributed.peak_flops`). A CPU has no such number to trust: the rate
depends on the cores torch uses, their vector units (AVX2, AVX-512, AMX), the dtype, the clock
and whatever else runs on the machine. So a CPU run measures one at start (:func:`measure`):
the LM head's matmul, ``[rows, H] @ [H, V]`` at the target's ``H`` and ``V``, in the head's
compute dtype, on torch's threads in this process (the ones the steps use). ``rows`` is the
loss's chunk (``--ce-chunk``) or fewer, so that the measurement takes about ``seconds``: a
64-row probe first, then the rows the remaining time allows (at least :data:`MIN_ROWS`, so
~1 s on a loaded 2-core VM), best of two runs where both fit.

What a step then reports (:func:`step_rates`): ``flops_per_s``, the step's model FLOPs over its
wall time (every rank's FLOPs, so a multiple of one rank's rate), and ``cpu_matmul_share``, that
rate per rank over the measured matmul rate. The head is the step's biggest matmul on a real
target (SmolLM2-135M: 49,152 x 576), so a share near 1 says the step runs at the speed its
largest kernel alone could; the rest of the step (smaller matmuls, attention, softmax, the
optimizer) is what holds it below. The measured rate moves with the machine's load: compare
shares of runs on an idle machine, or side by side (bench/drafter_cpu.py).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from dflash_prep.train.distributed import cpu_head_dtype


MIN_ROWS = 256
"""The fewest rows measured (unless the chunk is smaller): on a 2-core AVX-512 VM, fp32 at V = 49,152
ran 21 GFLOP/s at 64 rows, 29 at 256 and 32 at 2048 (bf16: 60, 89, 84)."""


@dataclass(frozen=True)
class MatmulRate:
    """One measurement: ``flops_per_s`` of ``[rows, hidden] @ [hidden, vocab]`` in ``dtype``
    with ``threads`` torch threads (the best of its timed runs)."""

    flops_per_s: float
    rows: int
    hidden: int
    vocab: int
    dtype: str
    threads: int

    def to_dict(self) -> dict:
        return asdict(self)


def measure(rows: int, hidden: int, vocab: int, dtype: torch.dtype = torch.float32, *,
            seconds: float = 0.5, device: torch.device | str = "cpu") -> MatmulRate:
    """The achieved FLOP/s of ``x [r, hidden] @ W^T`` for ``W [vocab, hidden]`` with ``r <= rows``
    (module docstring), in about ``seconds`` at most (allocation aside). Random values: only the
    shape, dtype and threads matter to the rate."""
    if min(rows, hidden, vocab) < 1 or not seconds > 0:
        raise ValueError(f"matmul_peak.measure: rows, hidden, vocab >= 1 and seconds > 0 needed, got "
                         f"{rows}, {hidden}, {vocab}, {seconds}")
    g = torch.Generator(device=device).manual_seed(0)   # its own generator: the run's RNG is untouched
    w = torch.randn(vocab, hidden, generator=g, device=device).to(dtype)      # (V, H)
    x = torch.randn(rows, hidden, generator=g, device=device).to(dtype)       # (rows, H)
    per_row = 2.0 * hidden * vocab

    def run(r: int) -> float:
        t0 = time.perf_counter()
        x[:r] @ w.T                                                            # (r, V)
        return time.perf_counter() - t0

    probe = min(rows, 64)
    run(probe)                                                                 # first call: allocation, dispatch
    t = run(probe)
    rate = probe * per_row / max(t, 1e-9)
    left = max(0.0, seconds - 2 * t)
    # two runs in what is left, but never under MIN_ROWS: 64 rows run at ~2/3 of 2048's rate
    r = int(min(rows, max(MIN_ROWS, rate * left / 2 / per_row)))
    best = min(run(r), run(r)) if rate * left / 2 / per_row >= MIN_ROWS else run(r) if r > probe else t
    return MatmulRate(flops_per_s=r * per_row / max(best, 1e-9), rows=r, hidden=hidden, vocab=vocab,
                      dtype=str(dtype).removeprefix("torch."), threads=torch.get_num_threads())


def step_rates(flops: float, dt: float, world_size: int, rate: MatmulRate | None) -> dict:
    """A step's ``flops_per_s`` (all ranks) and ``cpu_matmul_share`` (per rank, over ``rate``;
    None without a measurement)."""
    fps = flops / dt if dt > 0 else 0.0
    return {"flops_per_s": fps,
            "cpu_matmul_share": fps / world_size / rate.flops_per_s if rate is not None else None}


def for_run(obj, device: torch.device, bf16: bool, chunk: int) -> MatmulRate | None:
    """A CPU run's measurement (module docstring) at ``obj.head_shape()`` and the head's compute
    dtype (:func:`dflash_prep.train.distributed.cpu_head_dtype`); None on another device."""
    if device.type != "cpu":
        return None
    V, H = obj.head_shape()
    return measure(chunk, H, V, cpu_head_dtype(bf16))
