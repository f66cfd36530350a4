"""What a run trains and how one micro-batch becomes a loss: ``--objective lm | dflash``.

The training loop (:mod:`dflash_prep.train.loop`) is objective-agnostic. It asks an objective for

- ``model``: the trainable module (optimizer, checkpoint, gradient all-reduce);
- ``build(ds, mb, epoch, pin)``: one manifest micro-batch as tensors (run on the prefetch thread);
- ``denominator(batch)``: the batch's share of the step's loss normaliser (LM: target tokens;
  DFlash: the sum of block weights), all-reduced over ranks and accumulation before any backward;
- ``loss(batch, autocast)``: ``(loss_sum, stats)``; the loop backpropagates ``loss_sum / N``
  and all-reduces ``stats`` (float64, ``stats_width`` entries) once per step;
- ``metrics(stats, N)``: the step's logged metrics; ``flops(batch)`` for MFU;
- ``contract()``: what besides the data plan fixes the run (resume refuses a change, naming it);
- ``model_config()``: the module's shape (resume refuses a change); ``finish(out)``: final exports.

:class:`LMObjective` trains the small :class:`~dflash_prep.train.model.Decoder`, or a local
transformers causal LM (``--init-from DIR``; packed documents through the varlen kernel, saved
with ``save_pretrained`` to ``OUT/hf`` with its tokenizer). Its head + CE run in chunks.
:class:`DFlashObjective` trains a drafter on a frozen target (:mod:`.objective_dflash`).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from dflash_prep.errors import ConfigError

from .chunked_ce import weighted_ce
from .config import TrainConfig
from .data import IGNORE, build_batch


def _flat(b):
    """A padded Batch's real tokens packed: (ids, labels, positions, cu_seqlens, max_seqlen)."""
    if b.layout == "varlen":
        return b.input_ids, b.labels, b.position_ids, b.cu_seqlens, b.max_seqlen
    lens = b.lengths.to(torch.int64)
    L = b.input_ids.shape[1]
    keep = torch.arange(L, device=lens.device)[None, :] < lens[:, None]  # (B, L)
    cu = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=lens.device)
    cu[1:] = torch.cumsum(lens, 0)
    pos = torch.arange(L, device=lens.device).expand_as(keep)[keep]
    return b.input_ids[keep], b.labels[keep], pos, cu, int(lens.max())


class LMObjective:
    """Next-token CE over target tokens, normalised by the step's target count (``data`` docstring)."""

    name = "lm"
    stats_width = 1

    def __init__(self, model, cfg: TrainConfig | None = None, *, hf: bool = False, tokenizer=None,
                 contract: dict | None = None):
        self.model, self.hf, self.tokenizer = model, hf, tokenizer
        self.ce_chunk = cfg.ce_chunk if cfg is not None else 2048
        self.pad_id = 0
        self._contract = contract or {}

    def build(self, ds, mb, epoch: int, layout: str, pin: bool):
        return build_batch(ds, mb, layout, pad_id=self.pad_id, pin=pin)

    @staticmethod
    def denominator(b) -> float:
        return float(b.n_targets)

    def loss(self, b, autocast):
        with autocast():
            if self.hf:
                from .target import packed_forward

                ids, labels, pos, cu, mx = _flat(b)
                h = packed_forward(self.model, ids, pos, cu, mx).last_hidden_state[0]  # (T, H)
                head = self.model.get_output_embeddings().weight
            else:
                h = self.model.hidden(b.input_ids, **b.model_inputs())  # (B, L, d) or (T, d)
                labels = b.labels
                head = self.model.head.weight
            h, labels = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
            sel = torch.nonzero(labels != IGNORE).squeeze(1)
            tg = labels.index_select(0, sel)
            ls, _ = weighted_ce(h.index_select(0, sel), head, tg, torch.ones_like(tg, dtype=torch.float32),
                                chunk=self.ce_chunk)
        return ls, ls.detach().double().reshape(1)

    @staticmethod
    def metrics(stats: torch.Tensor, denom: float) -> dict:
        return {"loss": float(stats[0]) / denom if denom > 0 else float("nan")}

    def flops(self, b) -> float:
        return 6.0 * sum(p.numel() for p in self.model.parameters()) * b.real_tokens

    def contract(self) -> dict:
        return {"objective": "lm", **self._contract}

    def model_config(self) -> dict:
        return self.model.config.to_dict() if self.hf else asdict(self.model.cfg)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def finish(self, out: Path) -> None:
        if self.hf:  # the trained LM as a transformers folder, loadable like the one it started from
            dest = Path(out) / "hf"
            self.model.config._attn_implementation = "sdpa"
            self.model.save_pretrained(dest)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(dest)


