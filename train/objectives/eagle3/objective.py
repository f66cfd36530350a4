"""The EAGLE-3 objective: a one-layer drafter trained by training-time test on a frozen target.

Per micro-batch (documents packed back to back, ``cu_seqlens``; a ``pack --objective eagle3``
varlen manifest, whose ``eagle3`` section and ``d2t.npy``/``t2d.npy`` give the draft vocabulary):

1. **Target** (frozen, no grad): its hidden states at the three tapped layers ``[T, 3H]`` and its
   final-normed last hidden states ``[T, H]`` (:class:`~dflash_prep.train.target.FrozenTarget`,
   or a split job's target rank: the same message as DFlash's ``--loss kl``); its head turns the
   latter into the teacher distributions here, in row chunks.
2. **Drafter** (:class:`~.model.Eagle3Drafter`): ``S = --ttt-steps`` passes over every position;
   pass i feeds the data token ``x[t+1+i]`` and the previous pass's pre-norm output
   (:meth:`~.model.Eagle3Drafter.ttt_hidden`; the TTT attention is :func:`~.model.ttt_attention`).
3. **Loss**: pass i at row t predicts ``x[t+2+i]``: the soft cross-entropy against the target's
   next-token distribution at row ``t+1+i`` restricted to the draft vocabulary, weighted by
   ``decay**i`` x the loss mask of ``x[t+2+i]`` x whether the target's argmax is in the draft
   vocabulary. The weights are known after the forward, so the step's normaliser ``sum w`` is
   all-reduced then (``deferred_denominator``, as D-PACE's): the update is the same however the
   step is split over ranks and accumulation.
4. **Metrics**: per pass, accuracy (the draft argmax, as a target id, equals the target's argmax)
   over the loss-masked rows, and ``tau``: per row ``1 + sum_k prod_{i<=k} correct_i`` (a row whose
   later passes leave the document counts them as misses), averaged over rows with a pass-0 target.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dflash_prep.errors import ConfigError, FormatError
from dflash_prep.formats.target import load_target_config, load_tokenizer, target_identity
from dflash_prep.objectives import drafter_cost
from dflash_prep.objectives.eagle3 import vocab_map
from dflash_prep.objectives.target_taps import eagle3_taps
from dflash_prep.train.data import TensorBatch, read_documents
from dflash_prep.train.objectives.drafter import DrafterObjective
from dflash_prep.train.objectives.eagle3.model import Eagle3Config, Eagle3Drafter, shifted_ids, soft_ce


@dataclass
class Eagle3Batch(TensorBatch):
    """One EAGLE-3 micro-batch (CPU tensors; ``to`` moves them): documents ``input_ids`` /
    ``position_ids`` / ``loss_mask`` ``[T]`` (positions restart per document; the mask is 1 on the
    tokens the loss trains on), ``cu_seqlens`` int32 ``[D + 1]``."""

    step: int
    accum: int
    sample_ids: np.ndarray
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    real_tokens: int
    padded_tokens: int
    epoch: int = 0
    states: tuple | None = None
    """The target's states read ahead from a states cache (train/cached_taps.py), else None."""


def build_eagle3_batch(ds, mb, *, epoch: int, vocab_size: int, pin: bool = False) -> Eagle3Batch:
    """The documents of one manifest micro-batch, packed (any layout)."""
    d = read_documents(ds, mb, epoch=epoch, vocab_size=vocab_size)
    ids, pos, cu, mask = d.ids, d.pos, d.cu, d.mask.astype(np.float32)
    T = int(ids.shape[0])
    t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in dict(
        input_ids=ids, position_ids=pos, loss_mask=mask, cu_seqlens=cu.astype(np.int32)).items()}
    if pin:
        t = {k: v.pin_memory() for k, v in t.items()}
    return Eagle3Batch(step=int(mb.step), accum=int(mb.accum), sample_ids=d.sids, max_seqlen=int(d.lens.max()),
                       real_tokens=T, padded_tokens=T, epoch=int(epoch), **t)


