"""Atomic, versioned checkpoints that refuse to resume under a different plan.

A checkpoint (format ``dflash-prep/train-checkpoint`` version 2, one ``torch.save`` file
written to a temp path and renamed into place, then a 48-byte trailer: the magic
:data:`TRAILER_MAGIC` and the SHA-256 of everything before it, so a flipped byte anywhere,
tensor data included, or a truncation is refused on load; ``torch.load`` still reads the
file directly, since zip readers ignore trailing bytes) holds:

- ``model``, ``optimizer``: state dicts (parameters are identical on every rank: gradients
  are all-reduced before every optimizer step);
- ``schedule``: the LR schedule's fields (:class:`dflash_prep.train.lr.Schedule`);
- ``rng``: per rank, the torch CPU (and CUDA) generator, NumPy's and Python's global states;
- ``cursor``: ``epoch``, ``step`` (the next step inside that epoch) and ``global_step``;
- ``run_key``: what fixes the data order: the plan's identity and fingerprint, the dataset
  fingerprint, and the manifest's layout, world size and accumulation;
- ``run_key["contract"]``: what the objective fixes besides the data: ``objective``; for DFlash
  the target's fingerprint, tokenizer and chat-template hashes, taps, mask id, B, the loss
  (slot weights with gamma or D-PACE alpha, ce or kl with its temperature) and the anchor
  policy (seed, cap, policy, sampler version); for an LM started ``--init-from`` a folder,
  that folder's fingerprint; for every objective the optimizer (adamw or muon);
- ``model_config``: the trained module's shape (decoder, transformers config or drafter config).

Resume is exact: with the loader a pure function of (manifest, cursor) and no dropout,
``k`` steps + save + load + ``N - k`` steps equals ``N`` straight steps bit for bit on CPU.
Seed 2 restarted from scratch when the data flow changed, because a checkpoint trained on
one batch mix continued on another is a different run. So :func:`check_run_key` refuses a
checkpoint whose run key differs and names each difference; ``--from-scratch`` is the way
to start a new run on the new plan.
"""

from __future__ import annotations

import hashlib
import io
import random
from pathlib import Path

import numpy as np
import torch

from dflash_prep.errors import FingerprintMismatch, FormatError
from dflash_prep.formats.fileio import atomic_write_bytes

CKPT_FORMAT = "dflash-prep/train-checkpoint"
CKPT_VERSION = 2
CKPT_FILE = "checkpoint.pt"
TRAILER_MAGIC = b"dflash-ckpt-sha2"   # 16 bytes, then the 32-byte digest


def is_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` ends with our trailer (the file is a checkpoint of this trainer)."""
    try:
        with open(path, "rb") as f:
            f.seek(-48, 2)
            return f.read(16) == TRAILER_MAGIC
    except OSError:
        return False


class PlanChanged(FingerprintMismatch):
    """The checkpoint was trained under another plan, dataset or manifest shape."""


def rng_state() -> dict:
    """This process's RNG states, as tensors and plain values (loadable with weights_only)."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    st = {
        "torch": torch.get_rng_state(),
        "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "cached": float(np_state[4])},
        "python": {"version": py_state[0], "state": list(py_state[1]), "gauss": py_state[2]},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    n = st["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    p = st["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])


def save(path: str | Path, *, model, optimizer, schedule: dict, rng: list[dict], cursor: dict, run_key: dict,
         model_config: dict, extra: dict | None = None) -> Path:
    """Write the checkpoint atomically (call on rank 0 only)."""
    obj = {"format": CKPT_FORMAT, "version": CKPT_VERSION, "model": model.state_dict(),
           "optimizer": optimizer.state_dict(), "schedule": dict(schedule), "rng": list(rng),
           "cursor": dict(cursor), "run_key": dict(run_key), "model_config": dict(model_config),
           "extra": dict(extra or {})}
    buf = io.BytesIO()
    torch.save(obj, buf)
    payload = buf.getvalue()
    atomic_write_bytes(path, payload + TRAILER_MAGIC + hashlib.sha256(payload).digest())
    return Path(path)


def path_of(run: str | Path) -> Path:
    """The checkpoint file of a run folder, or ``run`` itself when it is a file."""
    run = Path(run)
    return run / CKPT_FILE if run.is_dir() else run


def load(path: str | Path) -> dict:
    """Read and check a checkpoint (format, version, required keys)."""
    path = Path(path)
    if not path.is_file():
        raise FormatError(f"{path}: checkpoint not found")
    data = path.read_bytes()
    if len(data) < 48 or data[-48:-32] != TRAILER_MAGIC:
        raise FormatError(f"{path}: no dflash-prep checkpoint trailer (truncated, foreign, or written by an older "
                          "dflash-prep); delete it or pass --from-scratch")
    if hashlib.sha256(memoryview(data)[:-48]).digest() != data[-32:]:
        raise FormatError(f"{path}: contents do not match the checkpoint's SHA-256 (corrupt); delete it or pass "
                          "--from-scratch to start again")
    try:
        obj = torch.load(io.BytesIO(memoryview(data)[:-48]), map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for truncated / foreign files
        raise FormatError(f"{path}: not a readable checkpoint ({type(e).__name__}: {e}); "
                          "delete it or pass --from-scratch") from e
    if not isinstance(obj, dict) or obj.get("format") != CKPT_FORMAT:
        raise FormatError(f"{path}: not a '{CKPT_FORMAT}' file; pass --out to a run folder of this trainer "
                          "or --from-scratch")
    if obj.get("version") != CKPT_VERSION:
        raise FormatError(f"{path}: checkpoint version {obj.get('version')!r} is not supported "
                          f"(supports {CKPT_VERSION}); resume with the dflash-prep that wrote it or --from-scratch")
    missing = {"model", "optimizer", "schedule", "rng", "cursor", "run_key", "model_config"} - set(obj)
    if missing:
        raise FormatError(f"{path}: checkpoint lacks {sorted(missing)}; it is corrupt, pass --from-scratch")
    return obj


def _describe(v) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def _flatten(d, prefix: str = "") -> dict:
    """Nested dicts as dotted keys, so a difference names the exact field (``plan.boundaries``)."""
    if not isinstance(d, dict):
        return {prefix: d}
    out = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def check_run_key(saved: dict, current: dict, *, path: str | Path) -> None:
    """Refuse to resume when anything that fixes the data order changed; name each change."""
    a, b = _flatten(saved), _flatten(current)
    diffs = []
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            diffs.append(f"  {k}: checkpoint {_describe(a.get(k))} -> now {_describe(b.get(k))}")
    if diffs:
        raise PlanChanged(
            f"{path}: refusing to resume: the checkpoint was trained under a different data plan or run "
            "contract.\n"
            + "\n".join(diffs) + "\n"
            "Changing how data flows (boundaries, budget, seed, window, layout, world size, accumulation or the "
            "dataset) or what is trained (objective, target, taps, mask id, block size, slot weights, gamma, alpha, "
            "loss, temperature, optimizer, anchors) changes "
            "the run, so continuing this checkpoint would mix two batch orders. Either point "
            "--plan/--manifests back at the plan the run started with, or pass --from-scratch to start a new "
            "run on the new plan.")


def check_model(saved: dict, current: dict, *, path: str | Path) -> None:
    if saved != current:
        diff = {k: (saved.get(k), current.get(k)) for k in set(saved) | set(current) if saved.get(k) != current.get(k)}
        raise PlanChanged(f"{path}: the checkpoint's model shape differs from --model/[model] ({diff}); "
                          "use the same preset to resume, or pass --from-scratch")