class DFlashObjective:
    """Drafter training on a frozen target (:mod:`dflash_prep.train.objective_dflash`)."""

    name = "dflash"

    def __init__(self, drafter, target, cfg: TrainConfig, *, anchor_spec, gamma: float, identity: dict):
        from .objective_dflash import stats_width

        self.model, self.target, self.cfg = drafter, target, cfg
        self.spec, self.gamma, self.identity = anchor_spec, float(gamma), identity
        self.B = drafter.config.block_size
        self.stats_width = stats_width(self.B)
        P = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
        last = max(drafter.config.target_layer_ids)
        self._p_target = sum(P(target.layers[i]) for i in range(last + 1))
        self._p_drafter = P(drafter)
        self._p_head = target.lm_head.weight.numel()

    def build(self, ds, mb, epoch: int, layout: str, pin: bool):
        from .objective_dflash import build_dflash_batch

        c = self.model.config
        return build_dflash_batch(ds, mb, epoch=epoch, spec=self.spec, gamma=self.gamma,
                                  mask_token_id=c.mask_token_id, vocab_size=c.vocab_size, pin=pin)

    @staticmethod
    def denominator(b) -> float:
        return b.weight_sum

    def loss(self, b, autocast):
        from .objective_dflash import dflash_loss

        return dflash_loss(self.model, self.target, b, block_size=self.B, ce_chunk=self.cfg.ce_chunk,
                           autocast=autocast)

    def metrics(self, stats: torch.Tensor, denom: float) -> dict:
        from .objective_dflash import summarize_stats

        return summarize_stats(stats, denom, self.B)

    def flops(self, b) -> float:
        from .objective_dflash import step_flops

        c = self.model.config
        return step_flops(self._p_target, self._p_drafter, self._p_head, b, c.heads, c.head_dim, c.num_layers, self.B,
                          window=c.sliding_window)

    def contract(self) -> dict:
        c = self.model.config
        return {"objective": "dflash", **self.identity, "target_layer_ids": list(c.target_layer_ids),
                "mask_token_id": c.mask_token_id, "block_size": c.block_size, "gamma": self.gamma,
                "anchors": self.spec.to_dict()}

    def model_config(self) -> dict:
        return self.model.config.to_dict()

    def num_parameters(self) -> int:
        return self._p_drafter

    def finish(self, out: Path) -> None:
        pass  # `export RUN --out DIR` writes the public format from the checkpoint


