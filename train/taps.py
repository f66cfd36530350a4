"""Taps providers: where a drafter rank's target hidden states come from.

The DFlash loss needs three things of the frozen target: the taps of a micro-batch (the
concatenated hidden states of the tapped layers, ``[T, k*H]``), ``embed_tokens`` (to embed
the blocks) and ``lm_head`` (the CE). A provider has exactly those members, so the objective
does not ask where the target runs:

- :class:`LocalTaps`: colocated, the rank's own :class:`~.target.FrozenTarget`;
- :class:`RemoteTaps`: a split job (:mod:`.roles`), the taps come from the target rank serving
  this drafter (:class:`~.target_link.TapsReceiver`), checked against the drafter's own manifest
  row; the rank holds only the target's embedding and LM head (:func:`load_heads`).

Both are called as ``provider.taps(batch, epoch=e)`` in manifest order. The target rank runs
:class:`LocalTaps` too (:mod:`.target_worker`), so a split job's taps are those of the same
function over the same batch: bit-identical on CPU in fp32.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash_prep.errors import ConfigError, FormatError

from .target_link import TapsReceiver, Tag


class LocalTaps:
    """Taps from a :class:`~.target.FrozenTarget` in this process."""

    def __init__(self, target):
        self.target = target
        self.embed_tokens, self.lm_head = target.embed_tokens, target.lm_head

    def taps(self, b, *, epoch: int) -> torch.Tensor:
        """``[T, k*H]`` taps of micro-batch ``b`` (a :class:`~.objective_dflash.DFlashBatch` on the target's device)."""
        return self.target.features(b.input_ids, b.position_ids, b.cu_seqlens, b.max_seqlen)


class RemoteTaps:
    """Taps received from a target rank; ``embed_tokens``/``lm_head`` loaded here (:func:`load_heads`)."""

    def __init__(self, receiver: TapsReceiver, embed_tokens: torch.nn.Module, lm_head: torch.nn.Module, *,
                 device: torch.device):
        self.receiver, self.embed_tokens, self.lm_head, self.device = receiver, embed_tokens, lm_head, device

    def taps(self, b, *, epoch: int) -> torch.Tensor:
        """The next message's taps; its tag must be ``b``'s row (epoch, step, accum, sample ids)."""
        want = Tag.of(epoch, b.step, b.accum, b.sample_ids)
        got = self.receiver.recv(want)
        T = int(b.input_ids.shape[0])
        if len(got) != 1 or got[0].dim() != 2 or got[0].shape[0] != T:
            raise FormatError(f"{self.receiver.me}: {self.receiver.peer} sent {[tuple(t.shape) for t in got]} for "
                              f"{want}, expected one [{T}, k*H] taps tensor; run every rank with the same target "
                              "and dflash-prep")
        return got[0].to(self.device, non_blocking=True)


def _weights_file(path: Path, key: str) -> Path:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        wm = json.loads(index.read_text()).get("weight_map", {})
        if key not in wm:
            raise FormatError(f"{index}: no {key} in weight_map; the target is not a Llama-style causal LM")
        return path / wm[key]
    single = path / "model.safetensors"
    if not single.is_file():
        raise ConfigError(f"{path}: target ranks need safetensors weights (model.safetensors or its index); "
                          "re-save the target with save_pretrained(safe_serialization=True)")
    return single


def load_heads(path: str | Path, *, device: torch.device, dtype: torch.dtype | None = None):
    """``(embed_tokens, lm_head)`` of the target folder, frozen, without loading its layers.

    Reads ``model.embed_tokens.weight`` and ``lm_head.weight`` (the embedding when
    ``tie_word_embeddings``) from the safetensors files; bf16 on CUDA, fp32 on CPU by default,
    as :class:`~.target.FrozenTarget` loads them.
    """
    from safetensors import safe_open

    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{path}: not a transformers model folder (no config.json); pass the target's folder")
    cfg = json.loads(cfg_file.read_text())
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tied = bool(cfg.get("tie_word_embeddings"))
    keys = {"embed": "model.embed_tokens.weight"} if tied else {"embed": "model.embed_tokens.weight",
                                                                 "head": "lm_head.weight"}
    got = {}
    for name, key in keys.items():
        f = _weights_file(path, key)
        with safe_open(str(f), "pt") as fh:
            if key not in fh.keys():
                raise FormatError(f"{f}: no tensor {key}; the target is not a Llama-style causal LM")
            got[name] = fh.get_tensor(key).to(device=device, dtype=dtype)
    V, H = got["embed"].shape
    embed = torch.nn.Embedding(V, H, device=device, dtype=dtype)
    head = torch.nn.Linear(H, V, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        embed.weight.copy_(got["embed"])
        if tied:
            head.weight = embed.weight   # one tensor, as in the target
        else:
            head = torch.nn.Linear(H, got["head"].shape[0], bias=False, device=device, dtype=dtype)
            head.weight.copy_(got["head"])
    for m in (embed, head):
        m.requires_grad_(False)
    return embed, head


def remote_taps(place, target: str | Path, *, timeout: float, device: torch.device) -> RemoteTaps:
    """The :class:`RemoteTaps` of a drafter rank's :class:`~.roles.Place`: taps from its target
    rank (over NCCL on CUDA, so the link's tensors live on ``device``; else CPU), heads from ``target``."""
    if place.is_target:
        raise ValueError(f"global rank {place.rank} is a target rank; only drafter ranks receive taps")
    link_device = device if device.type == "cuda" else torch.device("cpu")
    i = place.dist.rank
    recv = TapsReceiver(place.target, timeout=timeout, me=f"drafter rank {i}", peer=f"target rank {place.target}",
                        device=link_device)
    embed, head = load_heads(target, device=device)
    return RemoteTaps(recv, embed, head, device=device)
