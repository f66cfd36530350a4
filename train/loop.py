"""The training loop: one trainable module, one optimizer, manifests in, JSONL out.

What is trained and how a micro-batch becomes a loss is the objective's business
(:mod:`dflash_prep.train.objectives`: ``--objective lm`` or ``dflash``); the loop is the same.
Per optimizer step ``s`` of epoch ``e`` (this rank holds micro-batches ``mb_1..mb_a`` of it,
``a`` usually the manifest's grad_accum, possibly 0 on a short last step):

1. ``N = all_reduce_sum(sum of the objective's denominators over this rank's micro-batches)``:
   LM: the real target tokens, DFlash: the sum of block weights ``w``, of the whole step,
   every rank and every accumulation micro-batch (float64, with the token and FLOP counts);
   D-PACE weights come out of the forward, so there ``N`` is all-reduced after it and the
   summed gradient of the unscaled loss sums is divided by it (the same update; ``train_step``);
2. for each micro-batch: ``(loss sum / N).backward()`` (gradients accumulate);
3. all-reduce the gradients with SUM (so the step's gradient is that of the per-token (per-w)
   mean over the whole step, never a mean of per-micro-batch means), clip, optimizer step; the
   objective's stats vector (loss sum, DFlash accuracy/tau sums) is all-reduced once.

So 2 ranks x A=1 and 1 rank x A=2 over the same micro-batches give the same gradient (up to
fp32 summation order); ``tests/train/test_distributed.py`` and ``test_dflash_train.py`` check
it. A step whose ``N`` is 0 (nothing to learn anywhere) leaves parameters and optimizer state
untouched.

Determinism: CPU runs use ``torch.use_deterministic_algorithms``, fp32 (the LM head's matmuls
in bf16 under ``--bf16`` where the CPU has it natively: deterministic too), no dropout, and a
loader that is a pure function of (manifest, cursor), so resume is bitwise
(``tests/train/test_resume.py``). CUDA runs use bf16 autocast and the Triton kernels.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from dflash_prep.kernels.attention import force_backend
from dflash_prep.errors import ConfigError, DflashError, FormatError
from dflash_prep.formats.fileio import atomic_write_json
from dflash_prep.formats.outputs import lock

from dflash_prep.train import checkpoint as ckpt
from dflash_prep.train import distributed
from dflash_prep.train.split import handshake
from dflash_prep.train import rescale
from dflash_prep.train import split
from dflash_prep.train.config import TrainConfig
from dflash_prep.train.data import StepBatches
from dflash_prep.train import engine_eval
from dflash_prep.train import matmul_peak
from dflash_prep.train.distributed import autocast_for as _autocast_for, set_determinism as _set_determinism  # noqa: F401 (bench imports)
from dflash_prep.train.loader import ManifestLoader
from dflash_prep.train.lr import Schedule
from dflash_prep.train.objectives import build_objective, serve_target
from dflash_prep.train.objectives.registry import get as trainer_spec
from dflash_prep.train.optim import build_optimizer
from dflash_prep.train.runlog import FORMAT_VERSION, SUMMARY_FORMAT, TARGET_SUMMARY_FORMAT, RunLog, check_run_folder, finite
from dflash_prep.train.source import tokenizer_field
from dflash_prep.tokenize.thinking import dataset_serving_mode


def train_step(model, opt: torch.optim.Optimizer, sb: StepBatches, *, lr: float, grad_clip: float,
               d: distributed.Dist, autocast, objective=None) -> dict:
    """One optimizer step over this rank's micro-batches of step ``sb.step`` (module docstring).

    ``objective`` (default: the LM objective on ``model``) turns each micro-batch into a loss
    sum and a stats vector (:mod:`dflash_prep.train.objectives`); ``N`` is the sum of its
    ``denominator`` over the step's ranks and micro-batches. An objective with
    ``deferred_denominator`` (D-PACE: the weights come out of the forward) defers ``N``: each
    micro-batch backpropagates its loss sum unscaled, ``N`` comes from the all-reduced stats
    (``objective.denominator_from``), and the all-reduced gradient is divided by it before
    clipping. The same linear map, so the update stays that of ``sum w * CE / N`` over the
    whole step, however it is split.
    """
    if objective is None:
        from dflash_prep.train.objectives import LMObjective
        objective = LMObjective(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt.zero_grad(set_to_none=True)
    # float64 holds integer counts exactly (< 2^53) and the DFlash weight sums
    deferred = getattr(objective, "deferred_denominator", False)
    counts = torch.tensor([0.0 if deferred else sum(objective.denominator(b) for b in sb.micro),
                           sum(b.real_tokens for b in sb.micro),
                           sum(b.padded_tokens for b in sb.micro), sum(objective.flops(b) for b in sb.micro)],
                          dtype=torch.float64, device=d.device)
    distributed.all_reduce_sum(counts, d)
    denom_sum, real, padded, flops = counts.tolist()
    stats = torch.zeros(objective.stats_width, dtype=torch.float64, device=d.device)
    denom = denom_sum if denom_sum > 0 else 1.0
    for b in sb.micro:
        b = b.to(d.device)
        ls, st = objective.loss(b, autocast)
        (ls if deferred else ls / denom).backward()
        stats += st
    distributed.all_reduce_grads(params, d)
    distributed.all_reduce_sum(stats, d)
    if deferred:
        denom_sum = objective.denominator_from(stats)
        if denom_sum > 0:
            for p in params:
                p.grad.div_(denom_sum)
    if grad_clip > 0:
        gnorm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip, foreach=False))
    else:
        gnorm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
    if denom_sum > 0:
        for g in opt.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)
        opt.step()
    out = objective.metrics(stats, denom_sum)
    return {**out, "grad_norm": gnorm, "targets": objective.targets(denom_sum), "real_tokens": int(real), "padded_tokens": int(padded),
            "flops": flops, "skipped": denom_sum == 0}


class PeerStopped(DflashError):
    """Another rank stopped on a data error; this rank stops with it (after the shared checkpoint)."""


def _fetch(pf, d: distributed.Dist):
    """The next step's batches, with data errors agreed on by every rank (one int all-reduce).

    A data error on any rank (a corrupt shard, a token id beyond the vocabulary) makes every
    rank raise at the same step, so they can write the on-error checkpoint together."""
    err = None
    try:
        sb = next(pf, None)
    except DflashError as e:
        sb, err = None, e
    if d.active:
        flag = torch.tensor([0 if err is None else 1], dtype=torch.int64, device=d.device)
        distributed.all_reduce_sum(flag, d)
        if int(flag.item()) and err is None:
            err = PeerStopped("another rank stopped on a data error (see its message)")
    if err is not None:
        err.dflash_data_error = True
        raise err
    return sb


def _wandb(cfg: TrainConfig, d: distributed.Dist):
    if not cfg.wandb or not d.is_main:
        return None
    try:
        import wandb
    except ImportError:
        print("warning: --wandb was given but wandb is not installed (pip install wandb); logging to JSONL only",
              file=sys.stderr)
        return None
    return wandb.init(project=cfg.wandb, config=cfg.flat())


class _Lines:
    """Progress for a non-terminal (make, CI logs): one line per tenth of the run."""

    def __init__(self, total: int):
        self.total, self.done, self.every = total, 0, max(1, total // 10)
        self.task_ids = [0]

    def update(self, _task, advance: int, info: str) -> None:
        self.done += advance
        if self.done % self.every == 0 or self.done == self.total:
            print(f"train {self.done}/{self.total}  {info}", flush=True)

    def stop(self) -> None:
        pass


def _progress(enabled: bool, total: int):
    """A rich progress bar on a terminal, periodic lines otherwise, None when disabled."""
    if not enabled:
        return None
    if not sys.stdout.isatty():
        return _Lines(total)
    p = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                 TimeRemainingColumn(), transient=False)
    p.start()
    p.add_task("train", total=total, info="")
    return p


def train(cfg: TrainConfig, *, source=None, dist_ctx: distributed.Dist | None = None) -> dict:
    """Run (or resume) training as ``cfg`` says; returns the final summary (rank 0's view).

    ``source`` defaults to :class:`dflash_prep.train.source.FileSource` over ``cfg.data``/``plan``/
    ``manifests``; tests pass any object with the same members. With ``cfg.target_ranks`` the
    job is split (:mod:`dflash_prep.train.split`): a target rank returns its own summary.
    """
    job = dist_ctx or distributed.setup(cfg.device, cuda_index=split.cuda_index(cfg) if cfg.target_ranks else None)
    d, place = job, None
    try:
        if cfg.target_ranks:
            place = split.join(cfg, job)
            handshake.begin()
            split.prepare(cfg, place, source)
            if place.is_target:
                summary = serve_target(cfg, place, job, source)
                Path(cfg.out).mkdir(parents=True, exist_ok=True)
                atomic_write_json(Path(cfg.out) / f"target-rank{place.rank}.json", finite(summary),
                                  format=TARGET_SUMMARY_FORMAT, version=FORMAT_VERSION)
                return summary
            d = place.dist
        out = Path(cfg.out)
        if not d.is_main:
            return _train(cfg, source, d, place)
        check_run_folder(out)

        with lock(out, inside=True):  # a second trainer on the same --out fails clearly
            return _train(cfg, source, d, place)
    except Exception as e:
        # a split job's rank that refuses it at set-up tells every other rank (one line each)
        handshake.refuse(place, e)
        raise
    finally:
        if dist_ctx is None:
            distributed.teardown(job)


@dataclass
class _Run:
    """What one call of :func:`train` works on; ``epoch``/``step``/``gstep`` are the cursor, and
    ``consistent`` says the model and optimizer hold exactly the state after global step ``gstep``."""

    cfg: TrainConfig
    d: distributed.Dist
    source: object
    ds: object                    # the dataset (the source's, before a --rescale continuation wraps it)
    loader: ManifestLoader
    first: object                 # the first manifest this call reads
    run_key: dict
    obj: object                   # the objective (:mod:`dflash_prep.train.objectives`)
    mcfg: dict
    opt: torch.optim.Optimizer
    sched: Schedule
    total: int                    # the cosine horizon in steps
    epoch: int = 0
    step: int = 0
    gstep: int = 0
    resumed: bool = False
    consistent: bool = True
    evals: engine_eval.EngineEvals | None = None   # rank 0's --eval-every evaluations
    matmul: matmul_peak.MatmulRate | None = None    # a CPU run's measured head matmul rate

    @property
    def ckpt_path(self) -> Path:
        return Path(self.cfg.out) / ckpt.CKPT_FILE

    def save(self) -> None:
        rng_all = distributed.gather_objects(ckpt.rng_state(), self.d)
        if self.d.is_main:
            ckpt.save(self.ckpt_path, model=self.obj.model, optimizer=self.opt, schedule=self.sched.state(),
                      rng=rng_all, cursor={"epoch": self.epoch, "step": self.step, "global_step": self.gstep},
                      run_key=self.run_key, model_config=self.mcfg,
                      extra={"config": self.cfg.flat(), "serving_mode": dataset_serving_mode(self.ds)})
        distributed.barrier(self.d)


def _setup(cfg: TrainConfig, source, d: distributed.Dist, place=None) -> _Run:
    """Data, objective, optimizer and schedule; the checkpoint's state when resuming."""
    engine_eval.check(cfg, trainer_spec(cfg.objective))   # before any work: --eval-every's needs
    if cfg.attn == "triton" and d.device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before kernels first imports triton
    _set_determinism(d.device)
    if source is None:
        from dflash_prep.train.source import FileSource
        source = FileSource(cfg.data, cfg.plan, cfg.manifests, pack_missing=cfg.pack_missing, dist=d)
    ds = source.dataset
    ckpt_path = Path(cfg.out) / ckpt.CKPT_FILE
    state = ckpt.load(ckpt_path) if ckpt_path.exists() and not cfg.from_scratch else None
    cont = rescale.plan_resume(state, rescale=cfg.rescale, world_size=d.world_size, ckpt_path=ckpt_path)
    source = rescale.source_for(source, cont, d)   # --rescale: the rest of an epoch re-packed for W'
    pad_id = int(tokenizer_field(ds, "pad_id", 0))
    loader = ManifestLoader(source, rank=d.rank, epochs=cfg.epochs, collate="trainer", pad_id=pad_id,
                            pin=d.device.type == "cuda", prefetch=cfg.prefetch)
    first = loader.manifest(int(cont["epoch"]) if cont else 0)
    _check_manifest_shape(first, d)
    run_key = {**source.run_identity(), **_manifest_key(first), **({"continuation": cont} if cont else {})}

    obj = build_objective(cfg, ds, d.device, manifest=first, place=place)  # seeds torch with cfg.seed first
    run_key["contract"] = {**obj.contract(), "optimizer": cfg.optimizer}
    about = obj.describe()
    if d.is_main and about:
        print(about, flush=True)
    opt = build_optimizer(obj.model, cfg)
    # Cosine horizon: epochs x the first epoch's steps (epochs differ by a step or two; past the
    # horizon the LR stays at its floor). Not max_steps, which only stops early: so a run cut
    # short and resumed follows the same schedule as a straight one.
    total = cfg.epochs * int(first.num_steps)
    sched = Schedule(peak=cfg.lr, warmup=cfg.warmup_steps, total=max(1, total), min_ratio=cfg.min_lr_ratio)
    run = _Run(cfg=cfg, d=d, source=source, ds=ds, loader=loader, first=first, run_key=run_key, obj=obj,
               mcfg=obj.model_config(), opt=opt, sched=sched, total=total)
    if state is not None:
        _resume(run, state)
    if cfg.eval_every and d.is_main:
        run.evals = engine_eval.EngineEvals(Path(cfg.out), target=cfg.options.target, prompts=cfg.eval_prompts,
                                            every=cfg.eval_every, bench=cfg.eval_bench, n=cfg.eval_n,
                                            ours=cfg.eval_ours)
    return run


def _resume(run: _Run, state: dict) -> None:
    """Model, optimizer, schedule, RNG and cursor from a checkpoint (its run key checked first)."""
    d, path = run.d, run.ckpt_path
    rescale.check_key(state["run_key"], run.run_key, path=path)
    ckpt.check_model(state["model_config"], run.mcfg, path=path)
    run.obj.model.load_state_dict(state["model"])
    run.opt.load_state_dict(state["optimizer"])
    run.sched = Schedule.from_state(state["schedule"])
    rngs = state["rng"]
    run.epoch, run.step, run.gstep = (int(state["cursor"][k]) for k in ("epoch", "step", "global_step"))
    if len(rngs) == d.world_size:
        ckpt.set_rng_state(rngs[d.rank])
    else:  # rescaled (rescale.plan_resume allowed it): no per-rank state maps onto W' ranks
        rescale.reseed(run.cfg.seed, run.gstep, d.rank)
    run.resumed = True
    if d.is_main:
        print(f"resuming {path} at epoch {run.epoch} step {run.step} (global step {run.gstep})", flush=True)


def _builder(run: _Run, epoch: int, layout: str):
    """The prefetch thread's micro-batch builder: the objective's batch, then whatever it reads ahead
    for it (a drafter on a states cache: the batch's states, decoded off the step loop)."""
    obj, ahead = run.obj, getattr(run.obj, "read_ahead", None)

    def build(mb):
        b = obj.build(run.ds, mb, epoch, layout, run.loader.pin)
        if ahead is not None:
            ahead(b)
        return b
    return build


def _train(cfg: TrainConfig, source, d: distributed.Dist, place=None) -> dict:
    run = _setup(cfg, source, d, place)
    if place is not None:   # the target ranks serve the same steps from the same cursor
        split.announce(place, epoch=run.epoch, step=run.step, global_step=run.gstep, max_steps=cfg.max_steps or None,
                       continuation=run.run_key.get("continuation"))
    out, obj = Path(cfg.out), run.obj
    run.matmul = matmul_peak.for_run(obj, d.device, cfg.bf16, cfg.ce_chunk)
    header = {"config": cfg.flat(), "model": run.mcfg, "params": obj.num_parameters(),
              "run_key": run.run_key, "serving_mode": dataset_serving_mode(run.ds), "world_size": d.world_size,
              "device": str(d.device), "cpu_matmul": run.matmul.to_dict() if run.matmul else None,
              "resumed_from": {"epoch": run.epoch, "step": run.step, "global_step": run.gstep} if run.resumed else None}
    log = RunLog(out / "log.jsonl", header, fresh=not run.resumed, enabled=d.is_main, keep_through=run.gstep)
    if log.dropped:
        print(f"log.jsonl: dropped {log.dropped} record(s) past the checkpoint (global step {run.gstep}); "
              "they are trained again now", flush=True)
    wb = _wandb(cfg, d)
    limit = cfg.max_steps or None
    bar = _progress(cfg.progress and d.is_main, (limit or run.total) - run.gstep)
    totals = {"steps": 0, "real_tokens": 0, "padded_tokens": 0, "targets": 0, "time_s": 0.0, "wait_s": 0.0}
    losses: list[float] = []
    try:
        while run.epoch < cfg.epochs and (limit is None or run.gstep < limit):
            m = _epoch_manifest(run)
            build = _builder(run, run.epoch, m.layout)
            with run.loader.open_epoch(run.epoch, start_step=run.step, build=build) as pf:
                _run_epoch(run, pf, limit, totals, losses, log, wb, bar)
            if run.step >= int(m.num_steps):
                run.epoch, run.step = run.epoch + 1, 0
        run.save()
        if d.is_main and totals["steps"]:
            obj.finish(out)
        if run.evals is not None:   # the evaluation in flight, waited for so its record is kept
            _log_evals(run.evals.close(), log)
    except (Exception, KeyboardInterrupt) as e:
        # A stop on error keeps the progress: write the checkpoint when the state is that of a
        # whole step. Across ranks only when every rank stops at the same point (data errors,
        # agreed by _fetch); a lone rank's other error cannot run the collective save.
        if run.consistent and (getattr(e, "dflash_data_error", False) or not d.active) and run.gstep > 0:
            run.save()
            e.dflash_saved = f"{run.ckpt_path} at global step {run.gstep}"
        raise
    finally:
        if run.evals is not None:   # on an error: stopped, not waited for
            _log_evals(run.evals.close(timeout_s=0), log)
        close = getattr(obj, "close", None)
        if close is not None:       # the target's engine process, where the taps provider started one
            close()
        if bar is not None:
            bar.stop()
        log.close()

    summary = _summary(totals, losses, run.epoch, run.step, run.gstep, obj, d) | obj.run_summary(totals["time_s"])
    if d.is_main and totals["steps"]:  # a call with nothing left to do keeps the last run's summary
        atomic_write_json(out / "summary.json", finite(summary), format=SUMMARY_FORMAT, version=FORMAT_VERSION)
        if wb is not None:
            wb.summary.update(summary)
            wb.finish()
    return summary


def _epoch_manifest(run: _Run):
    """The manifest of ``run.epoch``, refused when packed otherwise than the first one."""
    m = run.loader.manifest(run.epoch)
    _check_manifest_shape(m, run.d)
    shape = _manifest_key(m)
    run.obj.check_epoch(run.epoch, m)
    if any(run.run_key[k] != v for k, v in shape.items()):
        raise FormatError(f"epoch {run.epoch} manifest was packed with {shape}, epoch 0 with "
                          f"{ {k: run.run_key[k] for k in shape} }; pack every epoch with the same options")
    return m


def _run_epoch(run: _Run, pf, limit: int | None, totals: dict, losses: list, log, wb, bar) -> None:
    """Train the steps of one epoch's prefetcher ``pf`` until it ends or ``limit`` global steps."""
    cfg, d, obj = run.cfg, run.d, run.obj
    autocast = _autocast_for(d.device, cfg.bf16)
    attn_ctx = (lambda: force_backend(cfg.attn)) if cfg.attn != "auto" else contextlib.nullcontext
    peak = distributed.peak_flops(d.device)
    while limit is None or run.gstep < limit:
        t0 = time.perf_counter()
        w0 = pf.wait_s
        sb = _fetch(pf, d)
        if sb is None:
            break
        run.consistent = False
        with attn_ctx():
            st = train_step(obj.model, run.opt, sb, lr=run.sched(run.gstep), grad_clip=cfg.grad_clip, d=d,
                            autocast=autocast, objective=obj)
        if d.device.type == "cuda":
            torch.cuda.synchronize(d.device)
        dt = time.perf_counter() - t0
        wait = pf.wait_s - w0
        run.step, run.gstep = sb.step + 1, run.gstep + 1
        run.consistent = True
        _accumulate(totals, st, dt, wait)
        if not st["skipped"]:
            losses.append(st["loss"])
        rec = {"epoch": run.epoch, "step": sb.step, "global_step": run.gstep, "loss": st["loss"],
               "lr": run.sched(run.gstep - 1), "grad_norm": st["grad_norm"], "targets": st["targets"],
               "real_tokens": st["real_tokens"], "padded_tokens": st["padded_tokens"],
               "efficiency": st["real_tokens"] / max(1, st["padded_tokens"]),
               "tokens_per_s": st["real_tokens"] / dt, "step_time_s": dt, "data_wait_s": wait,
               "data_wait_share": wait / dt if dt > 0 else 0.0,
               "mfu": st["flops"] / (dt * peak * d.world_size) if peak else None,
               **matmul_peak.step_rates(st["flops"], dt, d.world_size, run.matmul)}
        rec.update(obj.log_fields({**st, "epoch": run.epoch, "step": sb.step}, dt))
        if run.gstep % cfg.log_every == 0:
            log.write(rec)
            if wb is not None:
                wb.log(rec, step=run.gstep)
        if bar is not None:
            bar.update(bar.task_ids[0], advance=1, info=f"loss {st['loss']:.3f}  {rec['tokens_per_s']:,.0f} tok/s")
        saved = bool(cfg.ckpt_every) and run.gstep % cfg.ckpt_every == 0
        if saved:
            run.save()
        if cfg.eval_every and run.gstep % cfg.eval_every == 0:   # every rank: the save is collective
            if not saved:
                run.save()
            if run.evals is not None:
                _log_evals([r for r in [run.evals.start(run.gstep, run.ckpt_path, rec.get("tau"))] if r], log)
        if run.evals is not None:
            _log_evals(run.evals.poll(), log)


def _log_evals(records: list[dict], log) -> None:
    """``--eval-every`` records into log.jsonl, and one line each on the console."""
    for r in records:
        log.write(r)
        e = r["eval"]
        if "tau_engine" in e:
            f3 = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
            what = (f"tau_engine {f3(e['tau_engine'])} (ours {f3(e['tau_ours'])}, trainer {f3(e['tau_train'])}), "
                    f"lossless {e['lossless']}, {e['seconds']:.0f} s")
            if len(e.get("per_set") or {}) > 1:
                what += "; " + ", ".join(f"{k} {f3(v['tau_engine'])}" for k, v in e["per_set"].items())
        else:
            what = e.get("skipped") or f"failed: {e['failed']} (see {e.get('log')})"
        print(f"eval of global step {r['global_step']}: {what}", flush=True)


def _manifest_key(m) -> dict:
    """What a manifest adds to the run key: layout, W, A, and the pack options and budget."""
    meta = getattr(m, "meta", {}) or {}
    return {"layout": m.layout, "world_size": int(m.world_size), "grad_accum": int(m.grad_accum),
            "pack_options": meta.get("options"), "pack_budget": meta.get("budget")}


def _check_manifest_shape(m, d: distributed.Dist) -> None:
    if int(m.world_size) != d.world_size:
        raise ConfigError(f"manifest epoch {m.epoch} was packed for world size {m.world_size}, but this job has "
                          f"{d.world_size} process(es); launch torchrun with --nproc_per_node/--nnodes giving "
                          f"{m.world_size} ranks, or re-pack with `dflash-prep pack --world-size {d.world_size}`")
    if m.layout not in ("padded", "varlen"):
        raise FormatError(f"manifest epoch {m.epoch}: unknown layout {m.layout!r}")


def _accumulate(totals: dict, st: dict, dt: float, wait: float) -> None:
    totals["steps"] += 1
    totals["real_tokens"] += st["real_tokens"]
    totals["padded_tokens"] += st["padded_tokens"]
    totals["targets"] += st["targets"]
    totals["time_s"] += dt
    totals["wait_s"] += wait


def _summary(totals, losses, epoch, step, gstep, model, d) -> dict:
    """Run totals; ``loss_fell`` compares the mean loss of the first and last 5 steps of this run."""
    t = max(totals["time_s"], 1e-9)
    k = max(1, min(5, len(losses) // 2))
    head = sum(losses[:k]) / k if losses else None
    tail = sum(losses[-k:]) / k if losses else None
    return {"steps": totals["steps"], "global_step": gstep, "cursor": {"epoch": epoch, "step": step},
            "loss_first": head, "loss_last": tail, "loss_fell": bool(len(losses) >= 2 and tail < head),
            "real_tokens": totals["real_tokens"], "padded_tokens": totals["padded_tokens"],
            "targets": totals["targets"], "efficiency": totals["real_tokens"] / max(1, totals["padded_tokens"]),
            "tokens_per_s": totals["real_tokens"] / t, "data_wait_share": totals["wait_s"] / t,
            "time_s": totals["time_s"], "params": model.num_parameters(), "world_size": d.world_size,
            "objective": getattr(model, "name", "lm"),
            "device": str(d.device)}
