"""Trainer configuration: one frozen dataclass per component, checked on construction.

- :class:`ModelConfig`: the Llama-style decoder's shape. Presets: ``tiny`` (the CPU demo
  and tests; head_dim 64 so the Triton interpreter can run it) and ``100m`` (~100M
  parameters with a 32K vocabulary and tied embeddings, for one GPU or more).
- :class:`TrainConfig`: where the data, plan and manifests live, the optimiser and LR
  schedule, checkpointing, logging and the device.

A config file is TOML: top-level keys are :class:`TrainConfig` fields or the chosen objective's
options (:mod:`dflash_prep.train.objectives.registry`: each objective declares its own);
``model`` is a preset name, or a ``[model]`` table with an optional ``preset`` key plus field
overrides. Command-line flags override the file.
"""

from __future__ import annotations

import ast
import inspect
import math
import textwrap
import tomllib
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path

from dflash_prep.errors import ConfigError
from dflash_prep.train import engines

ATTN_BACKENDS = ("auto", "reference", "triton")
DEVICES = ("auto", "cpu", "cuda")
OPTIMIZERS = ("adamw", "muon")
STATES_DTYPES = ("bf16", "fp8", "fp32")     # dflash_prep.formats.states.DTYPES, without importing numpy here
EVAL_OURS = ("auto", "on", "off")


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


#: the --help panels of the trainer's options, in order
DATA, MODEL, OPTIMIZER, RUN, OBJECTIVE = "Data", "Model", "Optimizer", "Run", "Objective"


def opt(default=MISSING, *, panel: str, flag: str | None = None, cli: bool = True, default_factory=MISSING,
        metavar: str | None = None):
    """A :class:`TrainConfig` field: its default, its ``--help`` panel, its flag's spelling when
    not ``--field-name``, its value's name in ``--help`` and whether it has a flag at all (else
    config file only). The field's
    docstring is its help (:func:`field_help`). An objective's own options are declared by the
    objective (:mod:`dflash_prep.train.objectives.registry`), not here."""
    return field(default=default, default_factory=default_factory,
                 metadata={"panel": panel, "flag": flag, "cli": cli, "metavar": metavar})


