"""What a run trains and how one micro-batch becomes a loss: the trainer side of an objective.

Objectives are registered by name (:func:`register_trainer`; the data side of the same name is
in :mod:`dflash_prep.objectives`): ``lm`` here, ``dflash`` in :mod:`dflash_prep.train.objectives.dflash.objective`.
The training loop (:mod:`dflash_prep.train.loop`) is objective-agnostic: it builds the one
``cfg.objective`` names (:func:`build_objective`) and asks it for

- ``model``: the trainable module (optimizer, checkpoint, gradient all-reduce);
- ``build(ds, mb, epoch, pin)``: one manifest micro-batch as tensors (run on the prefetch thread);
- ``denominator(batch)``: the batch's share of the step's loss normaliser (LM: target tokens;
  DFlash: the sum of block weights), all-reduced over ranks and accumulation before any backward;
  an objective with ``deferred_denominator`` (DFlash under D-PACE, whose weights come out of the
  forward) gives it after the forward instead, ``denominator_from(stats)`` of the all-reduced stats;
- ``loss(batch, autocast)``: ``(loss_sum, stats)``; the loop backpropagates ``loss_sum / N``
  and all-reduces ``stats`` (float64, ``stats_width`` entries) once per step;
- ``metrics(stats, N)``: the step's logged metrics; ``flops(batch)`` for MFU; ``targets(N)``:
  the normaliser as logged;
- ``describe()``: a line for the log at the start (or None); ``check_epoch(epoch, manifest)``:
  refuse an epoch packed otherwise; ``log_fields(step, dt)``: its own entries of a step's
  log record; ``run_summary(time_s)``: its own entries of ``summary.json``;
- ``contract()``: what besides the data plan fixes the run (resume refuses a change, naming it);
- ``model_config()``: the module's shape (resume refuses a change); ``finish(out)``: final exports.

:class:`LMObjective` trains the small :class:`~dflash_prep.train.objectives.lm.model.Decoder`, or a local
transformers causal LM (``--init-from DIR``; packed documents through the varlen kernel, saved
with ``save_pretrained`` to ``OUT/hf`` with its tokenizer). Its head + CE run in chunks.
:class:`~dflash_prep.train.objectives.dflash.objective.DFlashObjective` trains a drafter on a frozen target.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from dflash_prep.errors import ConfigError

from dflash_prep.train.objectives.dflash import objective as objective_dflash
from dflash_prep.train.split import worker as target_worker
from dflash_prep.train.chunked_ce import weighted_ce
from dflash_prep.train.config import TrainConfig
from dflash_prep.train.data import IGNORE, build_batch
from dflash_prep.train.source import tokenizer_field

#: trainer-side builders by objective name: ``builder(cfg, ds, device, manifest) -> objective``
_TRAINERS: dict = {}
#: target-rank entry points of the objectives that train on a frozen target (``--target-ranks``)
_SERVERS: dict = {}


def register_trainer(name: str, builder, serve=None) -> None:
    """Make ``--objective NAME`` build its trainer objective with ``builder`` (after seeding torch).

    ``serve(cfg, place, dist, source) -> summary`` runs a split job's target rank (:mod:`dflash_prep.train.split`); an
    objective with one also takes ``builder(..., place=place)`` on the drafter ranks."""
    _TRAINERS[name] = builder
    if serve is not None:
        _SERVERS[name] = serve


def _check_split(cfg: TrainConfig) -> None:
    if cfg.objective not in _SERVERS:
        raise ConfigError(f"--target-ranks {cfg.target_ranks}: --objective {cfg.objective} has no frozen target to "
                          f"put on its own ranks; drop --target-ranks or use --objective {' / '.join(_SERVERS)}")


def build_objective(cfg: TrainConfig, ds, device: torch.device, manifest=None, place=None):
    """The objective ``cfg`` asks for, its module on ``device`` (seeded with ``cfg.seed``); ``place``:
    a split job's drafter rank (:mod:`dflash_prep.train.split`), whose objective gets its target's output from a target rank."""
    if cfg.objective not in _TRAINERS:
        raise ConfigError(f"--objective must be one of {', '.join(_TRAINERS)}, got {cfg.objective!r}")
    torch.manual_seed(cfg.seed)
    if place is None:
        return _TRAINERS[cfg.objective](cfg, ds, device, manifest)
    _check_split(cfg)
    return _TRAINERS[cfg.objective](cfg, ds, device, manifest, place=place)


def serve_target(cfg: TrainConfig, place, d, source=None) -> dict:
    """Run a split job's target rank for ``cfg.objective`` (:mod:`dflash_prep.train.split`) over ``source`` (None:
    the files ``cfg`` names); returns its summary."""
    _check_split(cfg)
    return _SERVERS[cfg.objective](cfg, place, d, source)


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


def build_lm(cfg: TrainConfig, ds, device: torch.device, manifest=None) -> LMObjective:
    """The small decoder, or ``--init-from`` a transformers causal LM."""
    if cfg.init_from:
        from dflash_prep.train.target import load_causal_lm, load_tokenizer, target_identity

        tok = load_tokenizer(cfg.init_from)
        model = load_causal_lm(cfg.init_from, device=device, dtype=torch.float32).train()
        ident = target_identity(cfg.init_from, tok)
        obj = LMObjective(model, cfg, hf=True, tokenizer=tok, contract={"init_from": ident["target_fingerprint"]})
    else:
        from dflash_prep.train.objectives.lm.model import Decoder

        model = Decoder(cfg.model_config(int(tokenizer_field(ds, "vocab_size", 0)))).to(device)
        obj = LMObjective(model, cfg)
    obj.pad_id = int(tokenizer_field(ds, "pad_id", 0))
    return obj


register_trainer("lm", build_lm)
register_trainer("dflash", objective_dflash.build, serve=target_worker.serve)
