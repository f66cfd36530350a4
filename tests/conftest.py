"""Every test starts from the same process-global numeric state, whatever ran before it.

torch keeps settings per process that change float results: the intra-op thread count (how a
reduction is split), ``use_deterministic_algorithms`` (on CPU it switches ``index_add_``, scatter
and ``index_put_`` to other kernels), the default dtype, grad mode and the RNGs. The trainer sets
some of them for its run (``train.distributed.set_determinism``), and several fixtures pin the
thread count. Without this file a test's numbers depended on which tests ran earlier in the same
process: a comparison that passed alone failed in the suite. So the baseline is fixed here once
(one intra-op thread: the machine has 2 cores, and a fixed count makes CPU reductions reproducible),
and after each test everything it changed is put back.

Signals likewise: a shell starts a background job (``make test &`` in a script) with SIGINT
ignored, and every process a test starts would inherit that, so a test that sends SIGINT to a
command (Ctrl-C) would see it ignored. The suite puts Python's own SIGINT handler back once, so the
commands it starts get SIGINT at its default as in a terminal; a test of an ignoring process sets
that itself (tests/engine/test_lifetime_units.py).

Machine dependence is a separate matter: which vector kernels ATen dispatches to follows the CPU
(``ATEN_CPU_CAPABILITY=default|avx2|avx512`` picks one, docs/reliability.md#any-cpu), so float
results are compared with stated bounds, never pinned as bits.
"""

from __future__ import annotations

import random
import signal

import numpy as np
import pytest
import torch

BASELINE_THREADS = 1
torch.set_num_threads(BASELINE_THREADS)
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:       # see the module doc
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _snapshot() -> dict:
    return {
        "threads": torch.get_num_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": np.random.get_state(),
        "python_rng": random.getstate(),
    }


def _restore(s: dict) -> None:
    torch.set_num_threads(s["threads"])
    torch.use_deterministic_algorithms(s["deterministic"], warn_only=s["deterministic_warn_only"])
    torch.set_default_dtype(s["dtype"])
    torch.set_grad_enabled(s["grad"])
    torch.set_rng_state(s["torch_rng"])
    np.random.set_state(s["numpy_rng"])
    random.setstate(s["python_rng"])


@pytest.fixture(autouse=True)
def _isolated_torch_state():
    """Restore the process-global torch/numpy/random state a test changed (see the module doc)."""
    before = _snapshot()
    yield
    _restore(before)
