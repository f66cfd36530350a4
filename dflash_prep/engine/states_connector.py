"""A vLLM KV connector that hands each finished prompt's hidden states to ``dflash-prep states``.

Runs *inside* vLLM's engine (the engine venv, :mod:`dflash_prep.engine.env`): vLLM loads
it by ``kv_transfer_config = {"kv_connector": "StatesConnector", "kv_connector_module_path":
"dflash_prep.engine.states_connector", "kv_role": "kv_producer", "kv_connector_extra_config":
{"spool": DIR}}`` together with ``speculative_config = {"method": "extract_hidden_states",
"num_speculative_tokens": 1, "draft_model_config": {"hf_config":
{"eagle_aux_hidden_state_layer_ids": [...]}}}``.

What vLLM does with that speculative method: the target's forward collects the residual stream
``hidden_states + residual`` at every id in ``eagle_aux_hidden_state_layer_ids`` (id ``j`` = after
``j`` decoder layers: 0 is the embedding, ``j`` the output of layer ``j - 1``, ``L`` the last
layer's output *before* the final norm; the ids are sorted and de-duplicated), and a
cache-only "draft" layer writes them, stacked ``[tokens, k, H]``, into a KV-cache group of their
own (a ``HiddenStateCacheSpec`` whose block holds ``block_size`` tokens x k x H). Nothing here
computes anything: this connector only reads that group back when a request finishes.

Protocol, per request (the same seams as vLLM's example hidden-states connector, rewritten for
a host without an accelerator: no pinned memory, no CUDA streams or events; the copy is
synchronous, so a request is done the moment its file is renamed into place):

1. scheduler side, :meth:`StatesConnector.request_finished_all_groups`: the request's blocks of
   the hidden-state group and its prompt length are queued, and the blocks are kept from being
   freed (``True``);
2. the next step's :meth:`build_connector_meta` carries the queue to the worker;
3. worker side, :meth:`get_finished`: each queued request's ``[n, k, H]`` rows are gathered from
   the cache by slot (``block * block_size + offset``) and written to ``SPOOL/KEY.npy``
   (temp name, then rename), where KEY is the request's ``kv_transfer_params["states_key"]``
   (its request id when absent); the request is then reported finished, and vLLM frees its blocks.

The file is an ``.npy`` of the cache's own dtype; bf16 (which numpy lacks) is stored as its
``uint16`` bit pattern, and the name says so: ``KEY.bf16.npy``. With tensor parallelism every
rank holds the same hidden-state group (the residual stream is replicated), so only the
tensor-parallel rank 0 of the rank that holds the cache-only layer writes, and
:meth:`get_finished_count` tells vLLM to expect one report per request.

Prefix caching must be off (the caller turns it off): a prefix served from the cache would not
run through the forward that writes the states of its tokens.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vllm.config import get_layers_from_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole, SupportsHMA)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer
from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

SPOOL_KEY = "spool"
"""``kv_connector_extra_config`` key: the folder the states files go to."""
PARAM_KEY = "states_key"
"""``kv_transfer_params`` key of a request: the name of its states file (``KEY.npy``)."""


def spool_name(key: str, dtype: torch.dtype) -> str:
    """The file a request's states go to: ``KEY.npy``, ``KEY.bf16.npy`` for bf16 bit patterns."""
    return f"{key}.bf16.npy" if dtype == torch.bfloat16 else f"{key}.npy"


@dataclass
class _Save:
    req_id: str
    key: str
    n_tokens: int
    block_ids: list[int]


@dataclass
class StatesMetadata(KVConnectorMetadata):
    """Scheduler -> worker: the requests whose states are to be written this step."""

    saves: list[_Save] = field(default_factory=list)