def stats_width(steps: int) -> int:
    """loss, rows with a pass-0 target, tau sum, correct and counted per pass, sum w."""
    return 4 + 2 * steps


def eagle3_step_loss(drafter: Eagle3Drafter, target, b: Eagle3Batch, *, steps: int, decay: float,
                     chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum w * soft CE, stats float64 [stats_width(S)])`` of one micro-batch (module docstring).
    The target's head runs on ``chunk`` rows at a time (memory ~ chunk x V)."""
    feats, last = target.taps(b, epoch=b.epoch, final=True)                             # (T, 3H), (T, H)
    h = drafter.ttt_hidden(feats, b.input_ids, b.position_ids, b.cu_seqlens, b.max_seqlen, steps)  # (S, T, H)
    head = target.lm_head.weight                                                        # (V, H)
    ids = drafter.draft_target_ids()
    T = b.input_ids.shape[0]
    loss = h.new_zeros((), dtype=torch.float32)
    wsum = torch.zeros((), dtype=torch.float64, device=h.device)
    correct = torch.zeros(steps, T, dtype=torch.float64, device=h.device)
    counted = torch.zeros(steps, dtype=torch.float64, device=h.device)
    for i in range(steps):
        m = shifted_ids(b.loss_mask, b.cu_seqlens, 2 + i, pad_id=0)                     # (T,) mask of x[t+2+i]
        sel = m.nonzero().flatten()
        counted[i] = m.double().sum()
        for s in range(0, sel.shape[0], chunk):
            rows = sel[s:s + chunk]
            with torch.no_grad():
                teacher = last.index_select(0, rows + 1 + i) @ head.t()                  # (n, V)
            ce, hit, in_draft = soft_ce(drafter.logits(h[i].index_select(0, rows)), teacher, ids, drafter.t2d)
            w = m.index_select(0, rows) * in_draft
            loss = loss + (decay ** i) * (w * ce).sum()
            wsum = wsum + (decay ** i) * w.double().sum()
            correct[i, rows] = hit.double()
    first = shifted_ids(b.loss_mask, b.cu_seqlens, 2, pad_id=0) > 0                       # rows with a pass-0 target
    tau = (1.0 + torch.cumprod(correct, dim=0).sum(dim=0))[first].sum()
    stats = torch.cat([torch.stack([loss.detach().double(), first.double().sum(), tau]), correct.sum(1), counted,
                       wsum.reshape(1)])
    return loss, stats


