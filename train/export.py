"""Export a trained run in the format its inference engines load: the run's objective decides.

    python -m dflash_prep.train.export RUN --out DIR [--dtype bfloat16] [--overwrite]

``RUN`` is a run folder (its ``checkpoint.pt``) or the checkpoint file. The checkpoint's run
contract names its objective (``run_key["contract"]["objective"]``), and that objective's
``export`` hook (:class:`~dflash_prep.train.objectives.registry.TrainerSpec`) writes ``DIR``
through one atomic folder rename: a DFlash drafter as the public DFlash folder
(:mod:`dflash_prep.train.objectives.dflash.export`), and so on for each drafter objective. An LM
run has no export here: it saves its transformers folder (``OUT/hf``) itself.

Every export's ``config.json`` also carries our own ``dflash_prep`` block (:func:`provenance`):
the serving (thinking) mode and chat-template hash of the data the drafter was trained on, the
dataset's fingerprint and the run's recipe; vLLM ignores it, ``dflash-prep evaluate`` reads it
(:mod:`dflash_prep.engine.serving_mode`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dflash_prep.engine.serving_mode import export_block
from dflash_prep.errors import ConfigError, DflashError, FormatError

DTYPES = ("float32", "bfloat16", "float16")
RECIPE_OPTIONS = ("lr", "muon_lr", "min_lr_ratio", "warmup_steps", "weight_decay", "betas", "grad_clip", "epochs",
                  "max_steps", "seed")
"""The run config's training options the export's recipe records (beside the run contract)."""
TARGET_IDENTITY = ("target_fingerprint", "tokenizer_hash", "chat_template_hash")
"""Run-contract fields that name the target rather than the recipe (left out of the recipe)."""


def provenance(obj: dict) -> dict:
    """The ``dflash_prep`` block of a loaded checkpoint's export (:func:`~dflash_prep.engine.serving_mode.export_block`):
    the serving mode its dataset recorded (the checkpoint's ``extra["serving_mode"]``; a checkpoint
    from before it: unknown), the dataset fingerprint (``run_key["data_fingerprint"]``) and the recipe:
    the run contract (objective, loss, block size, optimizer, anchors, ...) without the target's
    identity, the training options of :data:`RECIPE_OPTIONS` and the steps trained. Nothing in it
    depends on paths or the machine."""
    extra, run_key = obj.get("extra") or {}, obj.get("run_key") or {}
    config = extra.get("config") or {}
    contract = {k: v for k, v in (run_key.get("contract") or {}).items() if k not in TARGET_IDENTITY}
    recipe = {**contract, **{k: config[k] for k in RECIPE_OPTIONS if k in config},
              **{k: run_key[k] for k in ("world_size", "grad_accum", "pack_budget") if k in run_key},
              "steps": int((obj.get("cursor") or {}).get("global_step", 0))}
    return export_block(serving=extra.get("serving_mode"), dataset_fingerprint=run_key.get("data_fingerprint"),
                        recipe=recipe)


def export(run: str | Path, out: str | Path, *, dtype: str = "float32", overwrite: bool = False) -> dict:
    """Write ``run``'s export at ``out``; returns the export's sidecar (``export.json``) as a dict."""
    from dflash_prep.train import checkpoint as ckpt
    from dflash_prep.train.objectives import registry

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    path = ckpt.path_of(run)
    obj = ckpt.load(path)
    name = (obj.get("run_key", {}).get("contract") or {}).get("objective")
    if name is None:
        raise FormatError(f"{path}: the checkpoint's run contract names no objective; it was not written by this "
                          "trainer")
    spec = registry.get(name)
    if spec.export is None:
        raise ConfigError(f"{path}: an --objective {name} run has nothing to export here (it saves its model in "
                          "the run folder itself); export takes a drafter run")
    return spec.export(obj, path, out, dtype=dtype, overwrite=overwrite)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m dflash_prep.train.export",
                                 description="Write a drafter run in the format the serving engines load (the run's "
                                             "objective decides: DFlash, ...): config.json + model.safetensors + "
                                             "export.json, in one atomic rename.")
    ap.add_argument("run", type=Path, help="drafter run folder (checkpoint.pt) or checkpoint file")
    ap.add_argument("--out", required=True, type=Path, help="folder to write")
    ap.add_argument("--dtype", default="float32", choices=DTYPES, help="weight dtype in model.safetensors")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    a = ap.parse_args(argv)
    try:
        side = export(a.run, a.out, dtype=a.dtype, overwrite=a.overwrite)
    except DflashError as e:
        raise SystemExit(f"error: {e}") from None
    print(f"exported {a.out}: {side['summary']}, {side['parameters']:,} parameters ({a.dtype})")
    return side


if __name__ == "__main__":
    main()
