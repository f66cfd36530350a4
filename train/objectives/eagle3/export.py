"""Write an EAGLE-3 drafter as a folder vLLM and SGLang load (SpecForge's ``LlamaForCausalLMEagle3``); read it back.

:func:`write_export` gives ``DIR``, through one atomic folder rename (nothing half-written is ever
visible under ``DIR``):

- ``config.json``: a Llama config with ``architectures ["LlamaForCausalLMEagle3"]``, ``model_type
  "llama"``, ``num_hidden_layers 1``, the draft's ``hidden_size``, ``intermediate_size``, heads,
  ``head_dim``, ``rms_norm_eps``, ``vocab_size`` (the target's), ``draft_vocab_size``,
  ``target_hidden_size``, ``tie_word_embeddings false``, ``max_position_embeddings``, the RoPE as
  ``rope_theta`` + ``rope_scaling`` (transformers 4, vLLM, SGLang) and ``rope_parameters``
  (transformers 5, SpecForge), ``norm_before_residual false`` (vLLM's switch; false is SpecForge's
  layer: the residual is the un-normed hidden state), ``torch_dtype``/``dtype``, and the taps in both
  engines' conventions:

  - top-level ``eagle_aux_hidden_state_layer_ids`` = ``[l + 1]`` (vLLM: id j captures the residual
    stream entering layer j, the output of layer j - 1, HF ``hidden_states[j]``);
  - ``eagle_config.eagle_aux_hidden_state_layer_ids`` = ``[l]`` (SGLang and SpecForge: id j is the
    output of layer j; SGLang's target adds one and captures the input of layer j + 1), with
    ``eagle_config.use_aux_hidden_state true``;

  where ``l`` are our ``target_layer_ids`` (outputs of 0-based layers); plus ``num_target_layers``
  when known. (vLLM: ``llama.py`` appends ``hidden_states + residual`` before layer ``idx`` when ``idx
  in aux_hidden_state_layers``; SGLang: ``set_eagle3_layers_to_capture`` stores ``val + 1``.)
  An export of a run adds our ``dflash_prep`` block (serving mode, chat-template hash, dataset
  fingerprint, recipe: :func:`dflash_prep.train.export.provenance`), which both engines ignore.
- ``model.safetensors``: exactly the drafter's state dict, the names SpecForge saves and both engines
  read: ``embed_tokens.weight`` (the target's embedding; vLLM and SGLang share the target's anyway),
  ``fc.weight``, ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
  ``midlayer.self_attn.{q,k,v,o}_proj.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``,
  ``norm.weight``, ``lm_head.weight``, ``d2t`` (int64, kept) and ``t2d`` (bool, kept); float tensors
  in ``--dtype``.
- ``export.json`` (format ``dflash-prep/eagle3-export`` v1): ``source`` (what the caller says it came
  from: checkpoint, step, run contract), the drafter config, dtype, parameter count, and the
  fingerprints of ``config.json`` and ``model.safetensors``, which :func:`load_export` checks.

:func:`load_export` reads a folder strictly: missing, extra, mis-shaped or mis-typed tensors, an
inconsistent d2t/t2d, taps that collide or whose two conventions disagree are refused with the
reason (FormatError); a folder without ``export.json`` (another tool's) is read the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash_prep.errors import ConfigError, FormatError
from dflash_prep.formats.fileio import atomic_dir, atomic_write_bytes, atomic_write_json, fingerprint_bytes

from .model import Eagle3Config, Eagle3Drafter, check_vocab_map

EXPORT_FORMAT = "dflash-prep/eagle3-export"
EXPORT_VERSION = 1
CONFIG_FILE, WEIGHTS_FILE, SIDECAR_FILE = "config.json", "model.safetensors", "export.json"
ARCHITECTURE = "LlamaForCausalLMEagle3"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EXACT_DTYPES = {"d2t": torch.int64, "t2d": torch.bool}
"""Tensors written and read in their own dtype, whatever ``--dtype`` says."""


# ----------------------------------------------------------------------------- config mapping
def _rope_scaling(cfg: Eagle3Config) -> dict | None:
    if cfg.rope_type == "default":
        return None
    d = {"rope_type": cfg.rope_type, "factor": cfg.rope_factor}
    if cfg.rope_type == "llama3":
        d.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
                 original_max_position_embeddings=cfg.rope_original_max_position)
    return d


def public_config(cfg: Eagle3Config, *, dtype: str = "float32") -> dict:
    """The ``config.json`` of a drafter (module docstring)."""
    scaling = _rope_scaling(cfg)
    c = {
        "architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": cfg.hidden, "intermediate_size": cfg.intermediate,
        "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "rms_norm_eps": cfg.rms_eps,
        "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden,
        "tie_word_embeddings": False, "max_position_embeddings": cfg.max_position,
        "rope_theta": cfg.rope_theta, "rope_scaling": scaling,
        "rope_parameters": {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta,
                            **{k: v for k, v in (scaling or {}).items() if k != "rope_type"}},
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1,
        "initializer_range": 0.02, "use_cache": True, "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.target_layer_ids), "use_aux_hidden_state": True},
        "torch_dtype": dtype, "dtype": dtype,
    }
    if cfg.num_target_layers is not None:
        c["num_target_layers"] = cfg.num_target_layers
    return c


def _taps(c: dict, path) -> list[int]:
    """Our output-of-layer ids from either convention; both present must agree."""
    sgl = (c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    vllm = c.get("eagle_aux_hidden_state_layer_ids")
    if sgl is None and vllm is None:
        raise FormatError(f"{path}: no tapped layers (neither eagle_aux_hidden_state_layer_ids nor "
                          "eagle_config.eagle_aux_hidden_state_layer_ids); the engines would guess their default")
    if sgl is not None and vllm is not None and [int(j) - 1 for j in vllm] != [int(j) for j in sgl]:
        raise FormatError(f"{path}: the taps disagree: vLLM's eagle_aux_hidden_state_layer_ids {vllm} (input of "
                          f"layer j) must be SGLang's eagle_config ids {sgl} (output of layer j) plus one")
    return [int(j) for j in sgl] if sgl is not None else [int(j) - 1 for j in vllm]


def config_from_public(c: dict, *, path: str | Path = CONFIG_FILE) -> Eagle3Config:
    """An :class:`Eagle3Config` from an exported ``config.json`` dict; refuses what the drafter cannot
    be (another architecture, more than one layer, an unsupported RoPE, colliding taps)."""
    if ARCHITECTURE not in (c.get("architectures") or []):
        raise FormatError(f"{path}: architectures {c.get('architectures')!r} lacks {ARCHITECTURE!r}; "
                          "not an EAGLE-3 drafter folder")
    if int(c.get("num_hidden_layers", 1)) != 1:
        raise FormatError(f"{path}: num_hidden_layers {c['num_hidden_layers']}; the EAGLE-3 drafter has one layer")
    if c.get("fc_norm") or c.get("norm_before_residual") or c.get("tie_word_embeddings"):
        raise FormatError(f"{path}: fc_norm, norm_before_residual and tie_word_embeddings must be false")
    rope = dict(c.get("rope_parameters") or {**(c.get("rope_scaling") or {}), "rope_theta": c.get("rope_theta", 1e4)})
    try:
        heads, H, V = int(c["num_attention_heads"]), int(c["hidden_size"]), int(c["vocab_size"])
        return Eagle3Config(
            hidden=H, heads=heads, kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or H // heads), intermediate=int(c["intermediate_size"]), vocab_size=V,
            draft_vocab_size=int(c.get("draft_vocab_size") or V), target_hidden=int(c.get("target_hidden_size") or H),
            rms_eps=float(c.get("rms_norm_eps", 1e-6)), rope_theta=float(rope.get("rope_theta", 1e4)),
            max_position=int(c.get("max_position_embeddings", 4096)), target_layer_ids=tuple(_taps(c, path)),
            num_target_layers=int(c["num_target_layers"]) if c.get("num_target_layers") is not None else None,
            rope_type=rope.get("rope_type", rope.get("type", "default")), rope_factor=float(rope.get("factor", 1.0)),
            rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            rope_original_max_position=int(rope.get("original_max_position_embeddings", 8192)))
    except KeyError as e:
        raise FormatError(f"{path}: missing field {e} of the EAGLE-3 config") from None
    except ConfigError as e:
        raise FormatError(f"{path}: {e}") from None


# ----------------------------------------------------------------------------- write / load
def write_export(drafter: Eagle3Drafter, out: str | Path, *, source: dict, dtype: str = "float32",
                 overwrite: bool = False, provenance: dict | None = None) -> dict:
    """Write ``drafter`` as an engine-loadable folder at ``out`` (module docstring); the sidecar dict;
    a run's ``provenance`` goes into ``config.json`` as its ``dflash_prep`` block."""
    from dflash_prep.train.objectives.dflash.export import with_provenance

    from safetensors.torch import save

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    cfg = drafter.config
    check_vocab_map(drafter.d2t.cpu(), drafter.t2d.cpu(), cfg.vocab_size, cfg.draft_vocab_size)
    tensors = {k: v.detach().to("cpu", EXACT_DTYPES.get(k, DTYPES[dtype])).contiguous()
               for k, v in drafter.state_dict().items()}
    weights = save(tensors, metadata={"format": "pt"})
    config = (json.dumps(with_provenance(public_config(cfg, dtype=dtype), provenance), indent=2) + "\n").encode()
    sidecar = {"source": source, "drafter_config": cfg.to_dict(), "dtype": dtype,
               "config_fingerprint": fingerprint_bytes(config), "weights_fingerprint": fingerprint_bytes(weights),
               "parameters": int(sum(t.numel() for k, t in tensors.items() if k not in EXACT_DTYPES))}
    with atomic_dir(out, overwrite=overwrite) as tmp:
        atomic_write_bytes(tmp / CONFIG_FILE, config)
        atomic_write_bytes(tmp / WEIGHTS_FILE, weights)
        atomic_write_json(tmp / SIDECAR_FILE, sidecar, format=EXPORT_FORMAT, version=EXPORT_VERSION)
    return sidecar