class Eagle3Objective(DrafterObjective):
    """EAGLE-3 drafter training on a frozen target, behind the loop's protocol
    (:mod:`dflash_prep.train.objectives`)."""

    name = "eagle3"
    deferred_denominator = True
    log_keys = ("tau", "acc", "step_acc")

    def __init__(self, drafter: Eagle3Drafter, target, cfg, *, steps: int, identity: dict, vmap: dict):
        from dflash_prep.train.split.taps import provider_of

        super().__init__()
        self.model, self.target, self.cfg = drafter, provider_of(target), cfg
        self.steps, self.decay = int(steps), float(cfg.options.ttt_decay)
        self.identity, self.vmap = identity, vmap
        self.stats_width = stats_width(self.steps)
        c = drafter.config
        self._cost = drafter_cost.Eagle3CostModel(hidden=c.target_hidden, layers=self.target.num_layers,
                                                  intermediate=c.intermediate, heads=c.heads, kv_heads=c.kv_heads,
                                                  head_dim=c.head_dim, vocab=c.vocab_size,
                                                  draft_vocab=c.draft_vocab_size, ttt_steps=self.steps).coefficients()
        self._p = sum(p.numel() for p in drafter.parameters() if p.requires_grad)

    def build(self, ds, mb, epoch: int, layout: str, pin: bool):
        return build_eagle3_batch(ds, mb, epoch=epoch, vocab_size=self.model.config.vocab_size, pin=pin)

    @staticmethod
    def denominator(b) -> float:      # the weights come out of the forward (deferred_denominator)
        return 0.0

    def loss(self, b, autocast):
        with autocast():
            return eagle3_step_loss(self.model, self.target, b, steps=self.steps, decay=self.decay,
                                    chunk=self.cfg.ce_chunk)

    def metrics(self, stats: torch.Tensor, denom: float) -> dict:
        s, S = stats.tolist(), self.steps
        correct, counted = s[3:3 + S], s[3 + S:3 + 2 * S]
        return {"loss": s[0] / denom if denom > 0 else float("nan"), "rows": int(s[1]),
                "tau": s[2] / s[1] if s[1] else float("nan"),
                "step_acc": [c / n if n else None for c, n in zip(correct, counted)],
                "acc": correct[0] / counted[0] if counted[0] else float("nan")}

    def flops(self, b) -> float:
        docs = torch.diff(b.cu_seqlens.long()).double()
        return float(self._cost["tokens"] * b.real_tokens + self._cost["tokens_sq"] * float((docs * docs).sum()))

    def describe(self) -> str:
        cfg, c = self.cfg, self.model.config
        opt = self.optimizer_text()
        return (f"eagle3 recipe: {self.steps} TTT steps, decay {self.decay:g}, draft vocabulary {c.draft_vocab_size} "
                f"of {c.vocab_size} ({self.vmap['trained_ids']} trained ids), taps {list(c.target_layer_ids)}, "
                f"optimizer {opt}; target {cfg.options.target} ({self.target.num_layers} layers)")

    def check_epoch(self, epoch: int, manifest) -> None:
        """Every epoch carries the same vocabulary map and TTT steps as the first."""
        if epoch > 0:
            vm, steps = manifest_map(manifest)
            if vm.fingerprint != self.vmap["map_fingerprint"] or steps != self.steps:
                raise FormatError(f"epoch {epoch} manifest has another vocabulary map or --ttt-steps than epoch 0; "
                                  "pack every epoch with the same --draft-vocab-size and --ttt-steps")

    def contract(self) -> dict:
        c = self.model.config
        return {"objective": self.name, **self.identity, "target_layer_ids": list(c.target_layer_ids),
                "ttt_steps": self.steps, "ttt_decay": self.decay, **self.vmap, **self.target.contract()}

    def num_parameters(self) -> int:
        return self._p


def manifest_map(manifest) -> tuple["vocab_map.VocabMap", int]:
    """The vocabulary map and TTT steps of a ``pack --objective eagle3`` manifest (refused otherwise)."""
    header = getattr(manifest, "header", None) or {}
    if "eagle3" not in header:
        raise ConfigError(f"manifest epoch {getattr(manifest, 'epoch', '?')} was not packed with --objective eagle3: "
                          "an EAGLE-3 run needs its draft vocabulary map; pack with `dflash-prep pack ... "
                          "--objective eagle3 --target-config TARGET`")
    return vocab_map.load(manifest), int(header["eagle3"]["ttt_steps"])


def target_t2d(vm, vocab_size: int) -> torch.Tensor:
    """The map's ``t2d`` over the target's ``vocab_size`` embedding rows: the dataset's tokenizer
    may have fewer ids than the target's padded vocabulary (the rows past it are never drafted)."""
    t2d = np.asarray(vm.t2d, bool)
    if t2d.shape[0] > vocab_size:
        raise ConfigError(f"the vocabulary map covers {t2d.shape[0]} ids, the target has {vocab_size}: the dataset "
                          "was tokenized with another tokenizer; re-tokenize with the target's")
    return torch.from_numpy(np.concatenate([t2d, np.zeros(vocab_size - t2d.shape[0], bool)]))


def plan(cfg, manifest):
    """What an EAGLE-3 target rank serves (:func:`dflash_prep.train.split.worker.serve`): the same
    micro-batches, the three taps and the final hidden states."""
    hc = load_target_config(cfg.options.target)
    layer_ids = _layer_ids(cfg, hc)
    return (lambda ds, mb, epoch: build_eagle3_batch(ds, mb, epoch=epoch, vocab_size=int(hc.vocab_size))), \
        layer_ids, True


