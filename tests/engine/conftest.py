"""Fixtures of the engine tests: a tiny Qwen3 target vLLM's CPU build can run (head_dim 32) and
drafter exports in the project's real formats, built once per session by the project's own code
(random weights: the DFlash, DFlash2 and EAGLE-3 ``write_export`` of ``train/objectives``), plus
broken copies. Only the ``engine``-marked tests use them; they start real vLLM from
``.venv-vllm`` (``make venv-vllm``) and are skipped, with the fix, without it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

MASK_ID = 3          # the tiny target's "<|mask|>" (train/target_init.py SPECIALS)
DRAFT_VOCAB = 64
SPEC = dict(vocab_size=512, hidden=64, layers=4, heads=2, kv_heads=1, head_dim=32, intermediate=192)


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


def _perturb(module, seed: int, scale: float = 0.2) -> None:
    """Every trainable float parameter (norm gains too) moved off its init, so a dropped tensor shows."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad and p.is_floating_point():
                p.add_(torch.randn(p.shape, generator=g) * scale)


def _prompts(path: Path, n: int) -> Path:
    from dflash_prep.train.target_init import default_texts

    texts = default_texts(20_000)
    lines = [json.dumps({"messages": [{"role": "user", "content": texts[i][: 60 + 17 * i]}]}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="session")
def built(tmp_path_factory, engine_python):
    """``{"target", "prompts", "dflash", "eagle3", "dflash2"}``: folders under one session temp dir."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from dflash_prep.train.objectives.dflash.drafter import Drafter, DrafterConfig
    from dflash_prep.train.objectives.dflash.export import write_export as write_dflash
    from dflash_prep.train.objectives.dflash2.drafter import DFlash2Config, DFlash2Drafter
    from dflash_prep.train.objectives.dflash2.export import write_export as write_dflash2
    from dflash_prep.train.objectives.eagle3.export import write_export as write_eagle3
    from dflash_prep.train.objectives.eagle3.model import Eagle3Config, Eagle3Drafter
    from dflash_prep.train.target_init import TargetSpec, build_target, default_texts

    root = tmp_path_factory.mktemp("engine")
    target = build_target(root / "target", TargetSpec(**SPEC, seed=0), texts=default_texts(60_000))
    # a sharper random target: logits far apart, so no argmax near-tie decides a lossless check
    w = load_file(target / "model.safetensors")
    w["lm_head.weight"] = w["lm_head.weight"] * 30.0
    save_file(w, target / "model.safetensors", metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    source = {"test": "tests/engine/conftest.py", "random": True}

    cfg = DrafterConfig.from_target_config(model.config, num_layers=1, block_size=4, mask_token_id=MASK_ID)
    torch.manual_seed(1)
    d = Drafter(cfg)
    _perturb(d, 1)
    write_dflash(d, root / "dflash", source=source)

    c2 = DFlash2Config(**{**cfg.to_dict(), "target_layer_ids": tuple(cfg.target_layer_ids)}, conv_kernel_size=2,
                       conv_group_size=16, selector_rank=8, selector_top_k=4)
    torch.manual_seed(2)
    d2 = DFlash2Drafter(c2)
    _perturb(d2, 2)
    write_dflash2(d2, root / "dflash2", source=source)

    ec = Eagle3Config.from_target_config(model.config, DRAFT_VOCAB, (0, 1, 2))
    ids = torch.randperm(ec.vocab_size, generator=torch.Generator().manual_seed(3))[:DRAFT_VOCAB].sort().values
    e = Eagle3Drafter.from_target(ec, model, ids - torch.arange(DRAFT_VOCAB))
    _perturb(e, 3)
    write_eagle3(e, root / "eagle3", source=source)
    return {"root": root, "target": target, "prompts": _prompts(root / "prompts.jsonl", 6),
            "dflash": root / "dflash", "eagle3": root / "eagle3", "dflash2": root / "dflash2"}


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
