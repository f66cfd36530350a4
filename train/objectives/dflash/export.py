"""Export a trained drafter in the public DFlash format, and load such a folder back.

    python -m dflash_prep.train.export RUN --out DIR [--dtype bfloat16] [--overwrite]

``RUN`` is a drafter run folder (its ``checkpoint.pt``) or the checkpoint file itself. ``DIR``
gets, through one atomic folder rename (nothing half-written is ever visible under ``DIR``):

- ``config.json``: what the public loader (z-lab/dflash ``DFlashDraftModel``, a
  ``Qwen3PreTrainedModel`` with ``config_class = Qwen3Config``) reads: the Qwen3 fields
  (``hidden_size``, ``num_hidden_layers`` = draft layers, heads, ``head_dim``,
  ``intermediate_size``, ``rms_norm_eps``, RoPE base as both ``rope_theta`` and
  ``rope_parameters``, ``vocab_size`` = the target's, ``layer_types`` all ``full_attention``
  and ``use_sliding_window`` false, or for a drafter trained with ``--sliding-window W`` all
  ``sliding_attention`` with ``use_sliding_window`` true, ``sliding_window`` W and
  ``max_window_layers`` 0 (Qwen3Config drops ``sliding_window`` unless ``use_sliding_window``
  is set), ...), ``model_type`` ``qwen3``, ``architectures``
  ``["DFlashDraftModel"]``, ``auto_map`` ``{"AutoModel": "dflash.DFlashDraftModel"}`` (the
  published drafters' convention: ``AutoModel(..., trust_remote_code=True)`` finds the class in
  a ``dflash.py`` beside the weights, which this export does not ship), plus the DFlash fields
  ``block_size``, ``num_target_layers`` and ``dflash_config: {mask_token_id, target_layer_ids}``;
- ``model.safetensors``: the drafter's state dict under the public names
  (``layers.N.self_attn.{q,k,v,o}_proj``, ``q_norm``, ``k_norm``, ``mlp.{gate,up,down}_proj``,
  ``input_layernorm``, ``post_attention_layernorm``, ``norm``, ``fc``, ``hidden_norm``): our
  :class:`~dflash_prep.train.objectives.dflash.drafter.Drafter` uses those names, so the keys match the public
  module one to one (it has no ``embed_tokens``/``lm_head``: those are the target's);
- ``config.json``'s ``dflash_prep`` block, for an export of a run (not a bare drafter): the
  serving mode and chat template the data was made with, the dataset fingerprint and the recipe
  (:func:`dflash_prep.train.export.provenance`); the public loader and vLLM ignore it;
- ``export.json`` (format ``dflash-prep/drafter-export`` v1): where it came from (checkpoint
  path, its SHA fingerprint and step, the run contract the checkpoint recorded) and the
  fingerprints of ``config.json`` and ``model.safetensors``, which :func:`load_export` checks.

:func:`load_export` reads a folder back into our ``Drafter`` with strict key and shape
matching; it also reads a public DFlash folder (no ``export.json``), e.g. a published drafter,
as long as it is the Qwen3-style kind with one attention type in every layer (full, or
sliding with one window).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from dflash_prep.engine.serving_mode import BLOCK_KEY
from dflash_prep.errors import ConfigError, FingerprintMismatch, FormatError
from dflash_prep.formats.fileio import atomic_dir, atomic_write_bytes, atomic_write_json, fingerprint_bytes, read_json

from dflash_prep.train.objectives.dflash.drafter import Drafter, DrafterConfig

EXPORT_FORMAT = "dflash-prep/drafter-export"
EXPORT_VERSION = 1
CONFIG_FILE, WEIGHTS_FILE, SIDECAR_FILE = "config.json", "model.safetensors", "export.json"
ARCHITECTURE = "DFlashDraftModel"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def file_fingerprint(path: str | Path) -> str:
    """SHA-256 (first 128 bits, hex) of a file's bytes, read in 16 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()[:32]


def folder_fingerprint(path: str | Path) -> str:
    """One digest of a model folder: name and bytes of each ``*.json``, ``*.safetensors`` and
    ``*.bin`` file at its top level, in name order (the config, tokenizer and weights)."""
    path = Path(path)
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors", ".bin")
                   and p.name != SIDECAR_FILE)
    if not files:
        raise FormatError(f"{path}: no config or weight files to fingerprint")
    return fingerprint_bytes(*[f"{p.name}:{file_fingerprint(p)}" for p in files])


