"""Fixtures of the engine tests: a tiny Qwen3 target vLLM's CPU build can run (head_dim 32) and
drafter exports in the project's real formats, built once per session by the project's own code
(:mod:`bench.tiny_engine`: random weights through the DFlash, DFlash2 and EAGLE-3 ``write_export``),
plus broken copies. Only the ``engine``-marked tests use them; they start real vLLM from
``.venv-vllm`` (``make venv-vllm``) and are skipped, with the fix, without it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def engine_python():
    from dflash_prep.engine.env import vllm_python, vllm_version
    from dflash_prep.errors import EngineError

    try:
        py = vllm_python()
        vllm_version(py)
    except EngineError as e:
        pytest.skip(str(e))
    return py


@pytest.fixture(scope="session")
def built(tmp_path_factory, engine_python):
    """``{"target", "prompts", "dflash", "eagle3", "dflash2"}``: folders under one session temp dir."""
    from dflash_prep.bench.tiny_engine import build_exports, build_target, write_prompts

    root = tmp_path_factory.mktemp("engine")
    target = build_target(root)
    return {"root": root, "target": target, "prompts": write_prompts(root / "prompts.jsonl", 6),
            **build_exports(root, target)}


def broken_copy(src: Path, dst: Path, *, drop: str | None = None, config: dict | None = None) -> Path:
    """A copy of an export with one tensor removed and/or config fields replaced, as a hand-edited
    folder would be (its ``export.json`` sidecar, whose fingerprints no longer match, is dropped)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    (dst / "export.json").unlink()
    if drop is not None:
        w = load_file(dst / "model.safetensors")
        del w[drop]
        save_file(w, dst / "model.safetensors", metadata={"format": "pt"})
    if config:
        c = json.loads((dst / "config.json").read_text())
        for k, v in config.items():
            if isinstance(v, dict):
                c.setdefault(k, {}).update(v)
            else:
                c[k] = v
        (dst / "config.json").write_text(json.dumps(c, indent=2))
    return dst
