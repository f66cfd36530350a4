"""What one DFlash drafter training step costs, per sample and per micro-batch (FLOPs).

docs/definitions.md "Drafter step cost", made exact. One count, :func:`flops`, prices a sample
or a micro-batch from five quantities; ``pack`` calls it with expectations (it reads no masks),
the trainer's MFU (:meth:`dflash_prep.train.objectives.dflash.objective.DFlashObjective.flops`) with what
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

Two more drafters price their steps here: DFlash2 (:class:`DFlash2CostModel`, DFlash plus
per-block-token convolutions and a per-row candidate selector, so the same five quantities
with larger coefficients) and EAGLE-3 (:class:`Eagle3CostModel`, ``a L + b L^2`` per
document). :class:`TargetSizes` holds the seven target sizes all three read.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numba as nb
import numpy as np

from dflash_prep.errors import ConfigError
from dflash_prep.objectives.target_sizes import TargetSizes, config_sizes, dims_sizes


@dataclass(frozen=True)
class DrafterCostModel(TargetSizes):
    """Model sizes of the drafter step cost (module docstring): the target's
    (:class:`TargetSizes`) and the drafter's two.

    Attributes:
        draft_layers: ``N``, the drafter's decoder layers (it taps ``N`` target layers).
        sliding_window: ``W`` of the draft layers' attention (``--sliding-window``), 0 = full:
            a block attends to ``min(a_j, W)`` context keys.
    """

    draft_layers: int = 1
    sliding_window: int = 0

    def __post_init__(self):
        if int(self.sliding_window) < 0:
            raise ConfigError(f"--sliding-window must be >= 0 (0 = full attention), got {self.sliding_window}")
        for f in fields(self):
            if f.name != "sliding_window" and int(getattr(self, f.name)) < 1:
                raise ConfigError(f"cost model: {f.name} must be >= 1, got {getattr(self, f.name)}")

    @classmethod
    def from_config(cls, folder: str | Path, draft_layers: int = 1, sliding_window: int = 0, **extra):
        """Sizes from a transformers ``config.json`` (a folder or the file itself)."""
        return cls(**config_sizes(folder), draft_layers=int(draft_layers), sliding_window=int(sliding_window),
                   **extra)

    @classmethod
    def from_dims(cls, spec: str, draft_layers: int = 1, sliding_window: int = 0, **extra):
        """Sizes from ``"hidden=4096,layers=36,intermediate=12288,heads=32,kv_heads=8,head_dim=128,vocab=151936"``."""
        return cls(**dims_sizes(spec), draft_layers=int(draft_layers), sliding_window=int(sliding_window), **extra)

    # -- parameter counts
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



# ----------------------------------------------------------------------------- DFlash2
@dataclass(frozen=True)
class DFlash2CostModel(DrafterCostModel):
    """DFlash2's step cost: DFlash's (:class:`DrafterCostModel`) plus two terms, each linear in a
    quantity :func:`flops` already reads, so pack, verify and the trainer price a DFlash2 step
    through the same five coefficients (:meth:`coefficients` adds them in). The terms follow the
    trainer's modules (``train/objectives/dflash2``: ``conv.py``, ``selector.py``).

    - Convolutions (trained: forward x3 with the backward). Each draft layer wraps its
      attention and its MLP sublayer in a pair of grouped dynamic depthwise convolutions over
      the block's slots, one on the sublayer's input and one on its output, of ``K_c =
      conv_kernel_size`` taps; one projection of the sublayer's input gives both sides' dynamic
      taps, ``H -> 2 K_c G`` with ``G = H / conv_group_size`` groups (a group is
      ``conv_group_size`` channels sharing a tap): ``4 H K_c G`` forward per block token; each
      convolution's taps ``2 K_c H``. Per anchor (``B`` block tokens, ``N`` layers, 2
      sublayers): ``conv = 24 * K_c * H * (G + 1) * B * N``, added to ``anchors``. Forming the
      coefficients (base + delta) is elementwise and left out, as norms are.
    - The candidate selector, on each row with a loss weight (the rows the LM head runs on,
      whose logits are the unary scores). Training is teacher-forced: a slot's predecessor is
      the gold token, so it scores its ``K = selector_top_k`` candidates once, ``<A[p] * P h,
      B[c]>``: the projection ``P`` (``H -> r``, ``r = selector_rank``: ``2 H r``), ``A[p] * P h``
      (``r``) and ``K`` dot products of ``r`` (``2 K r``), forward x3; plus the top-``K`` over
      the ``V`` logits, counted as ``V`` comparisons, forward only (no gradient flows through
      the indices), and the head's logits those are ranked on: the trainer computes them again
      for the top-K (``train/objectives/dflash2/objective.py``), ``2 H V`` forward only (the
      gradient reaches the K gathered values alone). Per row: ``selector = 6 H r + 3 r (2 K + 1)
      + V + 2 H V``, added to ``head_rows``.
      (Drafting scores the ``K x K`` lattice of adjacent candidates instead; training never
      does.) Gathering ``A``/``B`` rows moves memory, not FLOPs.
    """

    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16

    def __post_init__(self):
        super().__post_init__()
        if self.hidden % self.conv_group_size:
            raise ConfigError(f"--conv-group-size {self.conv_group_size} must divide the target's hidden size "
                              f"{self.hidden} (it is the channels per convolution group)")
        if self.selector_top_k > self.vocab:
            raise ConfigError(f"--selector-top-k {self.selector_top_k} exceeds the target vocabulary {self.vocab}")

    @property
    def conv_groups(self) -> int:
        return self.hidden // self.conv_group_size

    @property
    def draft_params(self) -> int:
        """DFlash's, plus each layer's two convolution pairs (projection and base taps) and the
        selector's P, A and B."""
        kc, H = self.conv_kernel_size, self.hidden
        conv = self.draft_layers * 2 * (2 * kc * self.conv_groups * H + 2 * kc * H)
        return super().draft_params + conv + self.selector_rank * (H + 2 * self.vocab)

    def coefficients(self, block_size: int) -> dict:
        """DFlash's coefficients with ``conv`` (per anchor) in ``anchors`` and ``selector`` (per
        row with a loss weight) in ``head_rows``; both also listed on their own."""
        c = super().coefficients(block_size)
        H, B, N = float(self.hidden), float(block_size), float(self.draft_layers)
        kc, r, k = float(self.conv_kernel_size), float(self.selector_rank), float(self.selector_top_k)
        conv = 24.0 * kc * H * (self.conv_groups + 1.0) * B * N
        selector = 6.0 * H * r + 3.0 * r * (2.0 * k + 1.0) + float(self.vocab) + 2.0 * H * float(self.vocab)
        return {**c, "anchors": c["anchors"] + conv, "head_rows": c["head_rows"] + selector, "conv": conv,
                "selector": selector}


