"""``dflash-prep extract --engine ray --replicas 2``: two engine replicas as tasks of a local Ray,
each building its share of the one cache (dflash_prep/engine/ray_replicas.py), with the real vLLM
(marked ``engine``). The cache equals the single-engine build bit for bit (``--batch-tokens 1``)
and ``dflash-prep verify`` passes it. Three engine starts (two at once).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dflash_prep.formats import states as fmt


def _cmd(world, out, *more):
    return [sys.executable, "-m", "dflash_prep.cli", "extract", str(world["data"]), "--target", str(world["target"]),
            "--objective", "dflash", "--draft-layers", "1", "--dtype", "bf16", "--shard-mb", "0.25",
            "--batch-tokens", "1", "--engine-arg", "dtype=float32", "--timeout", "300", "--out", str(out), *more]


@pytest.mark.engine
@pytest.mark.timeout(1200)
def test_two_ray_replicas_build_the_single_engine_cache_bit_for_bit(world, tmp_path):
    env = {**os.environ, "DFLASH_PREP_VLLM_PYTHON": world["py"], "RAY_DISABLE_USAGE_STATS": "1"}
    single, out = tmp_path / "single", tmp_path / "cache"
    r = subprocess.run(_cmd(world, single), env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run(_cmd(world, out, "--engine", "ray", "--replicas", "2"), env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert "2 engine replicas on Ray" in r.stdout + r.stderr, r.stdout[-2000:]
    h, h1 = fmt.read_header(out), fmt.read_header(single)
    assert h["complete"] and len(h["plan"]) >= 4 and h["shards"] == h1["shards"]
    for e in h1["shards"]:
        assert (out / e["file"]).read_bytes() == (single / e["file"]).read_bytes(), e["file"]
    logs = sorted(f.name for f in out.glob("*.log"))
    assert len(logs) >= 2, logs                        # one engine per replica, each its own log
    v = subprocess.run([sys.executable, "-m", "dflash_prep.cli", "verify", str(out)], capture_output=True, text=True)
    assert v.returncode == 0, v.stderr[-2000:]


def test_replicas_ask_ray_for_their_engines_gpus():     # no engine: in make test
    from dflash_prep.engine.extract import ExtractConfig
    from dflash_prep.engine.ray_replicas import replica_resources

    cfg = ExtractConfig(data="d", target="t", out="o", objective="dflash", tensor_parallel_size=4)
    assert replica_resources(cfg, cluster_gpus=8) == {"num_cpus": 1, "num_gpus": 4}
    assert replica_resources(cfg, cluster_gpus=0) == {"num_cpus": 1, "num_gpus": 0}
