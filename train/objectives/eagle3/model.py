"""The EAGLE-3 drafter and its training-time test (TTT), packed; the EAGLE-3 loss.

Architecture (SpecForge's ``LlamaForCausalLMEagle3``; parameter names are the export's, no prefix):

- ``embed_tokens`` ``[V, H]``: a frozen copy of the target's embedding. ``fc`` (``3*Ht -> H``, no bias)
  fuses the three taps: the target's hidden states at ``target_layer_ids``, each the OUTPUT of that
  0-based decoder layer (HF ``hidden_states[l + 1]``), concatenated in that order ``[T, 3*Ht]``.
- ``midlayer``, given a token embedding ``e`` and a hidden state ``h``: ``a = cat(input_layernorm(e),
  hidden_norm(h))`` ``[N, 2H]`` (embedding first); ``q_proj``, ``k_proj`` and ``v_proj`` all read ``a``
  (``2H`` in, no biases); ``x = h + o_proj(attn)`` (the residual is ``h``, not ``e``); ``out = x +
  mlp(post_attention_layernorm(x))`` (SwiGLU ``gate_proj``/``up_proj``/``down_proj``). ``out`` is the
  step's pre-norm hidden state, fed to the next step; its logits are ``lm_head(norm(out))`` over the
  draft vocabulary (``lm_head`` ``[Vd, H]``, initialised from the target head's rows ``arange + d2t``).
- Buffers ``d2t`` int64 ``[Vd]`` (draft id ``j`` is target id ``j + d2t[j]``) and ``t2d`` bool ``[V]``
  (the target ids in the draft vocabulary); ``nonzero(t2d) == arange(Vd) + d2t`` (ascending ids).

TTT over packed documents (``cu_seqlens``; rows ``t`` are packed positions, ``input_ids`` the documents'
raw tokens ``x``, ``taps[t]`` the target's state after ``x[..t]``, ``positions`` restarting per document):

- step 0: ``h = fc(taps)``; row t reads token ``x[t+1]``; RoPE position ``p[t]``;
- step i: row t reads ``x[t+1+i]`` of its own document (``PAD_ID`` past the end: the row is invalid,
  :func:`ttt_valid`), with hidden = its own pre-norm output of step i-1; RoPE position ``p[t] + i``;
- attention of step i: query (i, t) sees the step-0 keys of its document at rows ``s <= t`` and the keys
  of steps 1..i at row t only, one softmax (scale ``1/sqrt(head_dim)``, GQA ``h -> h // (Hq/Hkv)``).
  An invalid row reaches no valid one (it only ever feeds its own row).

Row t at step i predicts ``x[t+2+i]``; its teacher is the target's distribution at row ``t+1+i``. That
is SpecForge's TTT (its batch arrives shifted left by one, shifted again each step, RoPE ``position +
steps so far``, the pre-norm output carried). RMSNorm casts before the gain (HF order); RoPE is
``rotate_half``, tables in the activation dtype, default, ``linear`` or ``llama3`` scaling.

:func:`eagle3_loss`: per step, soft cross-entropy of the draft logits against the target's
distribution renormalised over the draft vocabulary (target logits at ``arange + d2t``), weighted by
``decay**i`` times the loss mask of the predicted token (``loss_mask[t+2+i]``, the repo's label rule;
SpecForge weights by ``loss_mask[t+i]``, two tokens earlier) times whether the target's argmax is in the
draft vocabulary. It returns sums; the caller normalises over the optimizer step.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from dflash_prep.errors import ConfigError
from dflash_prep.train.layers import RMSNorm, SwiGLU, apply_rope

PAD_ID = 0
"""Token read by a row whose ``t+1+i`` lies past its document's end (SpecForge pads with 0 too)."""
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class Eagle3Config:
    """Shape of an EAGLE-3 drafter: the fields the exported ``config.json`` needs."""

    hidden: int
    """Draft width H (the target's hidden size: the drafter reads its embeddings)."""
    heads: int
    """Query heads."""
    kv_heads: int
    """Key/value heads (GQA); divides ``heads``."""
    head_dim: int
    """Per-head width (even, for RoPE)."""
    intermediate: int
    """SwiGLU hidden width."""
    vocab_size: int
    """The target's vocabulary V (rows of embed_tokens, length of t2d)."""
    draft_vocab_size: int
    """Draft vocabulary Vd <= V (rows of lm_head, length of d2t)."""
    target_hidden: int
    """The target's hidden size Ht (fc reads 3 * Ht)."""
    rms_eps: float
    """RMSNorm epsilon (every norm)."""
    rope_theta: float
    """RoPE base."""
    max_position: int
    """max_position_embeddings."""
    target_layer_ids: tuple[int, int, int]
    """Tapped target layers, 0-based, each the layer's OUTPUT (vLLM id = l + 1, SGLang id = l)."""
    num_target_layers: int | None = None
    """The target's decoder layers L (None: unknown); a tap must be <= L - 2 (engines capture a layer's
    input, so the last layer's output cannot be tapped)."""
    rope_type: str = "default"
    """``default``, ``linear`` (positions / factor) or ``llama3`` (the target's scaling, HF's formula)."""
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    """The scaling's ``factor`` (linear, llama3) and llama3's ``low/high_freq_factor`` and
    ``original_max_position_embeddings``."""

    def __post_init__(self):
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab_size", "draft_vocab_size",
                     "target_hidden", "max_position"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"eagle3.{name} must be >= 1, got {getattr(self, name)}")
        if self.heads % self.kv_heads or self.head_dim % 2:
            raise ConfigError(f"eagle3: kv_heads ({self.kv_heads}) must divide heads ({self.heads}) and head_dim "
                              f"({self.head_dim}) must be even")
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError(f"eagle3.draft_vocab_size {self.draft_vocab_size} exceeds the target's vocabulary "
                              f"{self.vocab_size}")
        ids, L = self.target_layer_ids, self.num_target_layers
        if len(ids) != 3 or len(set(ids)) != 3 or min(ids) < 0:
            raise ConfigError(f"eagle3.target_layer_ids must be three distinct layer ids >= 0, got {list(ids)}; "
                              "taps that collide feed fc one state twice: pass three distinct ids")
        if L is not None and max(ids) > L - 2:
            raise ConfigError(f"eagle3.target_layer_ids {list(ids)}: the target has {L} layers and vLLM/SGLang tap a "
                              f"layer's input, so the output of layers up to {L - 2} only can be tapped")
        if not (self.rms_eps > 0 and self.rope_theta > 0 and self.rope_factor > 0):
            raise ConfigError("eagle3.rms_eps, rope_theta and rope_factor must be positive")
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(f"eagle3.rope_type {self.rope_type!r} is not supported (one of {', '.join(ROPE_TYPES)})")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        return d

    @classmethod
    def from_target_config(cls, hf_config, draft_vocab_size: int, target_layer_ids=None) -> "Eagle3Config":
        """A drafter shaped like one layer of the target (HF config: Qwen3, Llama, ...): its width, heads,
        MLP width, eps and RoPE (scaling included); taps ``(1, L//2 - 1, L - 4)`` unless given (the
        engines' default, in our output-of-layer ids)."""
        c = hf_config
        heads, L = int(c.num_attention_heads), int(c.num_hidden_layers)
        ids = (1, L // 2 - 1, L - 4) if target_layer_ids is None else tuple(target_layer_ids)
        rp = dict(getattr(c, "rope_parameters", None) or {})
        if not rp:  # transformers 4.x: rope_theta + rope_scaling
            rp = {**(getattr(c, "rope_scaling", None) or {}), "rope_theta": getattr(c, "rope_theta", 10000.0)}
        kind = rp.get("rope_type", rp.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise ConfigError(f"the target's RoPE type {kind!r} is not supported by the EAGLE-3 drafter "
                              f"(one of {', '.join(ROPE_TYPES)})")
        return cls(hidden=int(c.hidden_size), heads=heads, kv_heads=int(getattr(c, "num_key_value_heads", None) or heads),
                   head_dim=int(getattr(c, "head_dim", None) or int(c.hidden_size) // heads),
                   intermediate=int(c.intermediate_size), vocab_size=int(c.vocab_size),
                   draft_vocab_size=int(draft_vocab_size), target_hidden=int(c.hidden_size),
                   rms_eps=float(getattr(c, "rms_norm_eps", 1e-6)), rope_theta=float(rp.get("rope_theta", 10000.0)),
                   max_position=int(getattr(c, "max_position_embeddings", 4096)), target_layer_ids=ids,
                   num_target_layers=L, rope_type=kind, rope_factor=float(rp.get("factor", 1.0)),
                   rope_low_freq_factor=float(rp.get("low_freq_factor", 1.0)),
                   rope_high_freq_factor=float(rp.get("high_freq_factor", 4.0)),
                   rope_original_max_position=int(rp.get("original_max_position_embeddings", 8192)))


def check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int, draft_vocab_size: int) -> None:
    """Refuse a vocabulary map that is not ``d2t`` int64 ``[Vd]``, ``t2d`` bool ``[V]`` with
    ``nonzero(t2d) == arange(Vd) + d2t`` (ascending target ids) (ConfigError naming the problem)."""
    want = (torch.int64, (draft_vocab_size,), torch.bool, (vocab_size,))
    if (d2t.dtype, tuple(d2t.shape), t2d.dtype, tuple(t2d.shape)) != want:
        raise ConfigError(f"d2t must be int64 [{draft_vocab_size}] and t2d bool [{vocab_size}], got {d2t.dtype} "
                          f"{list(d2t.shape)} and {t2d.dtype} {list(t2d.shape)}")
    ids = torch.arange(draft_vocab_size, device=d2t.device) + d2t
    if not torch.equal(t2d.nonzero().flatten().to(ids.device), ids):
        raise ConfigError("d2t/t2d disagree: the target ids arange(Vd) + d2t must be the ascending ids where t2d "
                          "is True (target id = draft id + d2t[draft id])")


# ----------------------------------------------------------------------------- attention
def doc_bounds(cu_seqlens: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per packed row: its document's index and end row (both int64 ``[T]``)."""
    cu = cu_seqlens.to(torch.int64)
    doc = torch.searchsorted(cu[1:], torch.arange(T, device=cu.device), right=True)  # (T,)
    return doc, cu[1:][doc]


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Every query sees every key: q ``[Nq, Hq, D]``, k/v ``[Nk, Hkv, D]`` -> ``[Nq, Hq, D]`` (fp32 or wider inside)."""
    g, f = q.shape[1] // k.shape[1], torch.promote_types(q.dtype, torch.float32)
    k, v = k.repeat_interleave(g, dim=1).to(f), v.repeat_interleave(g, dim=1).to(f)  # (Nk, Hq, D)
    p = torch.softmax(torch.einsum("qhd,khd->hqk", q.to(f), k) * scale, dim=-1)  # (Hq, Nq, Nk)
    return torch.einsum("hqk,khd->qhd", p, v).to(q.dtype)


def ttt_attention(q, k, v, cu_seqlens, max_seqlen: int, *, sm_scale: float | None = None):
    """The drafter's one attention entry point: :func:`dflash_prep.kernels.attention.ttt_attention` (the Triton
    kernel on CUDA, its PyTorch reference elsewhere): q ``[Sq, T, Hq, D]`` holds the last ``Sq`` of the
    ``Sk`` steps of k/v ``[Sk, T, Hkv, D]``; step i at row t sees ``k[0]`` at rows ``s <= t`` of its
    document and ``k[1..i]`` at row t (docs/kernels.md)."""
    from dflash_prep.kernels.attention import ttt_attention

    return ttt_attention(q, k, v, cu_seqlens, max_seqlen, sm_scale=sm_scale)


def shifted_ids(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, k: int, pad_id: int = PAD_ID) -> torch.Tensor:
    """``x[t + k]`` within each document, ``pad_id`` where ``t + k`` is past the document's end ``[T]``
    (any dtype: the loss shifts its mask with it)."""
    T = input_ids.shape[0]
    _, end = doc_bounds(cu_seqlens, T)
    idx = torch.arange(T, device=input_ids.device) + k
    return torch.where(idx < end, input_ids[idx.clamp(max=T - 1)], torch.full_like(input_ids, pad_id))


def ttt_valid(cu_seqlens: torch.Tensor, T: int, steps: int) -> torch.Tensor:
    """bool ``[S, T]``: row t reads a real token at step i (``t + 1 + i`` inside its document)."""
    _, end = doc_bounds(cu_seqlens, T)
    return torch.stack([torch.arange(T, device=end.device) + 1 + i < end for i in range(steps)])


# ----------------------------------------------------------------------------- model
class MidLayer(nn.Module):
    """The one decoder layer (module docstring), split at the attention so TTT and decoding share it."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.config = c
        self.input_layernorm = RMSNorm(c.hidden, c.rms_eps, cast_before_gain=True)
        self.hidden_norm = RMSNorm(c.hidden, c.rms_eps, cast_before_gain=True)
        self.post_attention_layernorm = RMSNorm(c.hidden, c.rms_eps, cast_before_gain=True)
        H2, D = 2 * c.hidden, c.head_dim
        self.self_attn = nn.ModuleDict({"q_proj": nn.Linear(H2, c.heads * D, bias=False),
                                        "k_proj": nn.Linear(H2, c.kv_heads * D, bias=False),
                                        "v_proj": nn.Linear(H2, c.kv_heads * D, bias=False),
                                        "o_proj": nn.Linear(c.heads * D, c.hidden, bias=False)})
        self.mlp = SwiGLU(c.hidden, c.intermediate, names=("gate_proj", "up_proj", "down_proj"))

    def qkv(self, embeds, hidden, cos, sin):
        """embeds/hidden ``[N, H]`` -> RoPE'd q ``[N, Hq, D]``, k ``[N, Hkv, D]`` and v ``[N, Hkv, D]``."""
        c, N = self.config, hidden.shape[0]
        a = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # (N, 2H)
        q = self.self_attn["q_proj"](a).view(N, c.heads, c.head_dim)
        k = self.self_attn["k_proj"](a).view(N, c.kv_heads, c.head_dim)
        v = self.self_attn["v_proj"](a).view(N, c.kv_heads, c.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, hidden, attn):
        """Residual on ``hidden`` ``[N, H]`` + o_proj of ``attn`` ``[N, Hq, D]``, then the MLP -> ``[N, H]``."""
        x = hidden + self.self_attn["o_proj"](attn.reshape(attn.shape[0], -1))
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Drafter(nn.Module):
    """EAGLE-3 drafter (module docstring); ``state_dict()`` is the export's tensor set."""

    def __init__(self, cfg: Eagle3Config, *, init_std: float = 0.02):
        super().__init__()
        c = self.config = cfg
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden)
        self.embed_tokens.requires_grad_(False)
        self.fc = nn.Linear(3 * c.target_hidden, c.hidden, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden, c.rms_eps, cast_before_gain=True)
        self.lm_head = nn.Linear(c.hidden, c.draft_vocab_size, bias=False)
        t2d = torch.arange(c.vocab_size) < c.draft_vocab_size  # the identity map until set_vocab_map
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", t2d)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=init_std)

    @classmethod
    def from_target(cls, cfg: Eagle3Config, target, d2t: torch.Tensor, t2d: torch.Tensor | None = None,
                    **kw) -> "Eagle3Drafter":
        """A drafter for a transformers causal LM ``target``: its embedding (frozen copy), ``lm_head``
        from its head's rows ``arange + d2t``, the vocabulary map (``t2d`` derived from ``d2t`` if None)."""
        if cfg.hidden != cfg.target_hidden:
            raise ConfigError(f"eagle3: the drafter copies the target's embedding and head rows, so its width "
                              f"{cfg.hidden} must be the target's {cfg.target_hidden}")
        d = cls(cfg, **kw)
        d.set_vocab_map(d2t, t2d)
        with torch.no_grad():
            d.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
            d.lm_head.weight.copy_(target.get_output_embeddings().weight[d.draft_target_ids()])
        return d

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor | None = None) -> None:
        """Install the vocabulary map (``t2d`` derived from ``d2t`` if None); ConfigError when inconsistent."""
        c, d2t = self.config, d2t.to(torch.int64).cpu()
        if t2d is None:  # ids outside 0..V-1 are dropped here, so check_vocab_map refuses them
            ids = (torch.arange(c.draft_vocab_size) + d2t).clamp(-1, c.vocab_size)
            t2d = torch.zeros(c.vocab_size + 2, dtype=torch.bool).index_fill_(0, ids + 1, True)[1:-1]
        check_vocab_map(d2t, t2d.cpu(), c.vocab_size, c.draft_vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_target_ids(self) -> torch.Tensor:
        """int64 ``[Vd]``: the target id of each draft id."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin ``[..., D/2]`` of ``positions`` (fp32 angles, tables in ``dtype``), the config's scaling."""
        c = self.config
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, device=positions.device,
                                                   dtype=torch.float32) / c.head_dim))
        if c.rope_type == "linear":
            inv = inv / c.rope_factor
        elif c.rope_type == "llama3":  # HF/SpecForge: keep short wavelengths, divide long ones, blend between
            n, lo, hi = c.rope_original_max_position, c.rope_low_freq_factor, c.rope_high_freq_factor
            wl = 2 * math.pi / inv  # wavelengths
            smooth = (n / wl - lo) / (hi - lo) if hi != lo else torch.zeros_like(wl)
            mid = (1 - smooth) * inv / c.rope_factor + smooth * inv
            inv = torch.where(wl < n / hi, inv, torch.where(wl > n / lo, inv / c.rope_factor, mid))
        ang = positions.to(torch.float32)[..., None] * inv  # (..., D/2)
        return ang.cos().to(dtype), ang.sin().to(dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[..., Vd]`` of pre-norm hidden states ``[..., H]``."""
        return self.lm_head(self.norm(hidden))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def ttt_hidden(self, taps, input_ids, positions, cu_seqlens, max_seqlen: int, steps: int) -> torch.Tensor:
        """Pre-norm outputs ``[S, T, H]`` of ``steps`` TTT steps over packed documents (module docstring):
        taps ``[T, 3*Ht]``, input_ids/positions ``[T]`` int64, cu_seqlens int32 ``[D + 1]``."""
        c = self.config
        T = input_ids.shape[0]
        if taps.shape != (T, 3 * c.target_hidden) or positions.shape != (T,) or steps < 1:
            raise ValueError(f"ttt: taps must be [{T}, {3 * c.target_hidden}] and positions [{T}], steps >= 1; got "
                             f"{tuple(taps.shape)}, {tuple(positions.shape)}, {steps}")
        h = self.fc(taps)  # (T, H)
        ks, vs, outs = [], [], []
        for i in range(steps):
            e = self.embed_tokens(shifted_ids(input_ids, cu_seqlens, 1 + i)).to(h.dtype)  # (T, H)
            q, k, v = self.midlayer.qkv(e, h, *self.rope(positions + i, h.dtype))
            ks, vs = ks + [k], vs + [v]
            o = ttt_attention(q[None], torch.stack(ks), torch.stack(vs), cu_seqlens, max_seqlen)[0]  # (T, Hq, D)
            h = self.midlayer.finish(h, o)
            outs.append(h)
        return torch.stack(outs)

    def forward(self, taps, input_ids, positions, cu_seqlens, max_seqlen: int, steps: int, *,
                logits: bool = True) -> torch.Tensor:
        """Per-step draft logits ``[S, T, Vd]``, or with ``logits=False`` the normed hidden states
        ``[S, T, H]`` (for a chunked ``lm_head``); arguments as :meth:`ttt_hidden`."""
        h = self.ttt_hidden(taps, input_ids, positions, cu_seqlens, max_seqlen, steps)
        return self.logits(h) if logits else self.norm(h)


# ----------------------------------------------------------------------------- loss
@dataclass
class Eagle3Loss:
    """Sums of one micro-batch; ``loss = loss_sum / weight_sum`` over the whole optimizer step."""

    loss_sum: torch.Tensor
    """Scalar: ``sum_i decay**i sum_t w_i(t) * CE_i(t)`` (differentiable)."""
    weight_sum: torch.Tensor
    """Scalar: ``sum_i decay**i sum_t w_i(t)``; ``w = loss_mask[t+2+i] * [target argmax in draft vocab]``."""
    correct: torch.Tensor
    """``[S]``: loss-masked rows whose draft argmax (as a target id) is the target's argmax."""
    counted: torch.Tensor
    """``[S]``: loss-masked rows (``sum_t loss_mask[t+2+i]``); ``correct / counted`` is step i's accuracy."""


def soft_ce(draft_logits, target_logits, draft_target_ids, t2d):
    """Rows ``[N, Vd]`` vs ``[N, V]``: CE ``[N]`` against ``softmax(target_logits[:, draft_target_ids])``,
    whether the draft argmax (mapped to a target id) hits the target's argmax ``[N]``, and whether that
    argmax is in the draft vocabulary ``[N]``."""
    tl = target_logits.float()
    best = tl.argmax(-1)  # (N,) over the full vocabulary
    p = torch.softmax(tl.index_select(-1, draft_target_ids), dim=-1)  # (N, Vd)
    ce = -(p * F.log_softmax(draft_logits.float(), dim=-1)).sum(-1)
    return ce, draft_target_ids[draft_logits.argmax(-1)] == best, t2d[best]


def eagle3_loss(step_logits, target_logits, loss_mask, cu_seqlens, d2t, t2d, *, decay: float = 0.8) -> Eagle3Loss:
    """The EAGLE-3 loss of :meth:`Eagle3Drafter.forward`'s ``[S, T, Vd]`` logits. ``target_logits [T, V]``:
    the target's logits at every packed row (row r is its distribution over ``x[r+1]``); ``loss_mask [T]``
    (1 = the token is supervised, the repo's rule). Step i, row t is compared with row ``t+1+i``'s target
    distribution and weighted by ``loss_mask[t+2+i]`` (0 past the document's end); only those rows are
    computed."""
    S = step_logits.shape[0]
    ids = torch.arange(d2t.shape[0], device=d2t.device) + d2t
    lm = loss_mask.to(torch.float32)
    loss_sum, weight_sum = step_logits.new_zeros((), dtype=torch.float32), lm.new_zeros(())
    correct, counted = lm.new_zeros(S), lm.new_zeros(S)
    for i in range(S):
        m = shifted_ids(lm, cu_seqlens, 2 + i, pad_id=0)  # (T,) the predicted token's mask, 0 past the end
        sel = m.nonzero().flatten()
        ce, hit, in_draft = soft_ce(step_logits[i, sel], target_logits[sel + 1 + i], ids, t2d)
        w = m[sel] * in_draft
        loss_sum = loss_sum + decay ** i * (w * ce).sum()
        weight_sum = weight_sum + decay ** i * w.sum()
        correct[i], counted[i] = (m[sel] * hit).sum(), m[sel].sum()
    return Eagle3Loss(loss_sum, weight_sum, correct, counted)