def cost_model_of_record(rec: dict) -> DrafterCostModel:
    """The DFlash-family cost model a manifest records (:meth:`DrafterCostModel.describe`): a
    :class:`DFlash2CostModel` when the record holds the conv and selector sizes, else a
    :class:`DrafterCostModel`. Parameter counts and coefficients are recomputed, never read."""
    cls = DFlash2CostModel if all(f.name in rec for f in fields(DFlash2CostModel)) else DrafterCostModel
    return cls(**{f.name: rec[f.name] for f in fields(cls) if f.name in rec})


# ----------------------------------------------------------------------------- EAGLE-3
@dataclass(frozen=True)
class Eagle3CostModel(TargetSizes):
    """The EAGLE-3 step cost of a document of ``L`` tokens: ``a L + b L^2`` FLOPs
    (:meth:`coefficients`), for ``S = ttt_steps`` drafter passes over every position.

    - target forward (frozen, as DFlash counts it): ``2 P_t L + 2 h d L_t L^2`` (causal
      attention ``4 h d L^2 / 2`` per layer), plus the target's LM head at every position,
      ``2 H V L`` (the soft labels: the target's next-token distribution, read through t2d);
    - fc over the three tapped states, ``3H -> H``, once per position (trained, x3):
      ``18 H^2 L``; the later passes feed the drafter its own hidden state, not the fc's;
    - per pass (trained, x3): the decoder layer, whose q/k/v read the ``2H``-wide
      ``[embedding, hidden]`` input (``P_e = 2H h d + 4H h_kv d + h d H + 3 H I`` weights):
      ``6 P_e L``; the LM head over the draft vocabulary ``V_d``: ``6 H V_d L``; attention of
      pass ``j = 0..S-1``: the query at position ``i`` sees its ``i + 1`` causal keys plus the
      ``j`` diagonal keys of the earlier passes, ``12 h d (L (L + 1) / 2 + j L)``.

    Summed: ``a = 2 P_t + 2 H V + 18 H^2 + 6 S (P_e + H V_d) + 6 h d S^2`` and
    ``b = 2 h d L_t + 6 h d S``. Embedding lookups and norms are left out (no FLOPs to speak of).

    Attributes:
        draft_vocab: ``V_d``, the draft LM head's rows (``--draft-vocab-size``).
        ttt_steps: ``S``, drafter passes per step (``--ttt-steps``).
    """

    draft_vocab: int = 32000
    ttt_steps: int = 7

    def __post_init__(self):
        super().__post_init__()
        if self.draft_vocab > self.vocab:
            raise ConfigError(f"--draft-vocab-size {self.draft_vocab} exceeds the target vocabulary {self.vocab}; "
                              f"pass at most {self.vocab}")

    @property
    def eagle_layer_params(self) -> int:
        """Weights of the one draft layer: q, k, v on the 2H-wide input, o, the SwiGLU MLP."""
        H, hd = self.hidden, self.head_dim
        return 2 * H * self.heads * hd + 4 * H * self.kv_heads * hd + self.heads * hd * H + 3 * H * self.intermediate

    @property
    def draft_params(self) -> int:
        return 3 * self.hidden * self.hidden + self.eagle_layer_params + self.hidden * self.draft_vocab

    def terms(self) -> dict:
        """Each term of the class docstring, FLOPs per token (``*_sq``: per squared document length)."""
        H, hd, S = float(self.hidden), float(self.heads * self.head_dim), float(self.ttt_steps)
        return {"target": 2.0 * self.target_params, "target_sq": 2.0 * hd * self.layers,
                "target_head": 2.0 * H * self.vocab, "fc": 18.0 * H * H,
                "draft_layer": 6.0 * S * self.eagle_layer_params, "draft_head": 6.0 * S * H * self.draft_vocab,
                "draft_attention": 6.0 * hd * S * S, "draft_attention_sq": 6.0 * hd * S}

    def coefficients(self) -> dict:
        """``tokens`` (a, per token) and ``tokens_sq`` (b, per squared document length)."""
        t = self.terms()
        return {"tokens": t["target"] + t["target_head"] + t["fc"] + t["draft_layer"] + t["draft_head"]
                + t["draft_attention"], "tokens_sq": t["target_sq"] + t["draft_attention_sq"]}

    def batch_cost(self, tokens, tokens_sq) -> np.ndarray:
        """FLOPs per micro-batch (float64) from its tokens and its sum of squared lengths."""
        c = self.coefficients()
        return c["tokens"] * np.asarray(tokens, np.float64) + c["tokens_sq"] * np.asarray(tokens_sq, np.float64)

    def describe(self) -> dict:
        """What manifest.json records: the sizes, parameter counts, coefficients and terms."""
        return {**asdict(self), "target_params": self.target_params, "draft_params": self.draft_params,
                "coefficients": self.coefficients(), "terms": self.terms()}

    @classmethod
    def of_record(cls, rec: dict) -> "Eagle3CostModel":
        """The model :meth:`describe` recorded (the derived entries are recomputed, never read)."""
        return cls(**{f.name: rec[f.name] for f in fields(cls) if f.name in rec})