# ----------------------------------------------------------------------------- config mapping
def public_config(cfg: DrafterConfig, *, dtype: str = "float32") -> dict:
    """The public DFlash ``config.json`` for a drafter (module docstring)."""
    return {
        "architectures": [ARCHITECTURE],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)},
        "hidden_size": cfg.hidden,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position,
        "vocab_size": cfg.vocab_size,
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "is_causal": False,
        **_window_fields(cfg),
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


def _window_fields(cfg: DrafterConfig) -> dict:
    """The Qwen3 attention-type fields of a drafter with ``sliding_window`` W (0 = full)."""
    if cfg.sliding_window == 0:
        return {"layer_types": ["full_attention"] * cfg.num_layers, "use_sliding_window": False,
                "sliding_window": None, "max_window_layers": cfg.num_layers}
    return {"layer_types": ["sliding_attention"] * cfg.num_layers, "use_sliding_window": True,
            "sliding_window": cfg.sliding_window, "max_window_layers": 0}


def public_window(c: dict, *, path: str | Path = CONFIG_FILE) -> int:
    """The one sliding window (0 = full) every layer of a public config applies, read the way
    Qwen3Config and the public layer do: ``sliding_window`` counts only with
    ``use_sliding_window``; missing ``layer_types`` default to sliding from layer
    ``max_window_layers`` on; a ``sliding_attention`` layer uses that window, others none."""
    n = int(c.get("num_hidden_layers", 0))
    w = c.get("sliding_window") if c.get("use_sliding_window") else None
    types = c.get("layer_types") or ["sliding_attention" if w is not None and i >= int(c.get("max_window_layers", 28))
                                     else "full_attention" for i in range(n)]
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise FormatError(f"{path}: layer_types {unknown} are not supported (full_attention or sliding_attention)")
    windows = {int(w) if (t == "sliding_attention" and w is not None) else 0 for t in types}
    if len(windows) > 1:
        raise FormatError(f"{path}: draft layers mix full and sliding-window attention ({types}, sliding_window {w}); "
                          "this drafter applies one window to every layer: re-export with one layer type")
    return windows.pop() if windows else 0


def config_from_public(c: dict, *, path: str | Path = CONFIG_FILE, architecture: str = ARCHITECTURE,
                       config_type: type = DrafterConfig, extra: dict | None = None) -> DrafterConfig:
    """A :class:`DrafterConfig` from a public DFlash ``config.json`` dict; refuses what our
    drafter cannot represent (layers of mixed attention types, RoPE scaling, another architecture).

    A variant reuses it: ``architecture`` is the one ``architectures`` must name,
    ``config_type`` the config class built, with its own fields ``extra`` (read by the caller).
    ``block_size`` is read the way the public model reads it: ``dflash_config``'s, else the
    top-level field."""
    if architecture not in (c.get("architectures") or []):
        raise FormatError(f"{path}: architectures {c.get('architectures')!r} lacks {architecture!r}; "
                          f"not a {architecture} drafter folder")
    window = public_window(c, path=path)
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise FormatError(f"{path}: RoPE type {rope.get('rope_type')!r} is not supported (default RoPE only)")
    dfc = c.get("dflash_config") or {}
    try:
        L, N = int(c["num_target_layers"]), int(c["num_hidden_layers"])
        heads = int(c["num_attention_heads"])
        if dfc.get("mask_token_id") is None:
            raise KeyError("dflash_config.mask_token_id")
        from dflash_prep.train.objectives.dflash.drafter import build_target_layer_ids

        ids = dfc.get("target_layer_ids") or build_target_layer_ids(L, N)
        return config_type(
            hidden=int(c["hidden_size"]), heads=heads, kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // heads),
            intermediate=int(c["intermediate_size"]), num_layers=N, rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            max_position=int(c.get("max_position_embeddings", 4096)),
            block_size=int(dfc["block_size"] if dfc.get("block_size") is not None else c["block_size"]),
            num_target_layers=L, target_layer_ids=tuple(ids), mask_token_id=int(dfc["mask_token_id"]),
            vocab_size=int(c["vocab_size"]), attention_bias=bool(c.get("attention_bias", False)),
            sliding_window=window, **(extra or {}))
    except KeyError as e:
        raise FormatError(f"{path}: missing field {e} of the DFlash config") from None


