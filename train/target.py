"""The frozen target: a local transformers causal LM whose hidden states a DFlash drafter reads.

- **Loading**: any local ``AutoModelForCausalLM`` folder with a Llama-style decoder
  (``model.layers``: the Qwen3, Llama and Mistral families), once per rank; bf16 on CUDA, fp32
  on CPU; ``eval()``, every parameter ``requires_grad=False``, forwards under ``no_grad``.
- **Packed, document-causal**: documents run concatenated in one row (``[1, T]``) with
  positions restarting at 0 per document, through :func:`dflash_prep.kernels.attention.attention_varlen`,
  registered with transformers' ``AttentionInterface`` as :data:`ATTN_IMPL` (and a mask
  function that builds no mask: the varlen kernel is the mask). No padding, no attention
  across documents: each document's states equal those of a forward over it alone.
- **Taps**: forward hooks on decoder layers ``target_layer_ids`` record their outputs (the
  public ``hidden_states[l + 1]``); the hook of the last tapped layer stops the forward, so
  the layers above it, the final norm and the LM head never run. With ``final=True`` (``--loss
  kl``, which needs the target's next-token distributions) the forward runs to the end and also
  returns the final-normed last hidden states; the LM head is left to the caller, which applies
  it to the labelled positions only, in chunks (:mod:`dflash_prep.train.chunked_kl`).
- **Identity** (:func:`dflash_prep.formats.target.target_identity`, part of the run contract).
- **Where it runs** (:func:`target_provider`): here, on a split job's target rank, or in a serving
  engine (``--target-engine vllm``, :mod:`dflash_prep.train.engines`: its states read from a cache,
  or computed online beside the rank).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from dflash_prep.errors import ConfigError, FormatError
from dflash_prep.tokenize.identity import check_tokenizer
from dflash_prep.train import engines

ATTN_IMPL = "dfprep_varlen"  # no "flash" in the name: transformers reads that as a hub kernel
"""Name of the packed document-causal attention in transformers' registry."""
_CU, _MAX = "dflash_cu_seqlens", "dflash_max_seqlen"  # forward kwargs carried to the attention function
_registered = False


def _varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: q ``[1, Hq, T, D]``, k/v ``[1, Hkv, T, D]`` -> ``([1, T, Hq, D], None)``."""
    from dflash_prep.kernels.attention import attention_varlen

    cu, max_len = kwargs.get(_CU), kwargs.get(_MAX)
    if cu is None:
        raise ConfigError(f"the {ATTN_IMPL} attention needs packed inputs; call FrozenTarget.features / "
                          "packed_forward, which pass cu_seqlens")
    if query.shape[0] != 1:
        raise ValueError(f"{ATTN_IMPL}: documents go concatenated in one row, got batch {query.shape[0]}")
    window = kwargs.get("sliding_window")
    if window is not None and int(max_len) > int(window):
        raise ConfigError(f"a document of {max_len} tokens exceeds the target's sliding window ({window}); "
                          "the packed target runs full causal attention only: pack shorter documents")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
    o = attention_varlen(q, k, v, cu, int(max_len), causal=True, scale=scaling)  # (T, Hq, D)
    return o[None], None


def _no_mask(*args, **kwargs):
    return None


def register_attention() -> None:
    """Register :data:`ATTN_IMPL` (attention + no-op mask) with transformers, once per process."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPL, _varlen_attention)
    AttentionMaskInterface.register(ATTN_IMPL, _no_mask)
    _registered = True


def load_causal_lm(path: str | Path, *, device: torch.device, dtype: torch.dtype | None = None):
    """``AutoModelForCausalLM`` from a local folder with the packed attention (fp32 CPU, bf16 CUDA by default)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path}: not a transformers model folder (no config.json); pass a local folder "
                          "written by save_pretrained")
    register_attention()
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=ATTN_IMPL)
    except (OSError, ValueError) as e:
        raise FormatError(f"{path}: transformers could not load it as a causal LM ({e})") from None
    return model.to(device)


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder-layer list of a Llama-style causal LM (``model.model.layers``)."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ConfigError(f"{type(model).__name__}: no model.layers decoder list; the DFlash trainer supports "
                          "Llama-style decoders (Qwen3, Llama, Mistral)")
    return layers


def packed_forward(model, input_ids, position_ids, cu_seqlens, max_seqlen: int, **kw):
    """The base model over documents packed in one row: ids/positions ``[T]`` -> model outputs ([1, T, ...])."""
    return model.model(input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False,
                       **{_CU: cu_seqlens, _MAX: int(max_seqlen)}, **kw)


class _Stop(Exception):
    """Raised by the last tap's hook: everything the drafter needs has been computed."""