def build_objective(cfg: TrainConfig, ds, device: torch.device, manifest=None):
    """The objective ``cfg`` asks for, its module on ``device`` (seeded with ``cfg.seed``)."""
    from .source import tokenizer_field

    torch.manual_seed(cfg.seed)
    if cfg.objective == "lm":
        if cfg.init_from:
            from .target import load_causal_lm, load_tokenizer, target_identity

            tok = load_tokenizer(cfg.init_from)
            model = load_causal_lm(cfg.init_from, device=device, dtype=torch.float32).train()
            ident = target_identity(cfg.init_from, tok)
            obj = LMObjective(model, cfg, hf=True, tokenizer=tok, contract={"init_from": ident["target_fingerprint"]})
        else:
            from .model import Decoder

            model = Decoder(cfg.model_config(int(tokenizer_field(ds, "vocab_size", 0)))).to(device)
            obj = LMObjective(model, cfg)
        obj.pad_id = int(tokenizer_field(ds, "pad_id", 0))
        return obj
    if cfg.objective != "dflash":
        raise ConfigError(f"--objective must be lm or dflash, got {cfg.objective!r}")
    from .drafter import Drafter, DrafterConfig
    from .objective_dflash import default_gamma
    from .target import FrozenTarget, load_tokenizer, pick_mask_token, target_identity

    from transformers import AutoConfig

    spec, source = anchor_spec(cfg, manifest)
    hc = AutoConfig.from_pretrained(cfg.target)
    tok = load_tokenizer(cfg.target)
    mask_id = pick_mask_token(tok, int(hc.vocab_size), cfg.mask_token_id)
    ids = list(cfg.target_layer_ids) or None
    dcfg = DrafterConfig.from_target_config(hc, cfg.draft_layers, spec.block_size, mask_id, target_layer_ids=ids,
                                            sliding_window=cfg.sliding_window)
    target = FrozenTarget(cfg.target, dcfg.target_layer_ids, device=device)
    drafter = Drafter(dcfg).to(device)
    gamma = cfg.gamma or default_gamma(spec.block_size)
    obj = DFlashObjective(drafter, target, cfg, anchor_spec=spec, gamma=gamma,
                          identity=target_identity(cfg.target, tok))
    obj.anchor_source = source
    return obj


def anchor_spec(cfg: TrainConfig, manifest=None):
    """``(AnchorSpec, where the seed came from)``: a ``pack --objective dflash`` manifest's anchor
    options (its header's ``dflash``) win; a flag that contradicts them is refused, since the
    manifest's anchor budgets and digest assume them. Otherwise the flags, with defaults B = 16,
    512 anchors, ``cap``, and ``--anchor-seed`` or else ``--seed``."""
    from dflash_prep.anchors import SAMPLER_VERSION

    from .objective_dflash import AnchorSpec

    header = getattr(manifest, "header", None) if manifest is not None else None
    d = header.get("dflash") if isinstance(header, dict) else None
    if d is None:
        seed = cfg.anchor_seed if cfg.anchor_seed >= 0 else cfg.seed
        where = "--anchor-seed" if cfg.anchor_seed >= 0 else "--seed (the manifests are not pack --objective dflash)"
        return AnchorSpec(seed=seed, max_anchors=cfg.max_anchors or 512, policy=cfg.anchor_policy or "cap",
                          block_size=cfg.block_size or 16), where
    if int(d.get("sampler_version", -1)) != SAMPLER_VERSION:
        raise ConfigError(f"manifest epoch {manifest.epoch} was packed with anchor sampler v{d.get('sampler_version')}, "
                          f"this trainer draws with v{SAMPLER_VERSION}; re-pack it (`dflash-prep pack ... --overwrite`)")
    for flag, mine, theirs in (("--block-size", cfg.block_size, int(d["block_size"])),
                               ("--max-anchors", cfg.max_anchors, int(d["max_anchors"])),
                               ("--anchor-policy", cfg.anchor_policy, d["anchor_policy"]),
                               ("--anchor-seed", cfg.anchor_seed if cfg.anchor_seed >= 0 else None,
                                int(d["anchor_seed"]))):
        if mine and mine != theirs:
            raise ConfigError(f"{flag} {mine} contradicts the manifest, packed with {theirs} (pack --objective "
                              f"dflash); drop {flag} or re-pack with it")
    return AnchorSpec(seed=int(d["anchor_seed"]), max_anchors=int(d["max_anchors"]), policy=d["anchor_policy"],
                      block_size=int(d["block_size"])), "the manifest"