# ----------------------------------------------------------------------------- run -> drafter
def load_run(run: str | Path) -> tuple[Drafter, dict]:
    """The drafter of a run folder (or checkpoint file) and what the checkpoint says about it:
    ``checkpoint`` (path), ``checkpoint_fingerprint``, ``global_step``, ``run_key``."""
    from dflash_prep.train import checkpoint as ckpt

    path = ckpt.path_of(run)
    return drafter_of_checkpoint(ckpt.load(path), path)


def drafter_of_checkpoint(obj: dict, path: Path, drafter_type=Drafter) -> tuple[Drafter, dict]:
    """:func:`load_run` of a loaded checkpoint ``obj`` (read from ``path``); ``drafter_type``: the
    module to build (a variant's drafter class, whose config class is its ``config_type``)."""
    mc = obj["model_config"]
    mc = mc.get("drafter", mc) if isinstance(mc, dict) else mc
    try:
        cfg = drafter_type.config_type.from_dict(mc)
    except TypeError as e:
        raise FormatError(f"{path}: the checkpoint's model_config is not a drafter's ({e}); export takes a "
                          "drafter run (the dflash objective), not an LM run") from None
    drafter = drafter_type(cfg)
    _load_strict(drafter, obj["model"], where=str(path))
    info = {"checkpoint": str(path), "checkpoint_fingerprint": file_fingerprint(path),
            "global_step": int(obj["cursor"].get("global_step", 0)), "run_key": obj["run_key"]}
    return drafter, info


def _load_strict(drafter: Drafter, state: dict, *, where: str) -> None:
    want = drafter.state_dict()
    missing, unexpected = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    shapes = [f"{k}: {tuple(state[k].shape)} vs {tuple(v.shape)}" for k, v in want.items()
              if k in state and tuple(state[k].shape) != tuple(v.shape)]
    if missing or unexpected or shapes:
        raise FormatError(f"{where}: weights do not match the drafter config (missing {missing[:5]}, unexpected "
                          f"{unexpected[:5]}, shape mismatches {shapes[:5]})")
    drafter.load_state_dict({k: v.to(want[k].dtype) for k, v in state.items()}, strict=True)


# ----------------------------------------------------------------------------- export / load
def export(run: str | Path, out: str | Path, *, dtype: str = "float32", overwrite: bool = False) -> dict:
    """Write the public DFlash folder for ``run`` at ``out`` (module docstring); the sidecar dict."""
    from dflash_prep.train import checkpoint as ckpt

    path = ckpt.path_of(run)
    return export_checkpoint(ckpt.load(path), path, out, dtype=dtype, overwrite=overwrite)


def export_checkpoint(obj: dict, path: Path, out: str | Path, *, dtype: str = "float32",
                      overwrite: bool = False) -> dict:
    """:func:`export` of a loaded checkpoint (the objective's ``export`` hook, :mod:`dflash_prep.train.export`)."""
    from dflash_prep.train.export import provenance

    drafter, info = drafter_of_checkpoint(obj, path)
    return write_export(drafter, out, source=info, dtype=dtype, overwrite=overwrite, provenance=provenance(obj))


