"""A target rank's loop: the taps of exactly its drafter ranks' micro-batches, in manifest order.

For each epoch from the cursor ``(epoch, step)``, for each step in manifest order, for each
served drafter rank (ascending), for each of that rank's accumulation micro-batches in
manifest order: build the micro-batch with the drafter's own builder (same function, same
sample ids, same anchors), run the frozen target over it (:class:`~dflash_prep.train.split.taps.LocalTaps`, the code
the colocated trainer runs) and send the taps with the row's tag (:mod:`dflash_prep.train.split.link`).
Nothing reorders: the builder runs ahead on one FIFO thread (:class:`~.data.Prefetcher`), and
the only other queue is the sender's bounded in-flight window per drafter rank. There is no
buffer to pick from and no readiness threshold.

With ``step_stats`` (the trainer's split jobs) each step ends with one more message per served
drafter: the step's :class:`StepTiming` (tag micro-batch -1, :func:`~dflash_prep.train.split.taps.step_tag`), which
the drafter logs. With ``final`` (``--loss kl``) a message carries the taps and the target's
final-normed last hidden states.

The loop stops after the last step of the last epoch, or after ``max_steps`` steps (the
drafters' ``--max-steps`` counted from the cursor), waits until every message is taken,
and returns one :class:`StepTiming` per step. On an error it tells its drafter ranks why
(:meth:`~dflash_prep.train.split.link.TapsSender.stop`) before raising.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterator, Sequence

import torch

from dflash_prep.errors import ConfigError
from dflash_prep.formats.target import target_identity

from dflash_prep.train.data import Prefetcher, iter_steps
from dflash_prep.train.split.roles import Roles
from dflash_prep.train.split.link import KIND_DATA, Tag, TapsSender, link_device
from dflash_prep.train.split.taps import step_tag


@dataclass
class StepTiming:
    """Where one step's time went on a target rank (for ``log.jsonl``)."""

    epoch: int
    step: int
    wall_s: float
    """From the end of the previous step to the end of this one."""
    busy_s: float
    """Target forwards: wall time on CPU, GPU time (CUDA events) on CUDA."""
    send_s: float
    """Posting sends and waiting for the in-flight window (the drafters' pace)."""
    build_wait_s: float
    """Waiting for the builder thread."""
    bytes_sent: int
    messages: int
    in_flight_max: int
    """Most messages posted and not yet seen taken (:meth:`~dflash_prep.train.split.link.TapsSender.in_flight`), after each post."""

    def to_dict(self) -> dict:
        return asdict(self)


