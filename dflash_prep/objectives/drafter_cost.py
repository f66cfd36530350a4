"""What one DFlash drafter training step costs, per sample and per micro-batch (FLOPs).

docs/definitions.md "Drafter step cost", made exact. One count, :func:`flops`, prices a sample
or a micro-batch from five quantities; ``pack`` calls it with expectations (it reads no masks),
the trainer's MFU (:meth:`dflash_prep.train.objective_dflash.DFlashObjective.flops`) with what
the micro-batch holds. For ``T`` tokens in documents of lengths ``L_i``, ``k`` anchors (blocks
of ``B`` tokens) at positions ``a_j`` and ``n`` block rows with a loss weight:

- target forward (frozen, no backward): ``2 * P_t * T`` plus causal attention within each
  document, ``2 * h * d * L_i^2`` per target layer (``4 h d L^2 / 2``);
- drafter context (trained, x3 for backward): the fc over the ``N`` tapped hidden states
  (``N * H * H`` per token) and each draft layer's k/v projection of that feature
  (``2 * H * h_kv * d``), ``6 * (N H^2 + N * 2 H h_kv d) * T``;
- drafter blocks: ``6 * N * layer * k * B`` through the ``N`` draft layers (the fc runs on the
  context only), plus attention of each block's ``B`` queries over its prefix and its own
  block, ``12 * h * d * B * (a_j + B)`` per draft layer (``4 h d B (a_j + B)`` forward, x3 with
  backward); with a sliding window W the prefix is cut to ``min(a_j, W)`` keys (the kernels
  skip the rest);
- LM head (frozen: forward and the input gradient, no weight gradient), on the rows with a
  loss weight only (the chunked CE skips the rest): ``4 * n * H * V``.

``P_t`` counts the decoder-layer weights the target forward runs (attention + SwiGLU MLP),
embeddings and LM head aside; a draft layer has the target's layer shape. Pack does not read
masks, so it takes ``sum_j min(a_j, W)`` and ``n`` at their expectations when the supervised
tokens end the sample (a prompt, then the response): candidates are positions
``L - S .. L - 2``, uniform (:func:`mean_seen`, :func:`mean_labelled`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numba as nb
import numpy as np

from dflash_prep.errors import ConfigError

#: The fields of a transformers config.json this model reads, and their names there.
CONFIG_KEYS = {"hidden": "hidden_size", "layers": "num_hidden_layers", "intermediate": "intermediate_size",
               "heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "head_dim": "head_dim",
               "vocab": "vocab_size"}


@dataclass(frozen=True)
class DrafterCostModel:
    """Model sizes of the drafter step cost (module docstring).

    Attributes:
        hidden: the target's d_model ``H`` (the drafter shares it).
        layers: target decoder layers.
        intermediate: SwiGLU width.
        heads: query heads ``h``.
        kv_heads: key/value heads ``h_kv``.
        head_dim: ``d``.
        vocab: ``V``, the LM head's rows.
        draft_layers: ``N``, the drafter's decoder layers (it taps ``N`` target layers).
        sliding_window: ``W`` of the draft layers' attention (``--sliding-window``), 0 = full:
            a block attends to ``min(a_j, W)`` context keys.
    """

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    draft_layers: int = 1
    sliding_window: int = 0

    def __post_init__(self):
        if int(self.sliding_window) < 0:
            raise ConfigError(f"--sliding-window must be >= 0 (0 = full attention), got {self.sliding_window}")
        for f in fields(self):
            if f.name != "sliding_window" and int(getattr(self, f.name)) < 1:
                raise ConfigError(f"cost model: {f.name} must be >= 1, got {getattr(self, f.name)}")

    @classmethod
    def from_config(cls, folder: str | Path, draft_layers: int = 1, sliding_window: int = 0) -> "DrafterCostModel":
        """Sizes from a transformers ``config.json`` (a folder or the file itself)."""
        path = Path(folder)
        path = path / "config.json" if path.is_dir() else path
        try:
            cfg = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: cannot read a transformers config.json ({e}); pass --target-config DIR "
                              "holding the target's config.json, or --target-dims") from None
        cfg = cfg.get("text_config", cfg)           # multimodal configs nest the language model
        vals = {}
        for ours, theirs in CONFIG_KEYS.items():
            v = cfg.get(theirs)
            if v is None and ours == "head_dim" and cfg.get("hidden_size") and cfg.get("num_attention_heads"):
                v = cfg["hidden_size"] // cfg["num_attention_heads"]
            if v is None and ours == "kv_heads":
                v = cfg.get("num_attention_heads")
            if v is None:
                raise ConfigError(f"{path}: no {theirs!r}; the drafter cost model needs {', '.join(CONFIG_KEYS.values())}")
            vals[ours] = int(v)
        return cls(**vals, draft_layers=int(draft_layers), sliding_window=int(sliding_window))

    @classmethod
    def from_dims(cls, spec: str, draft_layers: int = 1, sliding_window: int = 0) -> "DrafterCostModel":
        """Sizes from ``"hidden=4096,layers=36,intermediate=12288,heads=32,kv_heads=8,head_dim=128,vocab=151936"``."""
        vals = {}
        for part in spec.split(","):
            k, sep, v = part.strip().partition("=")
            if not sep or k not in CONFIG_KEYS:
                raise ConfigError(f"--target-dims {spec!r}: write name=value pairs with names {', '.join(CONFIG_KEYS)}")
            try:
                vals[k] = int(v)
            except ValueError:
                raise ConfigError(f"--target-dims: {k}={v!r} is not an integer") from None
        missing = [k for k in CONFIG_KEYS if k not in vals]
        if missing:
            raise ConfigError(f"--target-dims {spec!r} lacks {', '.join(missing)}")
        return cls(**vals, draft_layers=int(draft_layers), sliding_window=int(sliding_window))

    # -- parameter counts
    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer: q, k, v, o projections and the SwiGLU MLP."""
        H, hd = self.hidden, self.head_dim
        return H * self.heads * hd * 2 + H * self.kv_heads * hd * 2 + 3 * H * self.intermediate

    @property
    def target_params(self) -> int:
        return self.layers * self.layer_params

    @property
    def draft_params(self) -> int:
        return self.draft_layers * self.layer_params + self.draft_layers * self.hidden * self.hidden

    def coefficients(self, block_size: int) -> dict:
        """FLOPs per unit of each quantity :func:`flops` reads (float64): ``tokens`` (T),
        ``tokens_sq`` (sum of squared document lengths), ``anchors`` (k), ``anchor_pos``
        (context keys the blocks see, sum of ``min(a_j, W)``) and ``head_rows`` (n)."""
        B, H, hd, N = float(block_size), float(self.hidden), float(self.head_dim), float(self.draft_layers)
        ctx = 6.0 * (N * H * H + N * 2.0 * H * self.kv_heads * hd)
        attn_d = 12.0 * self.heads * hd * B * N
        return {"tokens": 2.0 * self.target_params + ctx,
                "tokens_sq": 2.0 * self.heads * hd * self.layers,
                "anchors": 6.0 * N * self.layer_params * B + attn_d * B,
                "anchor_pos": attn_d,
                "head_rows": 4.0 * H * self.vocab}

    def coefficient_array(self, block_size: int) -> np.ndarray:
        """:meth:`coefficients` as float64 ``[tokens, tokens_sq, anchors, anchor_pos, head_rows,
        window, block_size]`` (numba's; ``window`` is the sliding window W, 0 = full)."""
        c = self.coefficients(block_size)
        return np.array([c["tokens"], c["tokens_sq"], c["anchors"], c["anchor_pos"], c["head_rows"],
                         self.sliding_window, block_size], np.float64)

    def describe(self, block_size: int) -> dict:
        """What manifest.json records: the sizes, parameter counts and coefficients."""
        return {**asdict(self), "target_params": self.target_params, "draft_params": self.draft_params,
                "coefficients": self.coefficients(block_size)}


