"""``extract --engine ray --replicas N``: one states cache built by N engine replicas on a Ray cluster.

Each replica is one Ray task that runs :func:`dflash_prep.engine.extract.extract` as node ``i`` of
``N`` (:mod:`.nodes`): the same shard plan for every N, replica ``i`` building its contiguous,
token-balanced share into the one ``--out`` folder, with its own engine process (our states worker:
Ray Data's LLM stage would drop the KV-transfer output the worker captures the states through). So
the cache is the one a single engine builds (byte for byte with ``--batch-tokens 1``; vLLM's CPU
kernels are not batch-invariant), and every guarantee of builds across machines holds: per-replica
locks and debris, the shared header, a rerun resuming each share, and the last replica to finish
writing the complete header.

Placement: a replica asks Ray for one CPU and ``tensor_parallel_size x pipeline_parallel_size``
GPUs when the cluster has GPUs (none on a CPU cluster), so Ray puts each replica's engine on GPUs of
its own. The data, the target, ``--out`` and the engine's python must be at the same paths on every
node (shared storage), as for ``--node-rank``. ``--address``: ``auto`` joins the cluster ``ray
start`` runs on this machine, ``HOST:PORT`` a given one; without it a Ray is started for this run
and shut down after (a Ray already initialised in this process is used as is).

The replicas are awaited as they finish (``ray.wait``), not in rank order: the first error comes
back as soon as it happens, as that error, in one line naming the replica; a replica whose Ray
worker died (``WorkerCrashedError``, ``RayActorError``) in one line naming it too. Either way the
replicas still running are cancelled first; whatever they wrote is resumable.
"""

from __future__ import annotations

from dataclasses import replace

from dflash_prep.engine import nodes
from dflash_prep.engine.env import engine_python
from dflash_prep.engine.extract import ExtractConfig, extract
from dflash_prep.errors import ConfigError, DflashError


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("--engine ray needs Ray, which is not installed: pip install 'dflash-prep[ray]' "
                          "(or drop --engine ray to build with one engine here)") from None
    return ray


def _replica(cfg: ExtractConfig) -> dict:
    """One replica on a Ray worker: its share, its errors returned (not raised) as values."""
    try:
        return {"summary": extract(cfg, progress=False)}
    except DflashError as e:
        return {"error": e}


def replica_resources(cfg: ExtractConfig, cluster_gpus: float) -> dict:
    """What one replica asks Ray for: a CPU, and its engine's GPUs when the cluster has any."""
    gpus = cfg.tensor_parallel_size * cfg.pipeline_parallel_size
    return {"num_cpus": 1, "num_gpus": gpus if cluster_gpus > 0 else 0}


def _gather(ray, refs: list) -> list[dict]:
    """The replicas' summaries, in replica order, taken as each finishes (``ray.wait``): the first
    to fail is seen at once, whatever its rank, and on any failure (a replica's error, its Ray
    worker's crash, an interrupt) every replica still running is cancelled before it is raised."""
    rank = {ref: i for i, ref in enumerate(refs)}
    out: dict[int, dict] = {}
    pending = list(refs)
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            i = rank[ready[0]]
            try:
                got = ray.get(ready[0])
            except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as e:
                raise DflashError(f"replica {i} of {len(refs)}: its Ray worker died ({type(e).__name__}: "
                                  f"{(str(e).strip().splitlines() or ['no reason given'])[0]}); the shards the "
                                  "replicas wrote are kept: rerun the same command to build the rest") from None
            if "error" in got:
                e = got["error"]
                raise type(e)(f"replica {i} of {len(refs)}: {e}") from None
            out[i] = got["summary"]
    finally:
        for r in pending:                        # none left when every replica finished
            ray.cancel(r, force=True)
    return [out[i] for i in range(len(refs))]


def extract_on_ray(cfg: ExtractConfig, *, replicas: int, address: str | None = None, log=print) -> dict:
    """Build ``cfg.out`` with ``replicas`` engine replicas on Ray (module docstring); the summary of the
    replica that completed the cache (every replica's node report under ``replicas``)."""
    if replicas < 1:
        raise ConfigError(f"--replicas must be >= 1, got {replicas}")
    if cfg.num_nodes != 1 or cfg.node_rank != 0:
        raise ConfigError("--engine ray places its replicas itself: drop --node-rank and --num-nodes")
    nodes.check_node(replicas - 1, replicas)
    python = cfg.python or str(engine_python(cfg.engine))   # resolved here: every node has it at this path
    ray = _import_ray()
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    try:
        res = replica_resources(cfg, float(ray.cluster_resources().get("GPU", 0)))
        task = ray.remote(max_retries=0, **res)(_replica)
        refs = [task.remote(replace(cfg, python=python, node_rank=i, num_nodes=replicas)) for i in range(replicas)]
        log(f"extract: {replicas} engine replicas on Ray ({res['num_cpus']} CPU, {res['num_gpus']} GPU each) "
            f"building {cfg.out}")
        out = _gather(ray, refs)
    finally:
        if started:
            ray.shutdown()
    each = [{k: s.get(k) for k in ("node_rank", "share", "shards_written")} for s in out]
    done = [s for s in out if s.get("complete")]
    if not done:
        # two replicas finishing at once may each have looked before the other's last shard landed: every
        # shard is in place, so a pass as one node finds nothing to build (no engine) and completes the header
        final = extract(replace(cfg, python=python), progress=False)
        if not final.get("complete"):
            raise DflashError(f"{cfg.out}: every replica finished, yet shards are missing ({final.get('missing')}); "
                              "rerun the same command to build them")
        done = [final]
    return {**done[-1], "replicas": each}
