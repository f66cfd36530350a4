"""``--init-layers target``: the draft layers start as copies of the target's own last layers.

A DFlash draft layer has the shape of one target decoder layer (:meth:`DrafterConfig.from_target_config`:
same hidden size, heads, head_dim and MLP width), and the drafter ends in the target's frozen head. So
the target's last N layers (and its final norm) are a starting point that already maps a residual
stream to next-token logits, where the random init (N(0, 0.02)) starts from nothing:

    draft layer i            <- target layer L - N + i   (q/k/v/o projections, their biases where the
                                                          target has them, gate/up/down, both norms)
    norm                     <- the target's final norm   (model.norm)
    fc (k*H -> H)            <- [I/k ... I/k]             (the mean of the k tapped states, which the
                                                          copied layers read as a residual stream)
    q_norm, k_norm           kept at 1 where the target has none (Llama, Mistral); copied where it has
                             them (Qwen3). With unit gains a Llama layer's attention logits are rescaled
                             per head, so the copy is a starting point, not the target's function.
    hidden_norm              kept at 1

The block's mask slots still start as the target's embedding of the mask id. Whether this moves tau
per CPU-hour, and by how much, is measured, not assumed: docs/real-target.md#what-moves-tau.
Only the drafter's starting weights change: nothing draws from torch's RNG here, so the data order,
the anchors and a resumed run's state are those of a random-init run.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_prep.errors import FormatError
from dflash_prep.train.split.taps import weights_file

_LAYER_TENSORS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                  "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                  "input_layernorm.weight", "post_attention_layernorm.weight")
_OPTIONAL = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias", "self_attn.o_proj.bias",
             "self_attn.q_norm.weight", "self_attn.k_norm.weight")


def source_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The target layer each draft layer is copied from: the last N, in order."""
    return list(range(num_target_layers - num_draft_layers, num_target_layers))


def copy_target_layers(drafter: torch.nn.Module, target: str | Path) -> str:
    """Overwrite ``drafter``'s layers, final norm and ``fc`` with the target's (module docstring),
    in place; one line saying what was copied. Refuses a tensor whose shape differs."""
    from safetensors import safe_open

    target = Path(target)
    c = drafter.config
    src = source_layers(c.num_target_layers, c.num_layers)
    pairs = {f"layers.{i}.{t}": f"model.layers.{l}.{t}" for i, l in enumerate(src) for t in _LAYER_TENSORS}
    optional = {f"layers.{i}.{t}": f"model.layers.{l}.{t}" for i, l in enumerate(src) for t in _OPTIONAL}
    pairs["norm.weight"] = "model.norm.weight"
    own = dict(drafter.named_parameters())
    copied = 0
    with torch.no_grad():
        for mine, theirs in [*pairs.items(), *optional.items()]:
            f = weights_file(target, theirs) if mine in pairs else _optional_file(target, theirs)
            if f is None or mine not in own:
                continue
            with safe_open(str(f), "pt") as fh:
                if theirs not in fh.keys():
                    if mine in pairs:
                        raise FormatError(f"{f}: no tensor {theirs}; --init-layers target needs a Llama-style "
                                          "target (model.layers.N.self_attn.q_proj.weight, ...)")
                    continue
                w = fh.get_tensor(theirs)
            p = own[mine]
            if tuple(w.shape) != tuple(p.shape):
                raise FormatError(f"--init-layers target: the target's {theirs} is {tuple(w.shape)}, the drafter's "
                                  f"{mine} is {tuple(p.shape)}")
            p.copy_(w.to(dtype=p.dtype, device=p.device))
            copied += 1
        k, H = c.num_taps, c.hidden
        eye = torch.eye(H, dtype=drafter.fc.weight.dtype, device=drafter.fc.weight.device) / k
        drafter.fc.weight.copy_(eye.repeat(1, k))   # (H, k*H): the mean of the taps
    return (f"draft layers {list(range(c.num_layers))} start as the target's layers {src} and its final norm "
            f"({copied} tensors), fc as the mean of the {k} tap(s) (--init-layers target)")


def _optional_file(target: Path, key: str) -> Path | None:
    try:
        return weights_file(target, key)
    except FormatError:   # a sharded target's index names no such tensor: the target has none
        return None
