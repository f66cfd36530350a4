"""Spawned trainer jobs for the split-job tests: ``train()`` itself on every rank of a gloo job,
colocated (W processes) or split (K target + W drafter processes), with a hard deadline.

Every rank runs with one thread (bit-identity across process layouts) and ends with ``os._exit``
after writing ``rank{r}.json`` (its summary, or its error's first line), so a dead peer can
never hang the test in teardown.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

from dflash_prep.tests.train.split_fixtures import supervise


def train_rank(rank: int, world: int, init_file: str, cfg_kw: dict, out_dir: str) -> None:
    """One rank of a trainer job (``torch.multiprocessing`` entry point)."""
    rec: dict = {"rank": rank, "pid": os.getpid()}
    code = 0
    try:
        import torch
        import torch.distributed as dist

        from dflash_prep.train.config import build as build_config
        from dflash_prep.train.distributed import Dist
        from dflash_prep.train.loop import train

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        rec["summary"] = train(build_config(**cfg_kw), dist_ctx=Dist(rank, world, 0, torch.device("cpu")))
    except BaseException as e:  # the test reads the error line
        rec["error"] = str(e).splitlines()[0] if str(e) else type(e).__name__
        rec["error_type"] = type(e).__name__
        rec["saved"] = getattr(e, "dflash_saved", None)
        rec["trace"] = traceback.format_exc()[-3000:]
        code = 1
    rec["t_end"] = time.time()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(rec, default=str))
    os._exit(code)


def run_job(tmp: Path, cfg_kw: dict, world: int, *, deadline: float = 120.0, kill=None) -> dict:
    """Spawn ``world`` ranks of ``train(build_config(**cfg_kw))``; ``kill = (global rank, global step)``
    SIGKILLs that rank once the run's log.jsonl holds that step. Returns ``{rank: record}`` plus
    ``exit`` (exit codes), ``killed_at`` and ``elapsed``; a job past ``deadline`` is killed and reported."""
    import torch.multiprocessing as mp

    tmp.mkdir(parents=True, exist_ok=True)
    for f in tmp.glob("rank*.json"):
        f.unlink()
    init = tmp / f"init-{time.monotonic_ns()}"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=train_rank, args=(r, world, str(init), cfg_kw, str(tmp))) for r in range(world)]
    for p in procs:
        p.start()
    log = Path(cfg_kw["out"]) / "log.jsonl"

    def due():
        steps = [json.loads(x).get("global_step") for x in log.read_text().splitlines()[1:] if x] if log.exists() else []
        return kill[0] if kill[1] in steps else None

    t0, killed_at = supervise(procs, deadline=deadline, kill_check=due if kill else None)
    recs: dict = {r: json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)
                  if (tmp / f"rank{r}.json").exists()}
    recs["exit"] = [p.exitcode for p in procs]
    recs["killed_at"], recs["elapsed"] = killed_at, time.time() - t0
    return recs


def base_cfg(paths: dict, out: Path, **kw) -> dict:
    """The tests' trainer options over ``split_fixtures.build_pipeline`` outputs (CPU, fp32, reference attention)."""
    cfg = dict(data=paths["data"], plan=paths["plan"], manifests=paths["manifests"], out=str(out),
               objective="dflash", target=paths["target"], draft_layers=1, device="cpu", bf16=False,
               attn="reference", progress=False, prefetch=2, warmup_steps=1, lr=3e-3, ce_chunk=16,
               slot_weights="decay", optimizer="adamw", sliding_window=0, epochs=2, pack_missing=False,
               target_layer_ids=(1, 2), target_timeout=20.0)
    cfg.update(kw)
    return cfg


def log_records(out: Path) -> list[dict]:
    lines = (Path(out) / "log.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(str.strip, lines)) if "global_step" in r and "loss" in r]