def _check_state(state: dict, want: dict, where: str) -> None:
    missing, unexpected = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    shapes = [f"{k}: {list(state[k].shape)} vs {list(v.shape)}" for k, v in want.items()
              if k in state and state[k].shape != v.shape]
    dtypes = [f"{k}: {state[k].dtype} vs {EXACT_DTYPES.get(k, 'a float type')}" for k in want if k in state and (
        state[k].dtype != EXACT_DTYPES[k] if k in EXACT_DTYPES else not state[k].is_floating_point())]
    if missing or unexpected or shapes or dtypes:
        raise FormatError(f"{where}: the tensors do not match config.json (missing {missing}, unexpected {unexpected}, "
                          f"shape mismatches {shapes}, dtype mismatches {dtypes}); export the drafter again")


def load_export(path: str | Path, *, dtype: torch.dtype = torch.float32) -> tuple[Eagle3Drafter, dict]:
    """Our :class:`Eagle3Drafter` (eval mode, float tensors in ``dtype``) from an exported folder, strictly;
    and a dict of ``target_layer_ids`` (ours), ``vllm_layer_ids``, ``sglang_layer_ids``, ``hidden_size``,
    ``target_hidden_size``, ``vocab_size``, ``draft_vocab_size``, ``export`` (the sidecar, or None)."""
    from dflash_prep.train.objectives.dflash.export import read_folder

    path = Path(path)
    c, state, sidecar = read_folder(path, fmt=EXPORT_FORMAT, versions=(EXPORT_VERSION,))
    cfile, wfile = path / CONFIG_FILE, path / WEIGHTS_FILE
    cfg = config_from_public(c, path=cfile)
    drafter = Eagle3Drafter(cfg).to(dtype)
    want = drafter.state_dict()
    _check_state(state, want, str(wfile))
    try:
        check_vocab_map(state["d2t"], state["t2d"], cfg.vocab_size, cfg.draft_vocab_size)
    except ConfigError as e:
        raise FormatError(f"{wfile}: {e}") from None
    drafter.load_state_dict({k: v.to(want[k].dtype) for k, v in state.items()}, strict=True)
    ids = list(cfg.target_layer_ids)
    meta = {"target_layer_ids": ids, "vllm_layer_ids": [i + 1 for i in ids], "sglang_layer_ids": ids,
            "hidden_size": cfg.hidden, "target_hidden_size": cfg.target_hidden, "vocab_size": cfg.vocab_size,
            "draft_vocab_size": cfg.draft_vocab_size, "export": sidecar}
    return drafter.eval(), meta