def field_help(cls) -> dict[str, str]:
    """``{field: its help}``: the string under each field in the class's source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body, out = tree.body[0].body, {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            out[node.target.id] = " ".join(str(nxt.value.value).split())
    return out


@dataclass(frozen=True)
class TrainConfig:
    """One training run. Paths are the outputs of tokenize, analyze and pack."""

    data: str = opt("demo/data", panel=DATA)
    """Tokenized dataset folder (``dflash-prep tokenize``)."""
    plan: str = opt("demo/plan/plan.json", panel=DATA)
    """plan.json (``dflash-prep analyze``); its fingerprint guards resume."""
    manifests: str = opt("demo/manifests", panel=DATA)
    """Manifest root holding ``epoch-NNNN`` folders (``dflash-prep pack``)."""
    out: str = opt("runs/demo", panel=DATA)
    """Run folder: checkpoints, ``log.jsonl`` and ``summary.json``."""
    model: str = opt("tiny", panel=MODEL)
    """Model preset name (see :data:`PRESETS`)."""
    model_overrides: dict = opt(panel=MODEL, cli=False, default_factory=dict)
    """Per-field overrides of the preset (the config file's ``[model]`` table)."""
    epochs: int = opt(1, panel=DATA)
    """Epochs to train; epoch e reads ``manifests/epoch-e``."""
    max_steps: int = opt(0, panel=DATA)
    """Stop after this many optimizer steps in total (0 = run every epoch to the end). It only
    stops: the cosine horizon stays ``epochs`` x the first epoch's steps, so a run cut short and
    resumed follows the same LR schedule as a straight one."""
    pack_missing: bool = opt(True, panel=DATA)
    """Pack a missing epoch's manifest on the fly (same code as ``dflash-prep pack``);
    when False a missing manifest is an error naming the command to run."""
    rescale: bool = opt(False, panel=DATA)
    """Resume a checkpoint taken at another world size: the rest of its epoch comes from the
    continuation manifest ``MANIFESTS/resume/epoch-000N`` (packed on the fly by rank 0 when
    missing), later epochs from manifests packed for this world size (:mod:`dflash_prep.train.rescale`)."""
    lr: float = opt(3e-3, panel=OPTIMIZER)
    """Peak learning rate (AdamW)."""
    optimizer: str = opt("", panel=OPTIMIZER)
    """``adamw``, or ``muon``: Muon on the 2-D weight matrices, AdamW at ``lr`` on the rest
    (:mod:`dflash_prep.train.optim`); empty = the objective's (``muon`` for dflash, ``adamw`` for lm)."""
    muon_lr: float = opt(0.0, panel=OPTIMIZER)
    """Muon's peak learning rate; 0 = 10 x ``lr`` (speculators' rule). The schedule scales both."""
    min_lr_ratio: float = opt(0.1, panel=OPTIMIZER)
    """Cosine decays to ``lr * min_lr_ratio``."""
    warmup_steps: int = opt(5, panel=OPTIMIZER)
    """Linear warmup steps."""
    weight_decay: float = opt(0.1, panel=OPTIMIZER)
    """AdamW decoupled weight decay on 2-D weights (not norms)."""
    betas: tuple[float, float] = opt((0.9, 0.95), panel=OPTIMIZER)
    """AdamW betas."""
    grad_clip: float = opt(1.0, panel=OPTIMIZER)
    """Clip the global gradient norm to this (0 = off)."""
    seed: int = opt(0, panel=OPTIMIZER)
    """Model init and RNG seed (the data order comes from the plan's seed)."""
    attn: str = opt("auto", panel=RUN)
    """Attention backend: auto (Triton on CUDA, reference on CPU), reference, triton."""
    device: str = opt("auto", panel=RUN)
    """auto (CUDA when available), cpu or cuda."""
    bf16: bool = opt(True, panel=RUN)
    """bf16 autocast on CUDA; on a CPU with native bf16 matmuls (AVX512-BF16, AMX) the LM head's
    matmuls alone in bf16 (a SmolLM2-sized drafter step 1.3-2x faster, docs/benchmarks.md), the
    rest fp32; elsewhere fp32. Resume stays bitwise either way."""
    prefetch: int = opt(4, panel=RUN)
    """Optimizer steps the FIFO prefetch thread builds ahead."""
    ckpt_every: int = opt(0, panel=RUN)
    """Save a checkpoint every N steps (0 = only at the end)."""
    from_scratch: bool = opt(False, panel=RUN, flag="--from-scratch/--resume")
    """False (``--resume``, the default): resume from ``out/checkpoint.pt`` when it exists.
    True (``--from-scratch``): ignore and replace it, a new run on the current plan."""
    log_every: int = opt(1, panel=RUN)
    """Write a JSONL record every N steps."""
    eval_every: int = opt(0, panel=RUN)
    """Every N steps, evaluate the drafter in the serving engine (``dflash-prep evaluate``: vLLM,
    ``make venv-vllm``) in a background process that never stalls the step loop: that step's
    checkpoint is exported and served on ``--eval-prompts``, and a log record ``{"eval": ...}``
    puts the engine's tau beside the trainer's own (docs/train.md, the engine during training). One
    evaluation at a time (a due one is skipped, and logged so, while another runs). 0 = off."""
    eval_prompts: str = opt("", panel=RUN)
    """Held-out prompts for ``--eval-every`` (chat JSONL, as ``dflash-prep evaluate --prompts``)."""
    eval_bench: str = opt("", panel=RUN)
    """Shipped benchmark sets for ``--eval-every``, comma-separated (``gsm8k,mt-bench``, or ``all``;
    as ``dflash-prep evaluate --bench``): tau per set is logged beside the trainer's."""
    eval_n: int = opt(8, panel=RUN)
    """Prompts sampled from each ``--eval-bench`` set (small: an evaluation runs while training goes on)."""
    eval_ours: str = opt("auto", panel=RUN)
    """``--eval-every``'s own evaluator beside vLLM (``tau_ours``): auto (as ``dflash-prep evaluate``: on up to
    1 B target parameters), on, or off (vLLM's tau alone: on a CPU it decodes every prompt in this
    process's torch, far slower than the engine, so fewer evaluations fit between steps)."""
    progress: bool = opt(True, panel=RUN)
    """Show a progress bar on rank 0."""
    wandb: str = opt("", panel=RUN)
    """Weights & Biases project name; empty = off. Needs ``pip install wandb``."""
    objective: str = opt("lm", panel=OBJECTIVE)
    """What to train: ``lm`` (next-token loss on the model being trained), ``dflash`` (a DFlash
    drafter on a frozen ``--target``); each objective's own options are in its panel below."""
    options: object = opt(None, panel=OBJECTIVE, cli=False)
    """The objective's options (its frozen dataclass, :mod:`dflash_prep.train.objectives.registry`;
    None = its defaults). Built from the objective's flags and config keys by :func:`build`."""
    ce_chunk: int = opt(2048, panel=RUN)
    """Rows per chunk of LM head + cross-entropy (every objective; memory ~ chunk x vocab)."""

    target_ranks: int = opt(0, panel=RUN)
    """Run the frozen target on its own ranks (:mod:`dflash_prep.train.split`): the job's first K
    ranks only compute taps, the other W (the manifests' world size) train the drafter; 0 = every
    drafter rank holds its own target copy. A performance setting: checkpoints resume under any K."""
    target_prefetch: int = opt(2, panel=RUN)
    """Target ranks: taps messages in flight per drafter rank (how far a target rank runs ahead)."""
    target_timeout: float = opt(600.0, panel=RUN)
    """Target ranks: seconds either side waits for the other before stopping with a one-line
    error naming the peer rank and the step. It must cover the slowest gap between two messages:
    a real target's step (seconds) and a drafter checkpoint save (up to minutes), not the target's
    load (done before the first message)."""
    target_engine: str = opt("hf", panel=RUN)
    """Where a drafter's target hidden states come from: ``hf`` (the transformers target runs every
    step, beside the drafter or on ``--target-ranks``) or ``vllm``: read from ``--states``, the
    cache ``dflash-prep extract`` built once with vLLM (the target's layers are never loaded), or,
    without ``--states``, computed online by the target in vLLM beside each rank (no disk; the
    target runs every epoch)."""
    states: str = opt("", panel=RUN)
    """The states cache ``--target-engine vllm`` reads (``dflash-prep extract ... --out CACHE``)."""
    check_states: bool = opt(True, panel=DATA, flag="--check-states/--no-check-states")
    """``--states``: re-hash each shard of the cache the first time the run reads it, on the prefetch
    thread (a shard changed since ``extract`` stops the run); ``--no-check-states`` skips it, and
    the run's log header and ``summary.json`` say so."""
    states_dtype: str = opt("bf16", panel=RUN)
    """``--target-engine vllm`` without ``--states``: the engine's states rounded as a cache of this
    dtype stores them (bf16, fp8, fp32), the same values."""
    engine_args: tuple[str, ...] = opt((), panel=RUN, flag="--engine-arg", metavar="K=V")
    """``--target-engine vllm`` without ``--states``: a ``vllm.LLM`` argument for the target's engine
    (a JSON value), repeated: e.g. dtype=bfloat16, or a parallel engine with tensor_parallel_size."""
    engine_tokens: int = opt(32768, panel=RUN)
    """``--target-engine vllm`` without ``--states``: most tokens per engine call; 1 = one document a
    call, a run then equal bit for bit to one on a cache built with ``extract --batch-tokens 1``."""
    engine_scratch: str = opt("", panel=RUN)
    """``--target-engine vllm`` without ``--states``: the folder each micro-batch's states pass through
    on their way from the engine; empty = /dev/shm when the largest micro-batch fits its free
    space, else TMPDIR, else ``--out`` (a line says so). A chosen folder too small stops the run."""

    def __post_init__(self):
        _positive_finite("--lr", self.lr)
        for name in ("min_lr_ratio", "weight_decay", "grad_clip"):
            _positive_finite(f"--{name.replace('_', '-')}", getattr(self, name), zero_ok=True)
        if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"betas must be two numbers in [0, 1), got {self.betas}")
        if self.epochs < 1:
            raise ConfigError(f"--epochs must be at least 1, got {self.epochs}")
        for name in ("max_steps", "warmup_steps", "ckpt_every", "prefetch", "eval_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.target_ranks < 0 or self.target_prefetch < 1:
            raise ConfigError(f"--target-ranks must be >= 0 and --target-prefetch >= 1, got {self.target_ranks} "
                              f"and {self.target_prefetch}")
        _positive_finite("--target-timeout", self.target_timeout)
        in_engine = self.target_engine != engines.BUILTIN      # hf: the transformers target, no engine
        if in_engine:
            engines.get(self.target_engine)                    # one of train/engines, else: "must be one of hf, ..."
        if self.states and not in_engine:
            raise ConfigError(f"--states CACHE is read by {engines.flags()}; add it, or drop --states")
        if not self.check_states and not self.states:
            raise ConfigError("--no-check-states skips re-hashing a --states cache; there is none here: drop it")
        online = in_engine and not self.states
        if not online and (self.states_dtype != "bf16" or self.engine_args or self.engine_tokens != 32768
                           or self.engine_scratch):
            raise ConfigError("--states-dtype, --engine-arg, --engine-tokens and --engine-scratch set up the target "
                              f"in {engines.labels()} ({engines.flags()} without --states); " + (
                                  "a cache has its own, given to `dflash-prep extract`" if self.states else
                                  f"add {engines.flags()}, or drop them"))
        if self.states_dtype not in STATES_DTYPES:
            raise ConfigError(f"--states-dtype must be one of {', '.join(STATES_DTYPES)}, got {self.states_dtype!r}")
        if self.engine_tokens < 1:
            raise ConfigError(f"--engine-tokens must be at least 1, got {self.engine_tokens}")
        if self.states and self.target_ranks:
            raise ConfigError(f"--states {self.states}: every drafter rank reads the cache itself, so --target-ranks "
                              f"have no target to run; drop --target-ranks (or --states, to run the target in "
                              f"{engines.get(self.target_engine).label} on the target ranks)")
        if self.prefetch < 1:
            raise ConfigError(f"--prefetch must be at least 1 step, got {self.prefetch}")
        if self.log_every < 1:
            raise ConfigError(f"--log-every must be at least 1, got {self.log_every}")
        if self.eval_every and not (self.eval_prompts or self.eval_bench):
            raise ConfigError("--eval-every needs --eval-prompts FILE (held-out chat JSONL, as `dflash-prep evaluate "
                              "--prompts` takes) and/or --eval-bench SETS (e.g. gsm8k,mt-bench)")
        if self.eval_n < 0:
            raise ConfigError(f"--eval-n must be >= 0 (0: whole sets), got {self.eval_n}")
        if self.eval_ours not in EVAL_OURS:
            raise ConfigError(f"--eval-ours must be one of {', '.join(EVAL_OURS)}, got {self.eval_ours!r}")
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
        if self.ce_chunk < 1:
            raise ConfigError(f"--ce-chunk must be at least 1, got {self.ce_chunk}")
        spec = registry().get(self.objective)
        if self.options is None:
            object.__setattr__(self, "options", registry().build_options(self.objective, {}))
        if not isinstance(self.options, spec.options):
            raise ConfigError(f"--objective {self.objective} needs its options ({spec.options.__name__}), "
                              f"got {type(self.options).__name__}")
        if in_engine and spec.serve is None:
            raise ConfigError(f"--target-engine {self.target_engine}: --objective {self.objective} trains on no frozen "
                              "target; drop --target-engine" + (" and --states" if self.states else ""))
        if not self.optimizer:                      # the objective's recipe
            object.__setattr__(self, "optimizer", spec.options.optimizer)
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        _positive_finite("--muon-lr", self.muon_lr, zero_ok=True)

    def flat(self) -> dict:
        """Every option by name, the objective's beside the generic ones (what the run's log and
        checkpoint record, and what a config file holds)."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "options"}
        return d | {f.name: getattr(self.options, f.name) for f in fields(self.options)}

    def model_config(self, vocab_size: int) -> ModelConfig:
        """The preset with overrides; the dataset's vocab unless the overrides fix one."""
        over = dict(self.model_overrides)
        if not over.get("vocab_size"):
            over["vocab_size"] = int(vocab_size)
        return preset(self.model, **over)


def registry():
    """The trainer-side objective registry (imported on first use: it registers the objectives,
    whose modules import this one)."""
    from dflash_prep.train.objectives import registry as reg

    return reg


def _option_keys() -> set[str]:
    return {f.name for s in registry().specs() for f in fields(s.options)}


def load_file(path: str | Path) -> dict:
    """Read a TOML config file into keyword arguments of :func:`build`: TrainConfig fields and the
    options of the objectives (top-level keys, named as their fields)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    known = {f.name for f in fields(TrainConfig) if f.name != "options"} | _option_keys()
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
    for key in ("betas", "target_layer_ids", "engine_args"):
        if key in raw:
            raw[key] = tuple(raw[key])
    return raw


def build(file: str | Path | None = None, **cli) -> TrainConfig:
    """File values first, then every command-line value that is not None. Keys that are not
    TrainConfig fields are the chosen objective's options (an option of another objective is
    refused, naming whose it is)."""
    kwargs = load_file(file) if file else {}
    kwargs.update({k: v for k, v in cli.items() if v is not None})
    generic = {f.name for f in fields(TrainConfig)}
    own = {k: kwargs.pop(k) for k in list(kwargs) if k not in generic}
    if "options" not in kwargs:
        kwargs["options"] = registry().build_options(kwargs.get("objective", "lm"), own)
    elif own:
        raise ConfigError(f"pass the objective's options either as options= or by name, not both ({sorted(own)})")
    try:
        return TrainConfig(**kwargs)
    except TypeError as e:
        raise ConfigError(f"bad training option ({e})") from None
