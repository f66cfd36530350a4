"""Taps providers: where a drafter rank's target hidden states come from.

The DFlash loss needs three things of the frozen target: the taps of a micro-batch (the
concatenated hidden states of the tapped layers, ``[T, k*H]``), ``embed_tokens`` (to embed
the blocks) and ``lm_head`` (the CE). A provider has exactly those members, so the objective
does not ask where the target runs:

- :class:`LocalTaps`: colocated, the rank's own :class:`~.target.FrozenTarget`;
- :class:`RemoteTaps`: a split job (:mod:`dflash_prep.train.split.roles`), the taps come from the target rank serving
  this drafter (:class:`~dflash_prep.train.split.link.TapsReceiver`), checked against the drafter's own manifest
  row; the rank holds only the target's embedding and LM head (:func:`load_heads`);
- :class:`~dflash_prep.train.cached_taps.CachedTaps`: ``--target-engine vllm``, the states read from a cache
  ``dflash-prep extract`` built once with vLLM; the heads loaded as a split job's drafter loads them.

:func:`dflash_prep.train.target.target_provider` picks one for a run.

Both are called as ``provider.taps(batch, epoch=e)`` in manifest order. The target rank runs
:class:`LocalTaps` too (:mod:`dflash_prep.train.split.worker`), so a split job's taps are those of the same
function over the same batch: bit-identical on CPU in fp32.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from dflash_prep.errors import ConfigError, FormatError

from dflash_prep.train.split.link import TapsReceiver, Tag, link_device


class LocalTaps:
    """Taps from a :class:`~.target.FrozenTarget` in this process."""

    remote = False

    def __init__(self, target):
        self.target = target
        self.embed_tokens, self.lm_head = target.embed_tokens, target.lm_head
        self.num_layers = target.num_layers

    def taps(self, b, *, epoch: int, final: bool = False):
        """``[T, k*H]`` taps of micro-batch ``b`` (a :class:`~dflash_prep.train.objectives.dflash.objective.DFlashBatch` on the
        target's device); with ``final`` also the final-normed last hidden states ``[T, H]`` (``--loss kl``)."""
        return self.target.features(b.input_ids, b.position_ids, b.cu_seqlens, b.max_seqlen, final=final)


    def contract(self) -> dict:
        """Nothing: where the target runs is not part of the run contract."""
        return {}


def provider_of(target):
    """A taps provider as is (anything with a ``taps(b, *, epoch, final)`` method: :class:`LocalTaps`,
    :class:`RemoteTaps`, :class:`~dflash_prep.train.cached_taps.CachedTaps`), a
    :class:`~.target.FrozenTarget` (whose ``taps`` are its layer ids) wrapped in :class:`LocalTaps`."""
    return target if callable(getattr(target, "taps", None)) else LocalTaps(target)


#: ``RemoteTaps.step_stats`` entries, in the order of the target rank's per-step stats message
STEP_STATS = ("target_busy_s", "target_wall_s", "target_send_s", "target_in_flight", "target_bytes_sent",
              "target_messages")


class RemoteTaps:
    """Taps received from a target rank; ``embed_tokens``/``lm_head`` loaded here (:func:`load_heads`)."""

    remote = True

    def __init__(self, receiver: TapsReceiver, embed_tokens: torch.nn.Module, lm_head: torch.nn.Module, *,
                 device: torch.device, target_config=None, roles=None, contract: dict | None = None):
        self.receiver, self.embed_tokens, self.lm_head, self.device = receiver, embed_tokens, lm_head, device
        self._contract = dict(contract or {})
        self.target_config, self.roles = target_config, roles
        self.num_layers = int(getattr(target_config, "num_hidden_layers", 0))
        self._wait0 = 0.0
        self._tot = {"busy": 0.0, "wall": 0.0, "wait": 0.0, "time": 0.0, "steps": 0}

    def taps(self, b, *, epoch: int, final: bool = False):
        """The next message's taps (and last hidden states with ``final``); its tag must be ``b``'s
        row (epoch, step, accum, sample ids)."""
        want = Tag.of(epoch, b.step, b.accum, b.sample_ids)
        got = self.receiver.recv(want)
        T, n = int(b.input_ids.shape[0]), 2 if final else 1
        if len(got) != n or any(t.dim() != 2 or t.shape[0] != T for t in got):
            raise FormatError(f"{self.receiver.me}: {self.receiver.peer} sent {[tuple(t.shape) for t in got]} for "
                              f"{want}, expected {n} [{T}, ...] tensor(s) (taps{', last hidden states' if final else ''});"
                              " run every rank with the same target, --loss and dflash-prep")
        got = [t.to(self.device, non_blocking=True) for t in got]
        return (got[0], got[1]) if final else got[0]

    def contract(self) -> dict:
        """Where the target runs is not part of the run contract; what it runs in is: the engine and
        its states dtype when the target ranks run it in one (``--target-engine``), as a colocated
        engine run records them, so a checkpoint moves between the two."""
        return dict(self._contract)

    def step_stats(self, epoch: int, step: int) -> dict:
        """The target rank's timing of ``(epoch, step)`` (:data:`STEP_STATS`), sent after the step's taps."""
        got = self.receiver.recv(step_tag(epoch, step))
        return dict(zip(STEP_STATS, got[0].double().tolist()))

    def log_fields(self, epoch: int, step: int, dt: float) -> dict:
        """A step's ``log.jsonl`` fields: this drafter rank's wait for taps and its target rank's stats.

        ``target_busy_frac``: the target rank's forward time / its step's wall time;
        ``drafter_wait_frac``: this rank's time blocked on the link / its step time (``dt`` plus
        the wait for the stats message itself); ``messages_in_flight``: the most messages the
        target rank had posted and not yet seen taken; ``bytes_sent``: what it sent this step, to
        every drafter rank it serves."""
        before = self.receiver.wait_s
        t = self.step_stats(epoch, step)
        wait = self.receiver.wait_s - self._wait0          # the step's taps and this message
        self._wait0 = self.receiver.wait_s
        span = dt + (self.receiver.wait_s - before)
        tot = self._tot
        tot["busy"] += t["target_busy_s"]
        tot["wall"] += t["target_wall_s"]
        tot["wait"] += wait
        tot["time"] += span
        tot["steps"] += 1
        return {"target_busy_frac": t["target_busy_s"] / t["target_wall_s"] if t["target_wall_s"] > 0 else 0.0,
                "drafter_wait_frac": wait / span if span > 0 else 0.0,
                "messages_in_flight": int(t["target_in_flight"]), "bytes_sent": int(t["target_bytes_sent"])}

    def summary(self) -> dict:
        """The run's split figures and its bottleneck (docs/target-ranks.md):

        the side that waits less is the bottleneck: the target ranks when the drafters' wait
        fraction exceeds the target's idle fraction ``1 - busy``, else the drafter ranks; the K
        for this ratio is ``clamp(ceil(K * busy_s / compute_s), 1, W)``, ``busy_s`` the target
        rank's forward time per step, ``compute_s`` the drafter's step time less its wait (the
        K at which one target rank's share of forwards takes as long as a drafter step)."""
        tot, K, W = self._tot, self.roles.target_ranks, self.roles.drafter_ranks
        if not tot["steps"]:
            return {}
        busy = tot["busy"] / tot["wall"] if tot["wall"] > 0 else 0.0
        wait = tot["wait"] / tot["time"] if tot["time"] > 0 else 0.0
        compute = max(tot["time"] - tot["wait"], 1e-9)
        return {"target_ranks": K, "drafter_ranks": W, "target_busy_frac": busy, "drafter_wait_frac": wait,
                "bottleneck": "target" if wait > 1.0 - busy else "drafter",
                "suggested_target_ranks": min(W, max(1, math.ceil(K * tot["busy"] / compute)))}


def step_tag(epoch: int, step: int) -> Tag:
    """The tag of a target rank's per-step stats message: micro-batch index -1, no sample ids."""
    return Tag.of(epoch, step, -1, [])


def weights_file(path: Path, key: str) -> Path:
    """The safetensors file of the target folder ``path`` that holds tensor ``key`` (its index's
    ``weight_map``, else the one ``model.safetensors``)."""
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
    # the modules' own init draws from torch's RNG: forked, so the drafter built after this
    # draws from the seed exactly as beside a FrozenTarget (whose load draws nothing)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        return _heads(path, keys, tied, device, dtype)


def _heads(path: Path, keys: dict, tied: bool, device: torch.device, dtype: torch.dtype):
    from safetensors import safe_open

    got = {}
    for name, key in keys.items():
        f = weights_file(path, key)
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


def remote_taps(place, target: str | Path, *, timeout: float, device: torch.device,
                contract: dict | None = None) -> RemoteTaps:
    """The :class:`RemoteTaps` of a drafter rank's :class:`~dflash_prep.train.split.roles.Place`: taps from its target
    rank (over NCCL on CUDA, so the link's tensors live on ``device``; else through the CPU,
    :func:`~dflash_prep.train.split.link.link_device`), heads from ``target``."""
    if place.is_target:
        raise ValueError(f"global rank {place.rank} is a target rank; only drafter ranks receive taps")
    i = place.dist.rank
    recv = TapsReceiver(place.target, timeout=timeout, me=f"drafter rank {i}", peer=f"target rank {place.target}",
                        device=link_device(device))
    embed, head = load_heads(target, device=device)
    from transformers import AutoConfig

    return RemoteTaps(recv, embed, head, device=device, target_config=AutoConfig.from_pretrained(target),
                      roles=place.roles, contract=contract)