@nb.njit(cache=True, inline="always")
def mean_seen(L, S, W):
    """Expected context keys a block attends to, ``E[min(a, W)]`` (``E[a]`` when W is 0), for an
    anchor ``a`` uniform on the candidates ``[L - S, L - 2]`` of a sample of ``L`` tokens whose
    last ``S`` are supervised (continuous approximation; floats in, float out)."""
    mean = max(L - S / 2.0 - 1.0, 0.0)
    if W <= 0.0:
        return mean
    lo, hi = max(L - S, 0.0), max(L - 2.0, 0.0)
    if W >= hi:
        return mean
    if W <= lo:
        return W
    return ((W * W - lo * lo) / 2.0 + W * (hi - W)) / (hi - lo)


@nb.njit(cache=True, inline="always")
def mean_labelled(S, B):
    """Expected block rows with a loss weight, ``E[min(B - 1, L - 1 - a)]``, for an anchor ``a``
    uniform on the candidates ``[L - S, L - 2]`` of a sample whose last ``S`` tokens are
    supervised: slot r of the block is labelled while ``a + r`` stays in the sample (exact over
    the ``S - 1`` integer candidates; floats in, float out)."""
    m, c = S - 1.0, B - 1.0
    if m < 1.0:
        return 0.0
    if m <= c:
        return (m + 1.0) / 2.0
    return (c * (c + 1.0) / 2.0 + (m - c) * c) / m


