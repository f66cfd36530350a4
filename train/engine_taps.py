"""The fourth taps provider: the target in vLLM beside this drafter rank, online, with no cache.

``--target-engine vllm`` without ``--states``: each drafter rank starts the target in vLLM (the
engine's own process, its tensor or pipeline parallelism vLLM's: ``--engine-arg
tensor_parallel_size=2``) and asks it for each micro-batch's states in manifest order
(:class:`dflash_prep.engine.states_stream.StatesStream`). Nothing goes to disk, and every epoch
runs the target again: the trade against a cache is in docs/states.md#online-or-cached.

:class:`EngineTaps` is :class:`~.cached_taps.CachedTaps` with the reads replaced: the engine's rows
are the ones a cache of ``--states-dtype`` stores, decoded by the same code, in the same order, and
read ahead on the prefetch thread the same way (the engine runs up to ``--prefetch`` steps ahead of
the step loop). So everything the cache gives holds here (exactly once, exact resume, any world
size; the run contract is the same, so a checkpoint moves between the two), and a run equals one
trained from a cache built with ``--batch-tokens 1`` bit for bit when this one runs with
``--engine-tokens 1`` (:mod:`dflash_prep.engine.states_stream`: vLLM's CPU kernels are not
batch-invariant).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from dflash_prep import objectives
from dflash_prep.engine.extract import ExtractConfig, parse_engine_args
from dflash_prep.engine.states_stream import StatesStream
from dflash_prep.errors import DflashError, FormatError
from dflash_prep.formats import manifest as manifest_mod
from dflash_prep.formats.states import check_finite
from dflash_prep.formats.target import read_target_config
from dflash_prep.train.cached_taps import CachedTaps, _decode


class EngineTaps(CachedTaps):
    """Taps from a :class:`~dflash_prep.engine.states_stream.StatesStream` (module docstring)."""

    def __init__(self, stream, ds, taps, **kw):
        super().__init__(stream, taps, **kw)
        self.ds = ds

    def _read(self, sids, lens, cols) -> torch.Tensor:
        docs = []
        for sid, n in zip(sids, lens):
            ids = np.asarray(self.ds.sample(int(sid))[0])
            if len(ids) != n:
                raise FormatError(f"sample {int(sid)} has {len(ids)} tokens in the dataset, the micro-batch {n}")
            docs.append(ids)
        rows, scales = self.cache.states(docs)
        check_finite(rows, scales, self.cache.key.dtype, np.concatenate([[0], np.cumsum(lens)]), sids,
                     self.cache.folder, then="the run stops before training on it")
        return _decode(rows, scales, cols, self.cache.key.dtype)

    def summary(self) -> dict:
        return super().summary() | {"target_engine": self.cache.summary()}

    def close(self) -> None:
        self.cache.close()


def engine_devices(device: torch.device, engine_args: dict, visible: str | None = None,
                   gpus: tuple[int, ...] | None = None) -> dict:
    """The engine's ``CUDA_VISIBLE_DEVICES``: a split job's target rank gives its engine ``gpus``
    (:mod:`dflash_prep.train.split.gpus`: any number); a drafter rank on ``cuda:i`` gives its
    engine the same GPU (vLLM would otherwise take the first visible one on every rank), unless
    the engine is parallel (``tensor_parallel_size`` or ``pipeline_parallel_size`` > 1: the user
    places it, with ``CUDA_VISIBLE_DEVICES`` set for the job). ``visible``: the job's own list
    (default: the environment's)."""
    from dflash_prep.train.split.gpus import engine_degree, engine_visible

    if device.type != "cuda":
        return {}
    if gpus:
        return {"CUDA_VISIBLE_DEVICES": engine_visible(tuple(gpus), visible)}
    if engine_degree(engine_args) > 1:
        return {}
    i = torch.cuda.current_device() if device.index is None else int(device.index)
    return {"CUDA_VISIBLE_DEVICES": engine_visible((i,), visible)}


def largest_microbatch(manifests: str | os.PathLike | None) -> tuple[int, int] | None:
    """``(tokens, longest document)`` of the largest micro-batch (real tokens: what the engine is
    sent) over the run's packed epochs, for the transport's space check
    (:func:`dflash_prep.engine.states_stream.scratch_folder`); None when there are no manifests to
    read (a run on an in-memory source). Epochs packed later share the plan's budget."""
    if not manifests:
        return None
    try:
        epochs = manifest_mod.find_epochs(manifests)
    except DflashError:
        return None
    tokens = longest = 0
    for e in epochs:
        m = manifest_mod.open(e, check_hashes=False)      # the loader checks them
        tokens = max(tokens, int(m.table[:, manifest_mod.COL["real_tokens"]].max(initial=0)))
        longest = max(longest, int(np.asarray(m.sample_lens).max(initial=0)))
    return tokens, longest


def engine_taps(cfg, ds, layer_ids, *, final: bool, identity: dict, device: torch.device, rank: int,
                heads: bool = True, gpus: tuple[int, ...] | None = None) -> EngineTaps:
    """The provider of ``--target-engine vllm`` without ``--states`` (:mod:`dflash_prep.train.engines.vllm`;
    any engine's: ``cfg.target_engine`` names its backend): this rank's engine started,
    capturing the run's taps (and the final state when it reads it), in ``--states-dtype``.
    ``heads=False``: a split job's target rank (:func:`dflash_prep.train.split.worker.serve`), which
    sends the taps and loads no embedding or LM head; its taps come out in the dtype the drafters'
    heads have (:func:`~dflash_prep.train.split.taps.load_heads`), so they receive what this
    provider gives a colocated rank, bit for bit; ``gpus``: its engine's GPUs (torch indices), on CUDA."""
    from dflash_prep.train.split.taps import load_heads

    o = cfg.options
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if heads:
        embed, head = load_heads(o.target, device=device)  # before the engine: a bad target fails in seconds
    else:
        embed = head = None
        read_target_config(o.target)                        # a bad target still fails in seconds
    chosen = objectives.get(cfg.objective).fixed_states is None    # the final state is there under --loss kl
    xc = ExtractConfig(data=Path(cfg.data), target=Path(o.target), out=out, objective=cfg.objective,
                       target_layer_ids=tuple(sorted(set(int(t) for t in layer_ids))),
                       loss="kl" if final and chosen else "ce", dtype=cfg.states_dtype,
                       batch_tokens=cfg.engine_tokens, engine_args=parse_engine_args(cfg.engine_args),
                       timeout_s=cfg.target_timeout, engine=cfg.target_engine)
    stream = StatesStream(xc, identity=identity, log=out / f"engine-rank{rank}.log", timeout_s=cfg.target_timeout,
                          env=engine_devices(device, dict(xc.engine_args), gpus=gpus), scratch=cfg.engine_scratch or None,
                          largest=largest_microbatch(cfg.manifests),
                          copies=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    dtype = None if heads else (torch.bfloat16 if device.type == "cuda" else torch.float32)   # load_heads' rule
    try:
        return EngineTaps(stream, ds, layer_ids, final=final, embed_tokens=embed, lm_head=head,
                          num_layers=stream.p["num_layers"], device=device, engine=cfg.target_engine, dtype=dtype)
    except BaseException:
        stream.close(ok=False)
        raise