def check_drafter_shape(manifest, *, sliding_window: int, draft_layers: int, objective: str = "dflash") -> None:
    """Refuse a drafter trained with another shape than the one its manifest was packed for: a
    ``sliding_window`` (``--sliding-window``; 0 = full attention) or ``draft_layers``
    (``--draft-layers``) other than the header's ``dflash.cost_model``. Pack balanced the ranks
    and filled the cost budget with that drafter's step cost, so the run would train on another
    drafter's data plan. One line, naming the pack command that fixes it. A manifest without a
    cost model (``pack --objective lm``, or None) is not checked."""
    header = getattr(manifest, "header", None)
    cm = (header.get("dflash") or {}).get("cost_model") if isinstance(header, dict) else None
    if not isinstance(cm, dict):
        return
    for flag, field, mine, what in (("--sliding-window", "sliding_window", sliding_window,
                                     lambda v: f"window {v} (0 = full attention)"),
                                    ("--draft-layers", "draft_layers", draft_layers, lambda v: f"{v} draft layer(s)")):
        if field not in cm or int(cm[field]) == int(mine):
            continue
        theirs, mine = int(cm[field]), int(mine)
        raise ConfigError(f"{flag} {mine} contradicts manifest epoch {manifest.epoch}, packed for a drafter with "
                          f"{what(theirs)}: its rank balance and cost budget are another drafter's; re-pack with "
                          f"`dflash-prep pack ... --objective {objective} {flag} {mine} --overwrite`, or train with "
                          f"{flag} {theirs}")