class StatesConnector(KVConnectorBase_V1, SupportsHMA):
    """Writes each finished request's extracted hidden states to the spool folder (module docstring)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        spool = self._kv_transfer_config.get_from_extra_config(SPOOL_KEY, None)
        if not spool:
            raise ValueError(f"StatesConnector needs kv_connector_extra_config[{SPOOL_KEY!r}]: the folder the "
                             "states files go to")
        self.spool = Path(spool)
        spec = vllm_config.speculative_config
        if spec is None or spec.method != "extract_hidden_states":
            raise ValueError("StatesConnector reads what speculative method 'extract_hidden_states' caches; pass "
                             "speculative_config={'method': 'extract_hidden_states', ...}")
        self.group = _hidden_state_group(kv_cache_config)
        self._queued: dict[str, _Save] = {}          # scheduler side: finished, not yet sent to the worker
        self._cache: torch.Tensor | None = None      # worker side: [blocks, k, block_size, H]
        self._writer = False
        self._written: set[str] = set()              # written, not yet reported (not yet in finished_req_ids)
        self._finished: set[str] = set()             # reported finished by the scheduler, not yet written

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return 0, False                               # store only: nothing is ever loaded

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens:
            raise ValueError(f"StatesConnector loads nothing, yet {num_external_tokens} external tokens were allocated")

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = StatesMetadata(saves=list(self._queued.values()))
        self._queued.clear()
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        prompt = request.prompt_token_ids
        if prompt is None or not block_ids:
            return False, None                        # never scheduled, or prompt embeddings: nothing to write
        params = request.kv_transfer_params or {}
        key = str(params.get(PARAM_KEY, request.request_id))
        if "/" in key or key.startswith("."):
            raise ValueError(f"states_key {key!r} must be a plain file name")
        self._queued[request.request_id] = _Save(request.request_id, key, len(prompt), list(block_ids))
        return True, {PARAM_KEY: key}

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]):
        if not 0 <= self.group < len(block_ids):
            return False, None
        return self.request_finished(request, block_ids[self.group])

    def get_finished_count(self) -> int:
        return 1                                      # one writer per request (module docstring)

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches))
        if len(layers) > 1:
            raise ValueError(f"StatesConnector expects one hidden-states cache layer, found {sorted(layers)}")
        if not layers:                                 # a rank without the cache-only layer (pipeline stage)
            return
        cache = kv_caches[next(iter(layers))]
        if cache.dim() != 4:
            raise ValueError(f"StatesConnector: hidden-states cache of shape {tuple(cache.shape)}, expected "
                             "[blocks, k, block_size, H]")
        self._cache = cache
        self._writer = get_tensor_model_parallel_rank() == 0
        if self._writer:
            self.spool.mkdir(parents=True, exist_ok=True)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        pass                                          # the states are read back when the request finishes

    def wait_for_save(self) -> None:
        pass

    def get_finished(self, finished_req_ids: set[str]):
        if self._writer and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, StatesMetadata):
                for s in meta.saves:
                    self._write(s)
                    self._written.add(s.req_id)
        self._finished |= finished_req_ids
        done = self._written & self._finished         # a report must name an id vLLM gave us as finished
        self._written -= done
        self._finished -= done
        return (done or None), None

    def _write(self, s: _Save) -> None:
        cache = self._cache
        bs = cache.shape[2]
        blocks = torch.tensor(s.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * bs + torch.arange(bs, dtype=torch.long)[None, :]).flatten()[:s.n_tokens]
        if slots.numel() != s.n_tokens:
            raise ValueError(f"request {s.req_id}: {len(s.block_ids)} blocks of {bs} hold fewer than its "
                             f"{s.n_tokens} prompt tokens")
        rows = cache[slots // bs, :, slots % bs].to("cpu")                      # (n, k, H)
        arr = rows.view(torch.uint16).numpy() if rows.dtype == torch.bfloat16 else rows.numpy()
        final = self.spool / spool_name(s.key, rows.dtype)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.save(f, np.ascontiguousarray(arr), allow_pickle=False)
        os.replace(tmp, final)


def _hidden_state_group(kv_cache_config) -> int:
    """Index of the KV-cache group that holds the extracted hidden states (its spec's type)."""
    if kv_cache_config is None:
        return 0
    groups = kv_cache_config.kv_cache_groups
    ids = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
    if len(ids) == 1:
        return ids[0]
    if not ids and len(groups) == 1:
        return 0
    raise ValueError(f"StatesConnector: {len(ids)} hidden-states cache groups among {len(groups)}; expected one")
