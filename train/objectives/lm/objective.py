"""The LM objective: next-token cross-entropy over target tokens, normalised by the step's target
count (:mod:`dflash_prep.train.data`).

:class:`LMObjective` trains the small :class:`~dflash_prep.train.objectives.lm.model.Decoder`, or a
local transformers causal LM (``--init-from DIR``; packed documents through the varlen kernel,
saved with ``save_pretrained`` to ``OUT/hf`` with its tokenizer). Its head + CE run in chunks.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from dflash_prep.formats.target import load_tokenizer, target_identity
from dflash_prep.train.chunked_ce import weighted_ce
from dflash_prep.train.data import IGNORE, build_batch
from dflash_prep.train.source import tokenizer_field


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

    def __init__(self, model, cfg=None, *, hf: bool = False, tokenizer=None,
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
                from dflash_prep.train.target import packed_forward

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

    def head_shape(self) -> tuple[int, int]:
        """``(V, H)`` of the head the loss runs through (a CPU run's measured matmul, train/matmul_peak.py)."""
        head = self.model.get_output_embeddings() if self.hf else self.model.head
        return tuple(head.weight.shape)

    @staticmethod
    def targets(denom: float) -> int:
        return int(denom)

    def describe(self) -> str | None:
        return None

    def check_epoch(self, epoch: int, manifest) -> None:
        pass

    def log_fields(self, st: dict, dt: float) -> dict:
        return {}

    def run_summary(self, time_s: float) -> dict:
        return {}

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


def build_lm(cfg, ds, device: torch.device, manifest=None, place=None) -> LMObjective:
    """The small decoder, or ``--init-from`` a transformers causal LM."""
    init_from = cfg.options.init_from
    if init_from:
        from dflash_prep.train.target import load_causal_lm

        tok = load_tokenizer(init_from)
        model = load_causal_lm(init_from, device=device, dtype=torch.float32).train()
        ident = target_identity(init_from, tok)
        obj = LMObjective(model, cfg, hf=True, tokenizer=tok, contract={"init_from": ident["target_fingerprint"]})
    else:
        from dflash_prep.train.objectives.lm.model import Decoder

        model = Decoder(cfg.model_config(int(tokenizer_field(ds, "vocab_size", 0)))).to(device)
        obj = LMObjective(model, cfg)
    obj.pad_id = int(tokenizer_field(ds, "pad_id", 0))
    return obj
