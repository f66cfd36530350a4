"""Which attention implementation runs: the Triton kernels or the PyTorch reference.

Resolution order, first match wins:

1. the innermost active :func:`force_backend` context (tests use it to force each path);
2. the environment variable ``DFLASH_ATTN_BACKEND`` = ``auto`` | ``triton`` | ``reference``;
3. ``auto``: Triton for CUDA tensors, the reference for anything else (CPU).

Forcing ``triton`` on CPU tensors is allowed only under Triton's interpreter
(``TRITON_INTERPRET=1`` set before triton is first imported); otherwise
:func:`resolve_backend` raises a :class:`~dflash_prep.kernels.errors.AttentionConfigError` that says so.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator, Literal

import torch

from .errors import AttentionConfigError

Backend = Literal["auto", "triton", "reference"]
BACKENDS: tuple[str, ...] = ("auto", "triton", "reference")
ENV_VAR = "DFLASH_ATTN_BACKEND"

_local = threading.local()  # per-thread stack of forced backends


def _check_name(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise AttentionConfigError(
            f"{source}: unknown attention backend {name!r}; use one of {', '.join(BACKENDS)}"
        )
    return name


@contextlib.contextmanager
def force_backend(name: Backend) -> Iterator[None]:
    """Run the enclosed attention calls on ``name`` ("auto", "triton" or "reference").

    Contexts nest; the innermost wins. The override is per thread and beats the
    ``DFLASH_ATTN_BACKEND`` environment variable.
    """
    _check_name(name, "force_backend")
    stack = _local.__dict__.setdefault("stack", [])
    stack.append(name)
    try:
        yield
    finally:
        stack.pop()


def requested_backend() -> str:
    """The backend asked for, before looking at tensors: context, then env, then auto."""
    stack = _local.__dict__.get("stack")
    if stack:
        return stack[-1]
    return _check_name(os.environ.get(ENV_VAR, "auto").strip().lower() or "auto", ENV_VAR)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def resolve_backend(device: torch.device) -> str:
    """The concrete backend ("triton" or "reference") for tensors on ``device``."""
    name = requested_backend()
    if name == "auto":
        return "triton" if device.type == "cuda" else "reference"
    if name == "triton" and device.type != "cuda" and not interpreting():
        raise AttentionConfigError(
            f"attention backend 'triton' was forced for tensors on {device}, but Triton runs "
            "only on CUDA tensors or under its CPU interpreter. Move the tensors to a GPU, set "
            "TRITON_INTERPRET=1 before importing triton, or use backend 'reference'/'auto'."
        )
    return name
