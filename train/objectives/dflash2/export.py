"""Export a trained DFlash2 drafter in the public serving format, and load such a folder back.

The folder is DFlash's (:mod:`dflash_prep.train.objectives.dflash.export`, whose writer, reader
and strict loader this module reuses), with what DFlash2 adds (the public contract:
z-lab/dflash ``DFlash2DraftModel`` at 10129599, vLLM ``qwen3_dflash2.py``; docs/dflash.md#dflash2-export):

- ``config.json``: DFlash's Qwen3 fields (heads, sizes, RoPE, ``layer_types`` /
  ``use_sliding_window`` / ``sliding_window`` / ``max_window_layers``, ``vocab_size`` = the
  target's, ``num_target_layers``, the top-level ``block_size``, which the public model reads
  only when ``dflash_config`` has none), with

  - ``architectures: ["DFlash2DraftModel"]``, ``model_type: "qwen3"``;
  - ``is_causal: false``: the public model and vLLM make a ``sliding_attention`` layer causal
    inside the block unless ``is_causal`` says otherwise; our drafter's block attention is
    bidirectional in every layer (the released DFlash2 config says the same);
  - no ``auto_map``: DFlash's points at ``DFlashDraftModel``, which would build the wrong
    module (the released DFlash2 config has none);
  - ``dflash_config``: ``block_size``, ``mask_token_id``, ``target_layer_ids``,
    ``conv_kernel_size``, ``conv_group_size``, ``selector_rank``, ``selector_top_k`` and
    ``output_multiplier: 1.0`` (vLLM reads the DFlash2 fields only here). Our unary logits are
    the target head's raw logits, so the multiplier is 1 and there is no
    ``final_logit_softcapping``;
  - for an export of a run, our ``dflash_prep`` block (serving mode, chat-template hash, dataset
    fingerprint, recipe: :func:`dflash_prep.train.export.provenance`), which vLLM ignores;

- ``model.safetensors``: the drafter's state dict as is: DFlash's tensors plus
  ``layers.N.{attention_conv,mlp_conv}.{base_kernel [2, T, H], kernel_projection.weight [2*T*G, H]}``
  and ``candidate_selector.{hidden_projection.weight [R, H], predecessor_codebook [V, R],
  successor_codebook [V, R]}`` (the codebooks bare tensors, no ``.weight``; no
  ``embed_tokens``/``lm_head``);
- ``export.json``: DFlash's sidecar (format ``dflash-prep/drafter-export`` v1: source,
  ``drafter_config``, fingerprints of the two files) with ``kind: "dflash2"``. Same format and
  version because the schema is the same; ``kind`` says which drafter config ``drafter_config``
  holds (a DFlash sidecar has no ``kind``), and :func:`load_export` refuses a sidecar of
  another kind.

:func:`load_export` reads a folder back into :class:`DFlash2Drafter` strictly (missing, extra or
mis-shaped tensors, a changed file, a causal or mixed-attention config are refused with the
reason); it also reads a published DFlash2 folder without a sidecar. Such a folder may scale
and softcap its unary logits (``output_multiplier``, ``final_logit_softcapping``) or its block
embeddings (``input_embedding_scale``): those are not drafter parameters, so they come back in
the meta dict (:mod:`.decode` applies the logit transform, in the z-lab order).
``selector_init`` is not in the public config: it comes from the sidecar when there is one
(else the default), so an export reloads to the config it was written from.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_prep.errors import FormatError
from dflash_prep.train.objectives.dflash import export as dflash_export
from dflash_prep.train.objectives.dflash.export import CONFIG_FILE, drafter_of_checkpoint
from dflash_prep.train.objectives.dflash2.drafter import DFlash2Config, DFlash2Drafter

ARCHITECTURE = "DFlash2DraftModel"
KIND = "dflash2"
SHAPE_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
"""The DFlash2 fields of ``dflash_config`` (after DFlash's block_size, mask_token_id, target_layer_ids)."""
DFLASH_CONFIG_FIELDS = ("block_size", "mask_token_id", "target_layer_ids", *SHAPE_FIELDS, "output_multiplier")
"""Exactly the ``dflash_config`` keys an export writes, in this order."""


# ----------------------------------------------------------------------------- config mapping
def public_config(cfg: DFlash2Config, *, dtype: str = "float32") -> dict:
    """The public DFlash2 ``config.json`` for a drafter (module docstring): DFlash's, edited."""
    base = dflash_export.public_config(cfg, dtype=dtype)
    out = {}
    for k, v in base.items():
        if k == "architectures":
            out[k] = [ARCHITECTURE]
        elif k == "auto_map":
            continue
        elif k == "dflash_config":
            out["is_causal"] = False
            out[k] = {"block_size": cfg.block_size, **v, **{f: int(getattr(cfg, f)) for f in SHAPE_FIELDS},
                      "output_multiplier": 1.0}
        else:
            out[k] = v
    assert tuple(out["dflash_config"]) == DFLASH_CONFIG_FIELDS
    return out


def config_from_public(c: dict, *, path: str | Path = CONFIG_FILE, sidecar: dict | None = None) -> DFlash2Config:
    """A :class:`DFlash2Config` from a public DFlash2 ``config.json`` dict (and the sidecar, for
    ``selector_init``); refuses what our drafter cannot represent, with the reason."""
    dfc = c.get("dflash_config") or {}
    if ARCHITECTURE in (c.get("architectures") or []):
        missing = [f for f in SHAPE_FIELDS if dfc.get(f) is None]
        if missing:
            raise FormatError(f"{path}: dflash_config lacks {missing}; a DFlash2 config names its convolution "
                              "and selector sizes there")
        causal = _causal_layers(c)
        if causal:
            raise FormatError(f"{path}: the public model runs layers {causal} causally inside the block "
                              f"(is_causal {c.get('is_causal')!r}, layer_types {c.get('layer_types')}); this "
                              "drafter's block attention is bidirectional: set is_causal false or re-export")
    extra = {f: int(dfc[f]) for f in SHAPE_FIELDS if dfc.get(f) is not None}
    init = ((sidecar or {}).get("drafter_config") or {}).get("selector_init")
    if init is not None:
        extra["selector_init"] = init
    return dflash_export.config_from_public(c, path=path, architecture=ARCHITECTURE, config_type=DFlash2Config,
                                            extra=extra)


def _causal_layers(c: dict) -> list[int]:
    """The layers the public model (and vLLM) make causal: all when ``is_causal`` is true; with
    no ``is_causal`` (nor vLLM's ``dflash_config.causal``), the ``sliding_attention`` ones, the
    layer types read as Qwen3Config fills them in (sliding from ``max_window_layers`` on when
    ``use_sliding_window``)."""
    n = int(c.get("num_hidden_layers", 0))
    flag = c.get("is_causal")
    if flag is None:
        flag = (c.get("dflash_config") or {}).get("causal")
    if flag is not None:
        return list(range(n)) if flag else []
    sliding = bool(c.get("use_sliding_window")) and c.get("sliding_window") is not None
    types = c.get("layer_types") or ["sliding_attention" if sliding and i >= int(c.get("max_window_layers", 28))
                                     else "full_attention" for i in range(n)]
    return [i for i, t in enumerate(types) if t == "sliding_attention"]


def unary_fields(c: dict) -> dict:
    """What a public config says about the unary logits and the block embeddings (not parameters):
    ``output_multiplier`` (1.0 when absent), ``final_logit_softcapping`` (None when absent or <= 0),
    ``input_embedding_scale`` (1.0 when absent); read from ``dflash_config``, else the top level,
    as the public model reads them."""
    dfc = c.get("dflash_config") or {}

    def val(name, default):
        v = dfc.get(name, c.get(name, default))
        return default if v is None else float(v)

    cap = val("final_logit_softcapping", 0.0)
    return {"output_multiplier": val("output_multiplier", 1.0), "final_logit_softcapping": cap if cap > 0 else None,
            "input_embedding_scale": val("input_embedding_scale", 1.0)}


# ----------------------------------------------------------------------------- export / load
def _summary(cfg: DFlash2Config) -> str:
    return (f"{cfg.num_layers} DFlash2 draft layers, B = {cfg.block_size}, taps {list(cfg.target_layer_ids)}, "
            f"mask {cfg.mask_token_id}, conv T = {cfg.conv_kernel_size} group {cfg.conv_group_size}, "
            f"selector R = {cfg.selector_rank} K = {cfg.selector_top_k}")


def write_export(drafter: DFlash2Drafter, out: str | Path, *, source: dict, dtype: str = "float32",
                 overwrite: bool = False, provenance: dict | None = None) -> dict:
    """Write ``drafter`` as a public DFlash2 folder (module docstring); the sidecar dict; a run's
    ``provenance`` goes into ``config.json`` as its ``dflash_prep`` block."""
    if not isinstance(drafter, DFlash2Drafter):
        raise FormatError(f"a DFlash2 export takes a DFlash2Drafter, got {type(drafter).__name__}")
    return dflash_export.write_export(drafter, out, source=source, dtype=dtype, overwrite=overwrite,
                                      public=public_config, provenance=provenance,
                                      sidecar_extra={"kind": KIND, "summary": _summary(drafter.config)})


def export_checkpoint(obj: dict, path: Path, out: str | Path, *, dtype: str = "float32",
                      overwrite: bool = False) -> dict:
    """The DFlash2 objective's ``export`` hook: a loaded checkpoint ``obj`` (read from ``path``) -> ``out``."""
    from dflash_prep.train.export import provenance

    drafter, info = drafter_of_checkpoint(obj, path, drafter_type=DFlash2Drafter)
    return write_export(drafter, out, source=info, dtype=dtype, overwrite=overwrite, provenance=provenance(obj))


def load_export(path: str | Path, *, dtype: torch.dtype = torch.float32) -> tuple[DFlash2Drafter, dict]:
    """Our :class:`DFlash2Drafter` from a DFlash2 folder, strictly; and DFlash's meta dict
    (``block_size``, ``mask_token_id``, ``target_layer_ids``, ``hidden_size``, ``vocab_size``,
    ``export``) plus :func:`unary_fields` (``output_multiplier``, ``final_logit_softcapping``,
    ``input_embedding_scale``) and the convolution/selector sizes."""
    seen: dict = {}

    def read(c, *, path, sidecar):
        if sidecar is not None and sidecar.get("kind") != KIND:
            raise FormatError(f"{Path(path).parent / dflash_export.SIDECAR_FILE}: kind {sidecar.get('kind')!r}, "
                              f"not {KIND!r}: this folder holds another drafter's export")
        seen["c"] = c
        return config_from_public(c, path=path, sidecar=sidecar)

    drafter, meta = dflash_export.load_export(path, dtype=dtype, drafter_type=DFlash2Drafter, read_config=read)
    cfg = drafter.config
    return drafter, {**meta, **unary_fields(seen["c"]), **{f: int(getattr(cfg, f)) for f in SHAPE_FIELDS}}


__all__ = ["ARCHITECTURE", "DFLASH_CONFIG_FIELDS", "KIND", "config_from_public", "export_checkpoint", "load_export",
           "public_config", "unary_fields", "write_export"]
