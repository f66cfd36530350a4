"""Trainer configuration: one frozen dataclass per component, checked on construction.

- :class:`ModelConfig`: the Llama-style decoder's shape. Presets: ``tiny`` (the CPU demo
  and tests; head_dim 64 so the Triton interpreter can run it) and ``100m`` (~100M
  parameters with a 32K vocabulary and tied embeddings, for one GPU or more).
- :class:`TrainConfig`: where the data, plan and manifests live, the optimiser and LR
  schedule, checkpointing, logging and the device.

A config file is TOML: top-level keys are :class:`TrainConfig` fields; ``model`` is a
preset name, or a ``[model]`` table with an optional ``preset`` key plus field overrides. Command-line flags override the file.
"""

from __future__ import annotations

import math

import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from dflash_prep.errors import ConfigError

ATTN_BACKENDS = ("auto", "reference", "triton")
DEVICES = ("auto", "cpu", "cuda")
OBJECTIVES = ("lm", "dflash")


def _positive_finite(name: str, v, *, zero_ok: bool = False) -> None:
    """Every float option is a finite number in range (NaN and inf never pass a comparison check)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (v == 0 and not zero_ok):
        raise ConfigError(f"{name} must be a finite number {'>= 0' if zero_ok else '> 0'}, got {v!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention)."""

    vocab_size: int = 0
    """Embedding rows. 0 means "take it from the dataset's tokenizer_info"."""
    n_layers: int = 2
    """Transformer blocks."""
    d_model: int = 128
    """Residual width; must equal n_heads * head_dim."""
    n_heads: int = 2
    """Query heads."""
    n_kv_heads: int = 1
    """Key/value heads (GQA); must divide n_heads."""
    head_dim: int = 64
    """Per-head width. The Triton kernels support 64 and 128; the reference path any size."""
    ffn_dim: int = 344
    """SwiGLU hidden width."""
    rope_theta: float = 10000.0
    """RoPE base."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = True
    """Share the input embedding with the output projection."""
    init_std: float = 0.02
    """Normal init std for every linear and embedding weight."""

    def __post_init__(self):
        for name in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "ffn_dim"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"model.{name} must be at least 1, got {getattr(self, name)}")
        if self.vocab_size < 0:
            raise ConfigError(f"model.vocab_size must be >= 0 (0 = from the dataset), got {self.vocab_size}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"model.n_kv_heads ({self.n_kv_heads}) must divide model.n_heads ({self.n_heads})")
        if self.n_heads * self.head_dim != self.d_model:
            raise ConfigError(f"model.d_model ({self.d_model}) must equal n_heads * head_dim "
                              f"({self.n_heads} * {self.head_dim})")
        if self.head_dim % 2:
            raise ConfigError(f"model.head_dim must be even for RoPE, got {self.head_dim}")
        for name in ("rope_theta", "norm_eps", "init_std"):
            _positive_finite(f"model.{name}", getattr(self, name))


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(n_layers=2, d_model=128, n_heads=2, n_kv_heads=1, head_dim=64, ffn_dim=344),
    "100m": ModelConfig(n_layers=12, d_model=768, n_heads=12, n_kv_heads=4, head_dim=64, ffn_dim=2048),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A named preset with field overrides (e.g. ``vocab_size``)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    try:
        return replace(PRESETS[name], **overrides)
    except TypeError as e:
        raise ConfigError(f"bad model override ({e}); valid fields: "
                          f"{', '.join(f.name for f in fields(ModelConfig))}") from None


@dataclass(frozen=True)
class TrainConfig:
    """One training run. Paths are the outputs of tokenize, analyze and pack."""

    data: str = "demo/data"
    """Tokenized dataset folder (``dflash-prep tokenize``)."""
    plan: str = "demo/plan/plan.json"
    """plan.json (``dflash-prep analyze``); its fingerprint guards resume."""
    manifests: str = "demo/manifests"
    """Manifest root holding ``epoch-NNNN`` folders (``dflash-prep pack``)."""
    out: str = "runs/demo"
    """Run folder: checkpoints, ``log.jsonl`` and ``summary.json``."""
    model: str = "tiny"
    """Model preset name (see :data:`PRESETS`)."""
    model_overrides: dict = field(default_factory=dict)
    """Per-field overrides of the preset (the config file's ``[model]`` table)."""
    epochs: int = 1
    """Epochs to train; epoch e reads ``manifests/epoch-e``."""
    max_steps: int = 0
    """Stop after this many optimizer steps in total (0 = run every epoch to the end). It only
    stops: the cosine horizon stays ``epochs`` x the first epoch's steps, so a run cut short and
    resumed follows the same LR schedule as a straight one."""
    pack_missing: bool = True
    rescale: bool = False
    """Resume a checkpoint taken at another world size: the rest of its epoch comes from the
    continuation manifest ``MANIFESTS/resume/epoch-000N`` (packed on the fly by rank 0 when
    missing), later epochs from manifests packed for this world size (:mod:`dflash_prep.train.rescale`)."""
    """Pack a missing epoch's manifest on the fly (same code as ``dflash-prep pack``);
    when False a missing manifest is an error naming the command to run."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.1
    """Cosine decays to ``lr * min_lr_ratio``."""
    warmup_steps: int = 5
    """Linear warmup steps."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay on 2-D weights (not norms)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""
    seed: int = 0
    """Model init and RNG seed (the data order comes from the plan's seed)."""
    attn: str = "auto"
    """Attention backend: auto (Triton on CUDA, reference on CPU), reference, triton."""
    device: str = "auto"
    """auto (CUDA when available), cpu or cuda."""
    bf16: bool = True
    """bf16 autocast on CUDA (ignored on CPU, which trains in fp32 for bitwise resume)."""
    prefetch: int = 4
    """Optimizer steps the FIFO prefetch thread builds ahead."""
    ckpt_every: int = 0
    """Save a checkpoint every N steps (0 = only at the end)."""
    from_scratch: bool = False
    """False (``--resume``, the default): resume from ``out/checkpoint.pt`` when it exists.
    True (``--from-scratch``): ignore and replace it, a new run on the current plan."""
    log_every: int = 1
    """Write a JSONL record every N steps."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    wandb: str = ""
    """Weights & Biases project name; empty = off. Needs ``pip install wandb``."""
    objective: str = "lm"
    """``lm``: next-token loss on the model being trained; ``dflash``: a DFlash drafter on the
    frozen ``target`` (see :mod:`dflash_prep.train.objective_dflash`)."""
    init_from: str = ""
    """LM objective: start from this local transformers causal-LM folder instead of ``model``;
    the result is saved with ``save_pretrained`` (and its tokenizer) to ``out/hf``."""
    ce_chunk: int = 2048
    """Rows per chunk of LM head + cross-entropy (both objectives; memory ~ chunk x vocab)."""
    target: str = ""
    """DFlash: the frozen target, a local transformers causal-LM folder with its tokenizer."""
    draft_layers: int = 1
    """DFlash: draft layers N (the taps are build_target_layer_ids(L, N) unless target_layer_ids)."""
    target_layer_ids: tuple[int, ...] = ()
    """DFlash: tapped target layers; empty = the public rule."""
    block_size: int = 0
    """DFlash: block size B (an anchor token plus B - 1 drafted slots); 0 = the manifest's
    (``pack --objective dflash``), else 16."""
    gamma: float = 0.0
    """DFlash: slot-weight decay exp(-(r-1)/gamma); 0 = the rule (B - 2) / 2 (7 at B = 16)."""
    sliding_window: int = 0
    """DFlash: sliding-window attention W of every draft layer (0 = full, else at least B): slot r
    of block j sees context positions >= a_j + r - W + 1 only (the public ``sliding_attention`` rule)."""
    max_anchors: int = 0
    """DFlash: anchors per sample at most; 0 = the manifest's, else 512."""
    anchor_policy: str = ""
    """DFlash: ``cap`` (min(max_anchors, candidates)) or ``density`` (also <= ceil(supervised / B));
    empty = the manifest's, else cap."""
    anchor_seed: int = -1
    """DFlash: anchor RNG seed; -1 = the manifest's, else ``seed``. A value that contradicts a
    ``pack --objective dflash`` manifest is refused (its budgets assume its anchors)."""
    mask_token_id: int = -1
    """DFlash: mask token id; -1 = the tokenizer's mask token, ``<|mask|>``, or the first row past the tokenizer."""

    def __post_init__(self):
        _positive_finite("--lr", self.lr)
        for name in ("min_lr_ratio", "weight_decay", "grad_clip"):
            _positive_finite(f"--{name.replace('_', '-')}", getattr(self, name), zero_ok=True)
        if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"betas must be two numbers in [0, 1), got {self.betas}")
        if self.epochs < 1:
            raise ConfigError(f"--epochs must be at least 1, got {self.epochs}")
        for name in ("max_steps", "warmup_steps", "ckpt_every", "prefetch"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.prefetch < 1:
            raise ConfigError(f"--prefetch must be at least 1 step, got {self.prefetch}")
        if self.log_every < 1:
            raise ConfigError(f"--log-every must be at least 1, got {self.log_every}")
        if not self.lr > 0:
            raise ConfigError(f"--lr must be positive, got {self.lr}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ConfigError("--grad-clip and --weight-decay must be >= 0")
        if self.attn not in ATTN_BACKENDS:
            raise ConfigError(f"--attn must be one of {', '.join(ATTN_BACKENDS)}, got {self.attn!r}")
        if self.device not in DEVICES:
            raise ConfigError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        preset(self.model, **self.model_overrides)  # validates the preset name and overrides
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.ce_chunk < 1:
            raise ConfigError(f"--ce-chunk must be at least 1, got {self.ce_chunk}")
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if self.objective == "dflash":
            if not self.target:
                raise ConfigError("--objective dflash needs --target DIR (a local transformers causal-LM folder)")
            if self.init_from:
                raise ConfigError("--init-from is for --objective lm; a DFlash run reads its frozen model from --target")
            if self.draft_layers < 1:
                raise ConfigError(f"--draft-layers must be at least 1, got {self.draft_layers}")
            from dflash_prep.anchors import check_options
            check_options(self.max_anchors or 1, self.anchor_policy or "cap", self.block_size or 2)
            if self.gamma < 0:
                raise ConfigError(f"--gamma must be > 0 (0 = the default rule), got {self.gamma}")
            if self.sliding_window < 0:
                raise ConfigError(f"--sliding-window must be >= 0 (0 = full attention), got {self.sliding_window}")
        elif self.target:
            raise ConfigError("--target is the DFlash objective's frozen model; pass --objective dflash, or "
                              "--init-from DIR to train a transformers model as an LM")

    def model_config(self, vocab_size: int) -> ModelConfig:
        """The preset with overrides; the dataset's vocab unless the overrides fix one."""
        over = dict(self.model_overrides)
        if not over.get("vocab_size"):
            over["vocab_size"] = int(vocab_size)
        return preset(self.model, **over)


def load_file(path: str | Path) -> dict:
    """Read a TOML config file into TrainConfig keyword arguments."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    known = {f.name for f in fields(TrainConfig)}
    model = raw.pop("model", None)
    if isinstance(model, dict):  # [model] table: optional preset = "..." plus field overrides
        model = dict(model)
        if "preset" in model:
            raw["model"] = model.pop("preset")
        raw["model_overrides"] = model
    elif model is not None:      # model = "100m"
        raw["model"] = model
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown keys {unknown}; valid keys: {', '.join(sorted(known))}")
    for key in ("betas", "target_layer_ids"):
        if key in raw:
            raw[key] = tuple(raw[key])
    return raw


def build(file: str | Path | None = None, **cli) -> TrainConfig:
    """File values first, then every command-line value that is not None."""
    kwargs = load_file(file) if file else {}
    kwargs.update({k: v for k, v in cli.items() if v is not None})
    try:
        return TrainConfig(**kwargs)
    except TypeError as e:
        raise ConfigError(f"bad training option ({e})") from None
