"""``dflash-prep extract --engine ray --replicas 2``: what each replica asks Ray for, without an
engine (in ``make test``). The replicas with the real vLLM, whose cache equals the single-engine
build bit for bit: test_extract_nodes.py, beside the node build, on the same single build.
"""

from __future__ import annotations


def test_replicas_ask_ray_for_their_engines_gpus():     # no engine: in make test
    from dflash_prep.engine.extract import ExtractConfig
    from dflash_prep.engine.ray_replicas import replica_resources

    cfg = ExtractConfig(data="d", target="t", out="o", objective="dflash", tensor_parallel_size=4)
    assert replica_resources(cfg, cluster_gpus=8) == {"num_cpus": 1, "num_gpus": 4}
    assert replica_resources(cfg, cluster_gpus=0) == {"num_cpus": 1, "num_gpus": 0}