@nb.njit(cache=True, inline="always")
def flops(coef, tokens, tokens_sq, anchors, seen, head_rows):
    """The drafter step FLOPs (module docstring) from :meth:`DrafterCostModel.coefficient_array`:
    ``tokens`` T, ``tokens_sq`` sum of squared document lengths, ``anchors`` k, ``seen`` the
    context keys the blocks attend to (sum of ``min(a_j, W)``), ``head_rows`` the rows with a
    loss weight. The one count pack and the trainer share (numba; callable from Python)."""
    return coef[0] * tokens + coef[1] * tokens_sq + coef[2] * anchors + coef[3] * seen + coef[4] * head_rows


@nb.njit(cache=True, inline="always")
def step_flops(coef, L, S, k):
    """One sample's :func:`flops` as pack prices it: ``L`` tokens, ``S`` supervised, ``k`` anchors,
    the anchor positions and labelled rows at their expectations (numba)."""
    L = np.float64(L)
    k = np.float64(k)
    S = np.float64(S)
    return flops(coef, L, L * L, k, k * mean_seen(L, S, coef[5]), k * mean_labelled(S, coef[6]))


@nb.njit(cache=True, parallel=True)
def _sample_costs(coef, lens, sup, counts, out):
    for i in nb.prange(lens.shape[0]):
        out[i] = step_flops(coef, lens[i], sup[i], counts[i])


def sample_cost(model: DrafterCostModel, block_size: int, lengths, supervised, counts) -> np.ndarray:
    """Drafter step FLOPs per sample (float64), the terms of the module docstring summed."""
    arrs = [np.ascontiguousarray(a) for a in (lengths, supervised, counts)]
    arrs = [a if a.dtype.kind in "iuf" else a.astype(np.float64) for a in arrs]
    if not arrs[0].shape == arrs[1].shape == arrs[2].shape:
        raise ConfigError("lengths, supervised and counts need one entry per sample each")
    out = np.empty(arrs[0].shape[0], np.float64)
    _sample_costs(model.coefficient_array(block_size), *arrs, out)
    return out


def cost_shares(model: DrafterCostModel, block_size: int, lengths, supervised, counts) -> dict:
    """Share of the total in target (per token + attention) and anchor (drafter blocks, LM head) work."""
    c = model.coefficients(block_size)
    L = np.asarray(lengths, np.float64)
    target = float((c["tokens"] * L + c["tokens_sq"] * L * L).sum())
    total = float(sample_cost(model, block_size, lengths, supervised, counts).sum())
    return {"target": target / total if total else 0.0, "anchors": 1.0 - target / total if total else 0.0}


def check_window(manifest, sliding_window: int) -> None:
    """Refuse a drafter trained with ``sliding_window`` (``--sliding-window``; 0 = full attention)
    on a ``pack --objective dflash`` manifest whose cost model has another window (its header's
    ``dflash.cost_model.sliding_window``): pack balanced the ranks and filled the cost budget with
    that drafter's step cost, so the run would train on another drafter's data plan. A manifest
    without a cost model (``pack --objective lm``, or None) is not checked."""
    header = getattr(manifest, "header", None)
    cm = (header.get("dflash") or {}).get("cost_model") if isinstance(header, dict) else None
    if not isinstance(cm, dict) or "sliding_window" not in cm or int(cm["sliding_window"]) == int(sliding_window):
        return
    theirs, mine = int(cm["sliding_window"]), int(sliding_window)
    raise ConfigError(f"--sliding-window {mine} contradicts manifest epoch {manifest.epoch}, packed for a drafter with "
                      f"window {theirs} (0 = full attention): its rank balance and cost budget are another drafter's; "
                      f"re-pack with `dflash-prep pack ... --objective dflash --sliding-window {mine} --overwrite`, "
                      f"or train with --sliding-window {theirs}")
