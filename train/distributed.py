"""Process group, device and the three collectives the trainer makes.

Launch is torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT`` in
the environment); without those variables the trainer is one process and never touches
``torch.distributed``. NCCL on CUDA, gloo on CPU. Every rank makes the same calls in the
same order each step (one count all-reduce before backward, one gradient all-reduce, one
stats all-reduce), even a rank whose share of a step is empty, so ranks never deadlock.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dflash_prep.errors import ConfigError, DflashError
from dflash_prep.train.chunked_ce import head_dtype


class CollectiveBroke(DflashError):
    """A collective of the trainer failed because another rank of its group stopped or died."""


@dataclass(frozen=True)
class Dist:
    """This process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    group: object | None = None
    """The process group the collectives run on: None is the default (whole job); a split job's
    drafter ranks get the drafter-only group (:mod:`dflash_prep.train.split.roles`), with ``rank``/``world_size`` in it."""
    role: str = "rank"
    """What a rank of this group is called in an error line (a split job's drafters: ``"drafter rank"``)."""
    global_offset: int = 0
    """Global rank of this group's rank 0 (a split job's drafters: K); named in error lines when > 0."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()


def setup(device: str = "auto", cuda_index=None) -> Dist:
    """Join the torchrun job (if any) and pick the device: ``cuda:LOCAL_RANK``, or
    ``cuda:cuda_index(torch's GPU count)`` when given (a split job's layout,
    :mod:`dflash_prep.train.split.gpus`), or cpu."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but torch sees no CUDA GPU; use --device cpu")
    if use_cuda:
        index = local if cuda_index is None else int(cuda_index(torch.cuda.device_count()))
        torch.cuda.set_device(index)
        dev = torch.device("cuda", index)
    else:
        dev = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo",
                                device_id=dev if use_cuda else None)
    return Dist(rank, world, local, dev)


def autocast_for(device: torch.device, bf16: bool):
    """The context the trainer's forwards run under when ``bf16``: bf16 autocast on CUDA; on a CPU
    the LM head's matmuls alone in bf16 (:func:`dflash_prep.train.chunked_ce.head_dtype`), where
    :func:`cpu_head_dtype` says so; else none (fp32)."""
    if device.type == "cuda" and bf16:
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    if device.type == "cpu" and cpu_head_dtype(bf16) == torch.bfloat16:
        return lambda: head_dtype(torch.bfloat16)
    return contextlib.nullcontext


def bf16_native() -> bool:
    """Whether torch runs bf16 matmuls natively on this CPU (AVX512-BF16 or AMX), not emulated."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def cpu_head_dtype(bf16: bool) -> torch.dtype:
    """The dtype of the LM head's matmuls on CPU: bf16 when ``bf16`` and the CPU runs it natively
    (:func:`bf16_native`), else fp32. The head is the drafter step's biggest matmul (49,152 x 576
    for SmolLM2-135M); bf16 runs it ~2x faster on AVX512-BF16 (docs/benchmarks.md, "The drafter
    step on CPU"). Everything else stays fp32; bf16 matmuls are deterministic, so resume stays bitwise."""
    return torch.bfloat16 if bf16 and bf16_native() else torch.float32


def set_determinism(device: torch.device) -> None:
    """Deterministic kernels: strict on CPU; on CUDA a fixed cuBLAS workspace and a warning for
    ops without a deterministic version (rather than a failure)."""
    if device.type == "cpu":
        torch.use_deterministic_algorithms(True)
    else:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)


def teardown(d: Dist) -> None:
    if d.active:
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, d: Dist) -> torch.Tensor:
    """In-place SUM across ranks (no-op for one process)."""
    if d.active:
        with _peers_alive(d, "all-reduce"):
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=d.group)
    return t


def any_rank(flag: bool, d: Dist) -> bool:
    """Whether ``flag`` holds on any rank (a collective: every rank of ``d`` calls it; one process:
    ``flag``). A decision every rank must take alike, e.g. whether rank 0 is about to write a file
    the others would otherwise look for before or after it exists."""
    if not d.active:
        return bool(flag)
    t = torch.tensor([1.0 if flag else 0.0], device=d.device)
    return bool(all_reduce_sum(t, d).item() > 0)


def all_reduce_grads(params: list[torch.nn.Parameter], d: Dist) -> None:
    """SUM every gradient across ranks in one flat buffer.

    A SUM, not an average: each rank's loss is already divided by the global target count
    of the step, so the sum over ranks is the gradient of the step's per-token mean loss.
    Parameters without a gradient (a rank with no micro-batch in this step) join with zeros.
    """
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if not d.active:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    with _peers_alive(d, "gradient all-reduce"):
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=d.group)
    off = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[off:off + n].view_as(p.grad))
        off += n


def gather_objects(obj, d: Dist) -> list:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not d.active:
        return [obj]
    out = [None] * d.world_size
    with _peers_alive(d, "all-gather"):
        dist.all_gather_object(out, obj, group=d.group)
    return out


def barrier(d: Dist) -> None:
    if d.active:
        with _peers_alive(d, "barrier"):
            dist.barrier(group=d.group)


def backend_reason(e: BaseException) -> str:
    """The backend's own reason in a collective's error, one line: gloo's ``[.../pair.cc:537] Read
    error [127.0.0.1]:2960: Connection reset by peer. This is typically caused by ...`` becomes
    ``Read error [127.0.0.1]:2960: Connection reset by peer``."""
    line = ([x.strip() for x in str(e).splitlines() if x.strip()] or [type(e).__name__])[-1]
    line = re.sub(r"^\[[^\]]*\]\s*", "", line)
    return line.split(". This is typically", 1)[0].rstrip(".")


def _name(d: Dist, rank: int) -> str:
    return f"{d.role} {rank}" + (f" (global rank {d.global_offset + rank})" if d.global_offset else "")


@contextlib.contextmanager
def _peers_alive(d: Dist, what: str):
    """A collective that breaks on a peer's exit (gloo's "Connection closed by peer", a timeout)
    becomes :class:`CollectiveBroke`: one line naming this rank and the ranks that may have died,
    instead of the backend's multi-line error. Other errors pass unchanged."""
    try:
        yield
    except RuntimeError as e:
        text = str(e)
        if not (isinstance(e, getattr(dist, "DistBackendError", ())) or
                any(k in text.lower() for k in ("connection", "peer", "timed out", "timeout"))):
            raise
        first = backend_reason(e)
        others = [r for r in range(d.world_size) if r != d.rank]
        who = _name(d, others[0]) if len(others) == 1 else "one of " + ", ".join(_name(d, r) for r in others)
        raise CollectiveBroke(f"{_name(d, d.rank)}: the {what} with the other {d.role}s broke ({first}): {who} "
                              "stopped or died (see its output)") from None


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of the GPU model, for MFU; None when unknown (or on CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in (("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("L40", 181e12), ("A10", 125e12)):
        if key in name:
            return peak
    return None