class TargetWorker:
    """One target rank's loop (module docstring).

    ``source``: a :class:`~.source.FileSource` (or any object with ``dataset`` and
    ``manifest(epoch)``); ``provider``: a :class:`~dflash_prep.train.split.taps.LocalTaps`; ``build(mb, epoch)``: the
    drafter's micro-batch builder, returning a batch with ``to(device)``, ``step``, ``accum``
    and ``sample_ids``; ``autocast``: the context the colocated loss runs the target under.
    """

    def __init__(self, source, provider, sender: TapsSender, *, roles: Roles, target_rank: int,
                 build: Callable, device: torch.device, autocast=contextlib.nullcontext, build_ahead: int = 2,
                 final: bool = False, step_stats: bool = False):
        self.source, self.provider, self.sender, self.roles = source, provider, sender, roles
        self.served = roles.served(target_rank)
        self.dst = {i: roles.drafter_global(i) for i in self.served}
        missing = [g for g in self.dst.values() if g not in sender.peers]
        if missing:
            raise ValueError(f"the sender has no peer for global ranks {missing}")
        self.build, self.device, self.autocast, self.build_ahead = build, device, autocast, int(build_ahead)
        self.target_rank = int(target_rank)
        self.final, self.step_stats = bool(final), bool(step_stats)
        self.timings: list[StepTiming] = []

    def run(self, epochs: Sequence[int], *, start: tuple[int, int] = (0, 0),
            max_steps: int | None = None) -> list[StepTiming]:
        """Serve ``epochs`` from ``start`` ``(epoch, step)``, at most ``max_steps`` steps."""
        try:
            for epoch in [int(e) for e in epochs if int(e) >= start[0]]:
                left = None if max_steps is None else max_steps - len(self.timings)
                if left is not None and left <= 0:
                    break
                self._epoch(epoch, start[1] if epoch == start[0] else 0, left)
            self.sender.flush()
        except Exception as e:
            self.sender.stop(str(e).splitlines()[0] if str(e) else f"{type(e).__name__} on target rank {self.target_rank}")
            raise
        return self.timings

    def _steps(self, m, epoch: int, start_step: int) -> Iterator[tuple[int, list]]:
        """``(step, [(drafter rank, its micro-batches)])`` in manifest order (runs on the builder thread)."""
        its = {r: iter_steps(self.source.dataset, m, r, start_step=start_step,
                             build=lambda mb, _e=epoch: self.build(mb, _e)) for r in self.served}
        for step in range(int(start_step), int(m.num_steps)):
            yield step, [(r, next(its[r]).micro) for r in self.served]

    def _epoch(self, epoch: int, start_step: int, limit: int | None) -> None:
        m = self.source.manifest(epoch)
        if int(m.world_size) != self.roles.drafter_ranks:
            raise ConfigError(f"manifest epoch {epoch} was packed for world size {m.world_size}, but the job has "
                              f"{self.roles.drafter_ranks} drafter ranks; re-pack it with `dflash-prep pack "
                              f"--world-size {self.roles.drafter_ranks}` or change --target-ranks")
        done = 0
        with Prefetcher(self._steps(m, epoch, start_step), self.build_ahead) as pf:
            t_end = time.perf_counter()
            while limit is None or done < limit:
                w0 = pf.wait_s
                item = next(pf, None)
                if item is None:
                    break
                self._serve_step(epoch, *item, t_prev=t_end, build_wait=pf.wait_s - w0)
                t_end = time.perf_counter()
                done += 1

    def _serve_step(self, epoch: int, step: int, per_rank: list, *, t_prev: float, build_wait: float) -> None:
        s = self.sender
        b0, m0, send0 = s.bytes_sent, s.messages, s.send_s
        busy, in_flight, events = 0.0, 0, []
        for r, micro in per_rank:
            for b in micro:
                t0 = time.perf_counter()
                if self.device.type == "cuda":
                    events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
                    events[-1][0].record()
                with self.autocast():
                    got = self.provider.taps(b.to(self.device), epoch=epoch, final=self.final)  # (T, k*H) [, (T, H)]
                if events:
                    events[-1][1].record()
                busy += time.perf_counter() - t0
                s.send(self.dst[r], Tag.of(epoch, b.step, b.accum, b.sample_ids), list(got) if self.final else [got],
                       kind=KIND_DATA)
                in_flight = max(in_flight, s.in_flight())
        if events:  # GPU time of the forwards (waits for the step's last one; its sends keep flowing)
            events[-1][1].synchronize()
            busy = sum(a.elapsed_time(z) for a, z in events) / 1e3
        now = time.perf_counter()
        t = StepTiming(epoch=epoch, step=step, wall_s=now - t_prev, busy_s=busy, send_s=s.send_s - send0,
                       build_wait_s=build_wait, bytes_sent=s.bytes_sent - b0, messages=s.messages - m0,
                       in_flight_max=in_flight)
        self.timings.append(t)
        if self.step_stats:   # the drafters log it (RemoteTaps.log_fields), in taps.STEP_STATS order
            row = torch.tensor([t.busy_s, t.wall_s, t.send_s, t.in_flight_max, t.bytes_sent, t.messages],
                               dtype=torch.float64, device=self.device)
            for r in self.served:
                s.send(self.dst[r], step_tag(epoch, step), [row], kind=KIND_DATA)


def sender_for(place, *, prefetch: int, timeout: float, device: torch.device) -> TapsSender:
    """The :class:`TapsSender` of a target rank's :class:`~dflash_prep.train.split.roles.Place`: one peer per served drafter."""
    roles = place.roles
    if not place.is_target:
        raise ValueError(f"global rank {place.rank} is a drafter rank; only target ranks send taps")
    peers = {roles.drafter_global(i): f"drafter rank {i}" for i in place.served}
    return TapsSender(peers, prefetch=prefetch, timeout=timeout, device=device, me=f"target rank {place.rank}")


def dflash_plan(cfg, manifest):
    """What a DFlash (or DFlash2) target rank serves: ``(build(mb, epoch) -> batch, tapped layer ids,
    final)``: the micro-batches exactly as the drafters' objective builds them
    (:func:`~dflash_prep.train.objectives.dflash.batch.build_dflash_batch` under the same anchor
    options, mask id and weights); ``final`` (``--loss kl``): the final hidden states too."""
    from dflash_prep.train.objectives.dflash.batch import build_dflash_batch, default_gamma
    from dflash_prep.train.objectives.dflash.mask import dataset_folder
    from dflash_prep.train.objectives.dflash.objective import drafter_config

    dcfg, spec, *_ = drafter_config(cfg, manifest, dataset_folder(data=cfg.data))   # the drafters' mask token
    gamma = None if cfg.options.slot_weights == "dpace" else (cfg.options.gamma or default_gamma(spec.block_size))
    return (lambda ds, mb, epoch: build_dflash_batch(ds, mb, epoch=epoch, spec=spec, gamma=gamma,
                                                     mask_token_id=dcfg.mask_token_id, vocab_size=dcfg.vocab_size),
            dcfg.target_layer_ids, cfg.options.loss == "kl")