class FrozenTarget:
    """A frozen causal LM with tapped layers (module docstring)."""

    def __init__(self, path: str | Path, target_layer_ids, *, device: torch.device, dtype: torch.dtype | None = None):
        self._attach(load_causal_lm(Path(path), device=device, dtype=dtype), Path(path), target_layer_ids, device)

    @classmethod
    def from_model(cls, model, target_layer_ids, *, device: torch.device, path: str = "<in memory>") -> "FrozenTarget":
        """A target around a model already built (benchmarks with random weights); same checks."""
        self = cls.__new__(cls)
        self._attach(model, Path(path), target_layer_ids, device)
        return self

    def _attach(self, model, path: Path, target_layer_ids, device: torch.device) -> None:
        self.path = path
        self.model = model.eval()
        self.model.requires_grad_(False)
        self.layers = decoder_layers(self.model)
        L = len(self.layers)
        self.taps = [int(i) for i in target_layer_ids]
        bad = [i for i in self.taps if not 0 <= i < L]
        if bad:
            raise ConfigError(f"{self.path}: target layers {bad} do not exist (the target has {L} layers)")
        self.config = self.model.config
        self.device = device
        self.embed_tokens = self.model.get_input_embeddings()
        self.lm_head = self.model.get_output_embeddings()
        if self.lm_head is None or getattr(self.lm_head, "bias", None) is not None:
            raise ConfigError(f"{self.path}: the DFlash trainer needs a bias-free lm_head")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @torch.no_grad()
    def features(self, input_ids, position_ids, cu_seqlens, max_seqlen: int, *, final: bool = False):
        """Concatenated taps ``[T, k*H]`` (tap order = ``target_layer_ids``) for packed documents;
        with ``final``, ``(taps, last [T, H])``: the whole forward's final-normed hidden states."""
        got: dict[int, torch.Tensor] = {}
        last = max(self.taps)

        def hook(idx):
            def fn(_mod, _inp, out):
                got[idx] = (out[0] if isinstance(out, tuple) else out)[0]  # (T, H)
                if idx == last and not final:
                    raise _Stop
            return fn

        handles = [self.layers[i].register_forward_hook(hook(i)) for i in sorted(set(self.taps))]
        out = None
        try:
            out = packed_forward(self.model, input_ids, position_ids, cu_seqlens, max_seqlen)
        except _Stop:
            pass
        finally:
            for h in handles:
                h.remove()
        taps = torch.cat([got[i] for i in self.taps], dim=-1)  # (T, k*H)
        return (taps, out.last_hidden_state[0]) if final else taps


def target_provider(cfg, ds, layer_ids, *, final: bool, identity: dict, device: torch.device, place=None):
    """Where this drafter rank's target hidden states come from (a taps provider,
    :mod:`dflash_prep.train.split.taps`): a split job's target rank first, then a serving engine's (``--target-engine vllm``, its module in
    :mod:`dflash_prep.train.engines`: the states cache, :class:`~dflash_prep.train.cached_taps.CachedTaps`,
    or without ``--states`` the target in vLLM beside this rank,
    :class:`~dflash_prep.train.engine_taps.EngineTaps`), a split job's target rank (``place``:
    :class:`~dflash_prep.train.split.taps.RemoteTaps`, whatever runs the target there), else a :class:`FrozenTarget` in this process
    tapping ``layer_ids``. A dataset tokenized for another model is refused first, whichever it is
    (:func:`dflash_prep.tokenize.identity.check_tokenizer`; in-memory test data records no tokenizer)."""
    if getattr(ds, "meta", None) is not None:
        check_tokenizer(getattr(ds, "folder", cfg.data), ds.meta, cfg.options.target,
                        then=", then analyze and pack it for this run")
    if place is not None:                  # a split job's drafter: its target rank runs the target, in an engine or not
        from dflash_prep.train.split.taps import remote_taps

        contract = {} if cfg.target_engine == engines.BUILTIN else {"target_engine": cfg.target_engine,
                                                                     "states_dtype": cfg.states_dtype}
        return remote_taps(place, cfg.options.target, timeout=cfg.target_timeout, device=device, contract=contract)
    if cfg.target_engine != engines.BUILTIN:
        return engines.get(cfg.target_engine).taps(cfg, ds, layer_ids, final=final, identity=identity, device=device)
    return FrozenTarget(cfg.options.target, layer_ids, device=device)

