"""A tiny target that vLLM can serve, and a drafter export of each kind for it, built offline.

The target is a Qwen3 of :data:`SPEC` (head_dim 32: the smallest head size vLLM's CPU attention
takes) from :func:`dflash_prep.train.target_init.build_target`, its head scaled so that no argmax
is a near-tie (a lossless check then decides on the engine, not on rounding). The exports are
written by the project's own ``write_export`` of each objective (``train/objectives``) from
seeded random drafters whose every trainable tensor is moved off its init, so a tensor the engine
drops changes what it decodes. The engine tests (``tests/engine``) and the GPU script's
``engine-dflash2`` step (:mod:`bench.engine_dflash2`) build from here; nothing needs ``datasets``.
"""

from __future__ import annotations

import json
from pathlib import Path

MASK_ID = 3          # the tiny target's "<|mask|>" (train/target_init.py SPECIALS)
DRAFT_VOCAB = 64
SPEC = dict(vocab_size=512, hidden=64, layers=4, heads=2, kv_heads=1, head_dim=32, intermediate=192)
KINDS = ("dflash", "dflash2", "eagle3")


def perturb(module, seed: int, scale: float = 0.2) -> None:
    """Every trainable float parameter (norm gains too) moved off its init, so a dropped tensor shows."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad and p.is_floating_point():
                p.add_(torch.randn(p.shape, generator=g) * scale)


def write_prompts(path: Path, n: int) -> Path:
    """``n`` one-turn chat prompts (JSONL, the held-out file's shape) of growing length."""
    from dflash_prep.train.target_init import default_texts

    texts = default_texts(20_000)
    lines = [json.dumps({"messages": [{"role": "user", "content": texts[i][: 60 + 17 * i]}]}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def build_target(root: Path) -> Path:
    """``root/target``: the tiny Qwen3 with its tokenizer and chat template, head scaled by 30."""
    from safetensors.torch import load_file, save_file

    from dflash_prep.train.target_init import TargetSpec, build_target as build, default_texts

    target = build(root / "target", TargetSpec(**SPEC, seed=0), texts=default_texts(60_000))
    w = load_file(target / "model.safetensors")
    w["lm_head.weight"] = w["lm_head.weight"] * 30.0
    save_file(w, target / "model.safetensors", metadata={"format": "pt"})
    return target


def build_exports(root: Path, target: Path, kinds=KINDS) -> dict[str, Path]:
    """``{kind: root/kind}`` for each of ``kinds``: DFlash (1 layer, B = 4), DFlash2 (the same
    shape, conv and selector) and EAGLE-3 (taps 0 1 2, a 64-id draft vocabulary)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_prep.train.objectives.dflash.drafter import Drafter, DrafterConfig
    from dflash_prep.train.objectives.dflash.export import write_export as write_dflash
    from dflash_prep.train.objectives.dflash2.drafter import DFlash2Config, DFlash2Drafter
    from dflash_prep.train.objectives.dflash2.export import write_export as write_dflash2
    from dflash_prep.train.objectives.eagle3.export import write_export as write_eagle3
    from dflash_prep.train.objectives.eagle3.model import Eagle3Config, Eagle3Drafter

    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown export kinds {unknown}; choose from {list(KINDS)}")
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    source = {"builder": "bench/tiny_engine.py", "random": True}
    cfg = DrafterConfig.from_target_config(model.config, num_layers=1, block_size=4, mask_token_id=MASK_ID)
    c2 = DFlash2Config(**{**cfg.to_dict(), "target_layer_ids": tuple(cfg.target_layer_ids)}, conv_kernel_size=2,
                       conv_group_size=16, selector_rank=8, selector_top_k=4)
    ec = Eagle3Config.from_target_config(model.config, DRAFT_VOCAB, (0, 1, 2))

    def eagle3():
        ids = torch.randperm(ec.vocab_size, generator=torch.Generator().manual_seed(3))[:DRAFT_VOCAB].sort().values
        return Eagle3Drafter.from_target(ec, model, ids - torch.arange(DRAFT_VOCAB))

    makers = {"dflash": (1, lambda: Drafter(cfg), write_dflash), "dflash2": (2, lambda: DFlash2Drafter(c2), write_dflash2),
              "eagle3": (3, eagle3, write_eagle3)}
    out = {}
    for kind in kinds:  # each seeded on its own: one kind alone is the same bytes as in a build of all
        seed, make, write = makers[kind]
        torch.manual_seed(seed)
        drafter = make()
        perturb(drafter, seed)
        write(drafter, root / kind, source=source)
        out[kind] = root / kind
    return out