def serve(cfg, place, d, source=None, *, plan=dflash_plan) -> dict:
    """A split job's target rank under ``cfg`` (:mod:`dflash_prep.train.split`): wait for the drafters' cursor, load
    the frozen target, serve every step they will train, and return this rank's summary.

    ``plan(cfg, manifest) -> (build(dataset, mb, epoch), target_layer_ids, final)`` is the objective's
    (:func:`dflash_plan` for DFlash): the target rank builds each micro-batch as the drafters' objective
    does and sends its taps (and with ``final`` its final-normed hidden states); the target runs under
    the autocast and attention backend the colocated loss runs it under. ``source``: what the drafters
    train on (default: :class:`~.source.FileSource` of ``cfg``; every epoch exists, :mod:`dflash_prep.train.split`).
    """
    from dflash_prep.kernels.attention import force_backend

    from dflash_prep.train import distributed
    from dflash_prep.train import rescale
    from dflash_prep.train import split
    from dflash_prep.train.source import FileSource

    distributed.set_determinism(d.device)
    start = split.await_start(place)
    single = distributed.Dist(0, 1, d.local_rank, d.device)   # the continuation exists already: nothing to pack
    if source is None:
        source = FileSource(cfg.data, cfg.plan, cfg.manifests, pack_missing=False)
    source = rescale.source_for(source, start["continuation"], single)
    build_one, layer_ids, final = plan(cfg, source.manifest(int(start["epoch"])))
    provider = target_rank_provider(cfg, source.dataset, layer_ids, final=final, device=d.device, rank=place.rank)
    sender = sender_for(place, prefetch=cfg.target_prefetch, timeout=cfg.target_timeout, device=link_device(d.device))
    autocast = distributed.autocast_for(d.device, cfg.bf16)

    @contextlib.contextmanager
    def forward_ctx():
        with autocast(), (force_backend(cfg.attn) if cfg.attn != "auto" else contextlib.nullcontext()):
            yield

    def build(mb, epoch):
        b = build_one(source.dataset, mb, epoch)
        ahead = getattr(provider, "read_ahead", None)
        if ahead is not None:        # an engine: its states asked on the builder thread, ahead of the sends
            ahead(b)
        return b

    worker = TargetWorker(source, provider, sender, roles=place.roles, target_rank=place.rank, build=build,
                          device=d.device, autocast=forward_ctx, final=final, step_stats=True)
    split.ready(place)
    limit = start["max_steps"]
    try:
        timings = worker.run(range(cfg.epochs), start=(int(start["epoch"]), int(start["step"])),
                             max_steps=None if limit is None else max(0, limit - int(start["global_step"])))
    finally:
        close = getattr(provider, "close", None)
        if close is not None:
            close()
    wall = sum(t.wall_s for t in timings)
    out = {"role": "target", "rank": place.rank, "served": place.served, "steps": len(timings),
           "busy_share": sum(t.busy_s for t in timings) / wall if wall > 0 else 0.0,
           "bytes_sent": sender.bytes_sent, "messages": sender.messages, "time_s": wall}
    summary = getattr(provider, "summary", None)
    return out | (summary() if summary is not None else {})


def target_rank_provider(cfg, ds, layer_ids, *, final: bool, device: torch.device, rank: int):
    """What computes a target rank's taps: the transformers target in this process
    (:class:`~dflash_prep.train.split.taps.LocalTaps`), or with ``--target-engine`` the target in that
    engine, started by this rank on its own devices (:func:`dflash_prep.train.engine_taps.engine_taps`
    without heads: the rows a colocated engine run reads, decoded by the same code, so the drafters
    receive the same taps bit for bit). On CUDA the engine gets this rank's GPUs of the node's
    layout (:mod:`dflash_prep.train.split.gpus`): ``tensor_parallel_size x pipeline_parallel_size``
    of them, the first shared with this process."""
    from dflash_prep.train import engines
    from dflash_prep.train.split import gpus
    from dflash_prep.train.split.taps import LocalTaps
    from dflash_prep.train.target import FrozenTarget

    if cfg.target_engine == engines.BUILTIN:
        return LocalTaps(FrozenTarget(cfg.options.target, layer_ids, device=device))
    from dflash_prep.train.engine_taps import engine_taps

    place = gpus.for_job(cfg, torch.cuda.device_count()).engine if device.type == "cuda" else None
    return engine_taps(cfg, ds, layer_ids, final=final, identity=target_identity(cfg.options.target), device=device,
                       rank=rank, heads=False, gpus=place)
