"""Split-job test pieces: real `pack --objective dflash` manifests for W drafter ranks over a corpus
tokenized with the tiny Qwen3 target's own tokenizer, and the spawned rank entry points.

Every rank of a spawned job rebuilds the same objects from the same paths (pure functions of
them), so the target rank and the drafter ranks build the same micro-batches independently.
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
from pathlib import Path

BLOCK, MAX_ANCHORS = 4, 6


def build_pipeline(root: Path, *, world_size: int = 2, grad_accum: int = 2, n: int = 64) -> dict:
    """synth -> tokenize (the target's tokenizer) -> plan -> pack --objective dflash, epochs 0-1, for a
    drafter with full attention (``--sliding-window 0``, as ``trainer_split_fixtures.base_cfg`` trains)."""
    from dflash_prep.formats import lengths as lengths_mod
    from dflash_prep.formats import plan as plan_mod
    from dflash_prep.pack.pack import PackConfig, pack_epochs
    from dflash_prep.objectives.dflash import drafter_options
    from dflash_prep.synth.synth import SynthConfig, synth
    from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize

    from dflash_prep.tests.train.dflash_fixtures import tiny_target

    target = tiny_target(0)
    synth(SynthConfig(out=root / "corpus", profile="mini", n=n, seed=0))
    tokenize(TokenizeConfig(inputs=(str(root / "corpus" / "chat.jsonl"),), out=root / "data", tokenizer=str(target),
                            max_len=128, on_overflow="drop"))
    src = lengths_mod.load(data=root / "data")
    plan_mod.save(plan_mod.Plan(data=src.describe(), boundaries=(), budget=plan_mod.Budget(value=256), seed=3),
                  root / "plan")
    d = drafter_options(target_config=target, draft_layers=1, block_size=BLOCK, max_anchors=MAX_ANCHORS,
                        sliding_window=0)   # the trainer's base_cfg window: full attention
    pack_epochs(plan=root / "plan" / "plan.json", epochs=[0, 1], out=root / "man",
                config=PackConfig(objective="dflash", options=d, world_size=world_size, grad_accum=grad_accum))
    return {"root": str(root), "target": str(target), "data": str(root / "data"),
            "plan": str(root / "plan" / "plan.json"), "manifests": str(root / "man")}


def open_source(paths: dict):
    from dflash_prep.train.source import FileSource

    return FileSource(paths["data"], paths["plan"], paths["manifests"], pack_missing=False)


def batch_builder(paths: dict, source):
    """``build(mb, epoch)``: the DFlash micro-batch under the manifest's anchor options, as the
    drafter's objective builds it."""
    import torch

    from dflash_prep.train.config import build as build_config
    from dflash_prep.train.objectives.dflash.batch import build_dflash_batch, default_gamma
    from dflash_prep.train.objectives.dflash.batch import anchor_spec
    from dflash_prep.formats.target import load_tokenizer
    from dflash_prep.train.objectives.dflash.mask import choose_mask_token

    target = paths["target"]
    spec, _ = anchor_spec(build_config(objective="dflash", target=target), source.manifest(0))
    vocab = int(json.loads((Path(target) / "config.json").read_text())["vocab_size"])
    mask_id = choose_mask_token(load_tokenizer(target), vocab).id
    gamma = default_gamma(spec.block_size)
    torch.set_num_threads(1)
    return lambda mb, epoch: build_dflash_batch(source.dataset, mb, epoch=epoch, spec=spec, gamma=gamma,
                                                mask_token_id=mask_id, vocab_size=vocab)


def frozen_target(paths: dict):
    import torch

    from dflash_prep.train.target import FrozenTarget

    return FrozenTarget(paths["target"], [1, 2], device=torch.device("cpu"))


def _join(rank: int, world: int, init_file: str, roles, timeout: float):
    import torch
    import torch.distributed as dist

    from dflash_prep.train.split.roles import join

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    return join(roles, rank=rank, world_size=world, local_rank=0, device=torch.device("cpu"), timeout=timeout)


def split_rank(rank: int, world: int, init_file: str, paths: dict, opts: dict) -> None:
    """One rank of a K + W split job (``opts``: K, steps, timeout, prefetch, mode, out, drafter_sleep).

    Target ranks run :class:`TargetWorker` over the epochs; drafter ranks walk their own
    manifest rows and ask :class:`RemoteTaps` for each micro-batch, comparing with the taps of
    a local FrozenTarget on the same batch. Each rank writes ``rank{r}.json`` (what it saw, or
    its error's first line) and ends with ``os._exit`` so a broken peer cannot hang teardown.
    """
    out = Path(opts["out"])
    rec: dict = {"rank": rank, "pid": os.getpid()}
    code = 0
    try:
        from dflash_prep.train.split.roles import Roles

        roles = Roles(opts["K"], world - opts["K"])
        place = _join(rank, world, init_file, roles, opts["timeout"])
        source = open_source(paths)
        build = batch_builder(paths, source)
        if place.is_target:
            rec.update(_target_side(place, source, build, paths, opts))
        else:
            rec.update(_drafter_side(place, source, build, paths, opts, out, rank))
    except Exception as e:  # the test reads the error line
        rec["error"] = str(e).splitlines()[0] if str(e) else type(e).__name__
        rec["error_type"] = type(e).__name__
        rec["trace"] = traceback.format_exc()[-2000:]
        code = 1
    rec["t_end"] = time.time()
    (out / f"rank{rank}.json").write_text(json.dumps(rec))
    os._exit(code)


def _target_side(place, source, build, paths, opts) -> dict:
    import torch

    from dflash_prep.train.split.worker import TargetWorker, sender_for
    from dflash_prep.train.split.taps import LocalTaps

    roles = place.roles
    sender = sender_for(place, prefetch=opts["prefetch"], timeout=opts["timeout"], device=torch.device("cpu"))
    peers = sender.peers
    if opts.get("mode") == "forge":
        return _forge(sender, source, build, place, paths, opts)
    if opts.get("mode") == "silent":   # alive but sends nothing until its drafters have given up
        out, deadline = Path(opts["out"]), time.time() + 4 * opts["timeout"]
        while time.time() < deadline and not all((out / f"rank{g}.json").exists() for g in peers):
            time.sleep(0.05)
        return {"silent": True}
    w = TargetWorker(source, LocalTaps(frozen_target(paths)), sender, roles=roles, target_rank=place.rank,
                     build=build, device=torch.device("cpu"))
    timings = w.run([0, 1], start=tuple(opts.get("start", (0, 0))), max_steps=opts["steps"])
    return {"timings": [t.to_dict() for t in timings], "served": place.served}


def _forge(sender, source, build, place, paths, opts) -> dict:
    """Send each served drafter its first row's honest taps under a forged tag: drafter 0 a wrong
    step, the others a wrong digest."""
    from dflash_prep.train.split.link import Tag
    from dflash_prep.train.split.taps import LocalTaps

    local, m, forged = LocalTaps(frozen_target(paths)), source.manifest(0), {}
    for i in place.served:
        b = build(next(m.microbatches(i)), 0)
        tag = Tag.of(0, b.step, b.accum, b.sample_ids)
        tag = Tag(0, tag.step + 1, tag.micro, tag.digest) if i == 0 else Tag(0, tag.step, tag.micro, tag.digest ^ 1)
        sender.send(place.roles.drafter_global(i), tag, [local.taps(b, epoch=0)])
        forged[i] = str(tag)
    sender.flush()   # both drafters have read their message
    return {"forged": forged}


def _drafter_side(place, source, build, paths, opts, out: Path, rank: int) -> dict:
    import torch

    from dflash_prep.train.data import iter_steps
    from dflash_prep.train.split.taps import LocalTaps, remote_taps

    i = place.dist.rank
    remote = remote_taps(place, paths["target"], timeout=opts["timeout"], device=torch.device("cpu"))
    embed, head = remote.embed_tokens, remote.lm_head
    local = LocalTaps(frozen_target(paths)) if opts.get("compare", True) else None
    seen, equal, n = [], [], 0
    e0, s0 = opts.get("start", (0, 0))
    for epoch in (0, 1):
        if epoch < e0:
            continue
        m = source.manifest(epoch)
        for sb in iter_steps(source.dataset, m, i, start_step=s0 if epoch == e0 else 0,
                             build=lambda mb, _e=epoch: build(mb, _e)):
            if n >= opts["steps"]:
                break
            for b in sb.micro:
                got = remote.taps(b, epoch=epoch)
                seen.append([epoch, b.step, b.accum, [int(s) for s in b.sample_ids]])
                if local is not None:
                    equal.append(bool(torch.equal(got, local.taps(b, epoch=epoch))) and got.dtype == torch.float32)
                (out / f"progress{rank}").write_text(str(len(seen)))
                time.sleep(opts.get("drafter_sleep", 0.0))
            n += 1
    from dflash_prep.train import distributed

    # the drafter-only group: a target rank never joins these (it would hang them if it had to)
    total = int(distributed.all_reduce_sum(torch.tensor([len(seen)], dtype=torch.int64), place.dist).item())
    ranks = distributed.gather_objects(i, place.dist)
    distributed.barrier(place.dist)
    return {"seen": seen, "equal": equal, "drafter": i, "target": place.target, "group_total": total,
            "group_ranks": ranks,
            "heads_equal": bool(local is None or (torch.equal(embed.weight, local.embed_tokens.weight)
                                                  and torch.equal(head.weight, local.lm_head.weight)))}


def supervise(procs, *, deadline: float, kill_check=None) -> tuple[float, float | None]:
    """Wait for every process of a spawned job. ``kill_check()`` (polled every 50 ms until it
    answers) returns the index of a process to SIGKILL once, or None; a job still running after
    ``deadline`` seconds raises :class:`TimeoutError` naming its ranks. Every process is reaped
    either way. Returns ``(t0, killed_at)``."""
    t0, killed_at = time.time(), None
    try:
        while any(p.is_alive() for p in procs):
            if time.time() - t0 > deadline:
                raise TimeoutError(f"ranks {[r for r, p in enumerate(procs) if p.is_alive()]} still running after "
                                   f"{deadline} s")
            if kill_check is not None and killed_at is None:
                victim = kill_check()
                if victim is not None:
                    os.kill(procs[victim].pid, signal.SIGKILL)
                    killed_at = time.time()
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    return t0, killed_at
