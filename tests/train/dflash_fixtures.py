"""Shared pieces of the DFlash trainer tests: a tiny real Qwen3 target (built once per process)
and the run config over the in-memory fakes.

The target's vocabulary covers the fakes' ids (3..96); the fakes never use id 1, so it serves
as the mask token.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

MASK_ID = 1
SPEC = dict(vocab_size=300, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, intermediate=96)
_cache: dict[int, Path] = {}


def tiny_target(seed: int = 0) -> Path:
    """A random tiny Qwen3 folder (tokenizer + model); same seed, same bytes; cached per process."""
    if seed not in _cache:
        from dflash_prep.train.target_init import TargetSpec, build_target, default_texts

        root = Path(tempfile.mkdtemp(prefix="dflash-target-"))
        atexit.register(shutil.rmtree, root, True)
        _cache[seed] = build_target(root / "target", TargetSpec(**SPEC, seed=seed), texts=default_texts(20_000))
    return _cache[seed]


def dflash_cfg(out, target, **kw):
    from dflash_prep.train.config import TrainConfig

    base = dict(out=str(out), objective="dflash", target=str(target), draft_layers=2, block_size=4,
                max_anchors=6, mask_token_id=MASK_ID, progress=False, prefetch=2, warmup_steps=1, lr=3e-3,
                device="cpu", ce_chunk=16)
    base.update(kw)
    return TrainConfig(**base)
