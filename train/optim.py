"""The optimizer: ``--optimizer adamw | muon``, one object the loop and the checkpoint see.

- ``adamw``: AdamW; decoupled weight decay on matrices and embeddings only (not RMSNorm gains
  or biases).
- ``muon``: ``torch.optim.Muon`` (momentum 0.95, Nesterov, 5 Newton-Schulz steps, its
  ``match_rms_adamw`` LR adjustment, so an update's RMS is ``0.2 * lr``) on the 2-D weight
  matrices with both sides > 1, every projection and the drafter's ``fc`` included, weight
  decay ``--weight-decay``; AdamW (no decay) on the rest: norm gains and biases, and any
  embedding or output head (names holding ``embed``, ``lm_head`` or ``head``; the DFlash
  drafter has none: the target's are frozen). That is the split of vllm-project/speculators
  (``split_named_params_for_muon``, its default since #746 and in the RFC #979 recipe), which
  also keeps ``fc`` on Muon. Muon's peak LR is ``--muon-lr`` (0 = 10 x ``--lr``, speculators'
  rule).

:class:`MuonAdamW` holds both: ``param_groups`` lists the Muon groups then the AdamW ones,
``state_dict`` is ``{"muon": ..., "adamw": ...}``. Every group carries ``lr_scale`` (its peak
over ``--lr``); the loop sets ``lr = schedule(step) * lr_scale``, so the warmup + cosine
schedule drives both. Both are deterministic on CPU (matmuls and elementwise ops), so resume is
bitwise (``tests/train/test_optim.py``).
"""

from __future__ import annotations

import torch

from dflash_prep.errors import ConfigError, FormatError

_HEAD_HINTS = ("embed", "lm_head", "head")


def muon_split(model: torch.nn.Module) -> tuple[list, list]:
    """``(muon_params, adamw_params)`` of the trainable parameters (module docstring), in module order."""
    muon, rest = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        leaf = name.split(".")[-2] if "." in name else name
        if p.dim() == 2 and min(p.shape) > 1 and not any(h in leaf for h in _HEAD_HINTS):
            muon.append(p)
        else:
            rest.append(p)
    return muon, rest


class MuonAdamW:
    """Muon on the matrices, AdamW on the rest, stepped together (module docstring)."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer):
        self.muon, self.adamw = muon, adamw

    @property
    def param_groups(self) -> list[dict]:
        return self.muon.param_groups + self.adamw.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or set(state) != {"muon", "adamw"}:
            raise FormatError("the checkpoint's optimizer state is not a Muon + AdamW state; it was trained with "
                              "another --optimizer: pass that one, or --from-scratch")
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


def muon_lr(cfg) -> float:
    """Muon's peak LR: ``--muon-lr``, or 10 x ``--lr`` when it is 0."""
    return cfg.muon_lr or 10.0 * cfg.lr


def build_optimizer(model: torch.nn.Module, cfg):
    """The optimizer ``cfg.optimizer`` names, over ``model``'s trainable parameters (module docstring)."""
    if cfg.optimizer == "muon":
        mats, rest = muon_split(model)
        if not mats or not rest:
            raise ConfigError(f"--optimizer muon needs 2-D weight matrices and other parameters; this model has "
                              f"{len(mats)} and {len(rest)}: use --optimizer adamw")
        peak = muon_lr(cfg)
        muon = torch.optim.Muon([{"params": mats, "lr_scale": peak / cfg.lr}], lr=peak,
                                weight_decay=cfg.weight_decay, momentum=0.95, nesterov=True, ns_steps=5,
                                adjust_lr_fn="match_rms_adamw")
        adamw = torch.optim.AdamW([{"params": rest, "weight_decay": 0.0, "lr_scale": 1.0}], lr=cfg.lr,
                                  betas=cfg.betas, eps=1e-8, foreach=False)
        return MuonAdamW(muon, adamw)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=1e-8, foreach=False)