def _layer_ids(cfg, hc) -> tuple[int, ...]:
    """The three taps (:func:`dflash_prep.objectives.target_taps.eagle3_taps`)."""
    return eagle3_taps(int(hc.num_hidden_layers), cfg.options.target_layer_ids)


def build(cfg, ds, device: torch.device, manifest=None, place=None) -> Eagle3Objective:
    """The drafter for ``cfg.options.target`` with the manifest's vocabulary map; on a split job's
    drafter rank (``place``) its taps come from a target rank."""
    from dflash_prep.train.target import target_provider

    o = cfg.options
    vm, steps = manifest_map(manifest)
    if o.draft_vocab_size is not None and o.draft_vocab_size != vm.draft_vocab_size:
        raise ConfigError(f"--draft-vocab-size {o.draft_vocab_size} contradicts the manifest's map of "
                          f"{vm.draft_vocab_size}; drop it or re-pack with `--draft-vocab-size {o.draft_vocab_size}`")
    if o.ttt_steps is not None and o.ttt_steps != steps:
        raise ConfigError(f"--ttt-steps {o.ttt_steps} contradicts the manifest (packed for {steps} passes, its ranks "
                          f"balanced on that cost); drop it or re-pack with `--ttt-steps {o.ttt_steps}`")
    hc = load_target_config(o.target)
    ids = _layer_ids(cfg, hc)
    identity = target_identity(o.target, load_tokenizer(o.target))
    target = target_provider(cfg, ds, ids, final=True, identity=identity, device=device, place=place)
    dcfg = Eagle3Config.from_target_config(hc, vm.draft_vocab_size, target_layer_ids=ids)
    drafter = Eagle3Drafter(dcfg)
    drafter.set_vocab_map(torch.from_numpy(np.array(vm.d2t, np.int64)), target_t2d(vm, dcfg.vocab_size))
    with torch.no_grad():       # the target's embedding (frozen) and its head's rows of the draft vocabulary
        drafter.embed_tokens.weight.copy_(target.embed_tokens.weight.detach().to("cpu", torch.float32))
        head = target.lm_head.weight.detach().to("cpu", torch.float32)
        drafter.lm_head.weight.copy_(head[drafter.draft_target_ids()])
    section = manifest.header["eagle3"]
    vmap = {"draft_vocab_size": vm.draft_vocab_size, "map_fingerprint": vm.fingerprint,
            "trained_ids": int(section["trained_ids"])}
    return Eagle3Objective(drafter.to(device), target, cfg, steps=steps, identity=identity, vmap=vmap)


def export_checkpoint(obj: dict, path, out, *, dtype: str = "float32", overwrite: bool = False) -> dict:
    """The engines' EAGLE-3 folder from a loaded checkpoint (:mod:`dflash_prep.train.export`)."""
    from dflash_prep.train.objectives.dflash.export import file_fingerprint
    from dflash_prep.train.export import provenance
    from dflash_prep.train.objectives.eagle3.export import write_export

    try:
        cfg = Eagle3Config(**{**obj["model_config"], "target_layer_ids": tuple(obj["model_config"]["target_layer_ids"])})
    except TypeError as e:
        raise FormatError(f"{path}: the checkpoint's model_config is not an EAGLE-3 drafter's ({e})") from None
    drafter = Eagle3Drafter(cfg)
    missing = drafter.load_state_dict(obj["model"], strict=False)
    if missing.missing_keys or missing.unexpected_keys:
        raise FormatError(f"{path}: weights do not match the EAGLE-3 config (missing {missing.missing_keys[:5]}, "
                          f"unexpected {missing.unexpected_keys[:5]})")
    info = {"checkpoint": str(path), "checkpoint_fingerprint": file_fingerprint(path),
            "global_step": int(obj["cursor"].get("global_step", 0)), "run_key": obj["run_key"]}
    side = write_export(drafter, out, source=info, dtype=dtype, overwrite=overwrite, provenance=provenance(obj))
    return {**side, "summary": f"EAGLE-3, draft vocabulary {cfg.draft_vocab_size}, taps {list(cfg.target_layer_ids)}"}