def write_export(drafter: Drafter, out: str | Path, *, source: dict, dtype: str = "float32",
                 overwrite: bool = False, public=None, sidecar_extra: dict | None = None,
                 provenance: dict | None = None) -> dict:
    """Write ``drafter`` as a public DFlash folder; ``source`` goes into ``export.json``,
    ``provenance`` (a run's, :func:`dflash_prep.train.export.provenance`) into ``config.json`` as
    its ``dflash_prep`` block.

    A variant reuses it: ``public(cfg, dtype=...)`` builds its ``config.json`` dict (default
    :func:`public_config`), ``sidecar_extra`` is merged into the sidecar (its ``kind``, its
    ``summary``)."""
    from safetensors.torch import save

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    cfg = drafter.config
    tensors = {k: v.detach().to("cpu", DTYPES[dtype]).contiguous() for k, v in drafter.state_dict().items()}
    weights = save(tensors, metadata={"format": "pt"})
    config = (json.dumps(with_provenance((public or public_config)(cfg, dtype=dtype), provenance), indent=2)
              + "\n").encode()
    summary = (f"{cfg.num_layers} draft layers, B = {cfg.block_size}, taps {list(cfg.target_layer_ids)}, "
               f"mask {cfg.mask_token_id}")
    sidecar = {"source": source, "drafter_config": cfg.to_dict(), "summary": summary, "dtype": dtype,
               "config_fingerprint": fingerprint_bytes(config), "weights_fingerprint": fingerprint_bytes(weights),
               "parameters": int(sum(t.numel() for t in tensors.values())), **(sidecar_extra or {})}
    with atomic_dir(out, overwrite=overwrite) as tmp:
        atomic_write_bytes(tmp / CONFIG_FILE, config)
        atomic_write_bytes(tmp / WEIGHTS_FILE, weights)
        atomic_write_json(tmp / SIDECAR_FILE, sidecar, format=EXPORT_FORMAT, version=EXPORT_VERSION)
    return sidecar


def with_provenance(config: dict, provenance: dict | None) -> dict:
    """``config`` with the run's ``dflash_prep`` block last (none for a bare drafter's export)."""
    return config if provenance is None else {**config, BLOCK_KEY: provenance}


def read_folder(path: Path, *, fmt: str, versions: tuple[int, ...]) -> tuple[dict, dict, dict | None]:
    """``(config.json as a dict, the tensors of model.safetensors, export.json or None)`` of an exported
    drafter folder (any objective's: ``fmt``/``versions`` name its sidecar); a sidecar's fingerprints
    are checked against both files first. Missing, changed or unreadable files are refused by name."""
    from safetensors.torch import load

    cfile, wfile = path / CONFIG_FILE, path / WEIGHTS_FILE
    for f in (cfile, wfile):
        if not f.is_file():
            raise FormatError(f"{f}: not found; point --drafter at an exported drafter folder "
                              "(python -m dflash_prep.train.export RUN --out DIR)")
    cbytes, wbytes = cfile.read_bytes(), wfile.read_bytes()
    sidecar = None
    if (path / SIDECAR_FILE).is_file():
        sidecar = read_json(path / SIDECAR_FILE, format=fmt, versions=versions)
        for name, data, key in ((CONFIG_FILE, cbytes, "config_fingerprint"), (WEIGHTS_FILE, wbytes, "weights_fingerprint")):
            if fingerprint_bytes(data) != sidecar.get(key):
                raise FingerprintMismatch(f"{path / name}: its fingerprint differs from {SIDECAR_FILE}'s; the file "
                                          "was changed or truncated after export; export the run again")
    try:
        c = json.loads(cbytes)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FormatError(f"{cfile}: not valid JSON ({e})") from None
    try:
        state = load(wbytes)
    except Exception as e:  # safetensors raises its own error type for a bad header
        raise FormatError(f"{wfile}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    return c, state, sidecar


def load_export(path: str | Path, *, dtype: torch.dtype = torch.float32, drafter_type: type = Drafter,
                read_config=None) -> tuple[Drafter, dict]:
    """Our :class:`Drafter` from a public DFlash folder, strict key/shape match; and a dict of
    ``block_size``, ``mask_token_id``, ``target_layer_ids``, ``hidden_size``, ``vocab_size``,
    ``export`` (the sidecar, or None for a folder this tool did not write).

    A variant reuses it: ``drafter_type`` is the module built and
    ``read_config(config_dict, path=..., sidecar=...)`` its config (default :func:`config_from_public`);
    the sidecar's fingerprints are checked before either runs (:func:`read_folder`)."""
    path = Path(path)
    c, state, sidecar = read_folder(path, fmt=EXPORT_FORMAT, versions=(EXPORT_VERSION,))
    cfile, wfile = path / CONFIG_FILE, path / WEIGHTS_FILE
    cfg = config_from_public(c, path=cfile) if read_config is None else read_config(c, path=cfile, sidecar=sidecar)
    drafter = drafter_type(cfg).to(dtype)
    _load_strict(drafter, state, where=str(wfile))
    meta = {"block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": list(cfg.target_layer_ids), "hidden_size": cfg.hidden, "vocab_size": cfg.vocab_size,
            "export": sidecar}
    return drafter.eval(), meta
