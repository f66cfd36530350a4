"""Where a split job's processes and their engines sit on a node's GPUs
(dflash_prep/train/split/gpus.py): no GPU is touched; the layout is checked whole, node by node."""

from __future__ import annotations

import pytest
import torch

from dflash_prep.errors import ConfigError
from dflash_prep.train import split
from dflash_prep.train.engine_taps import engine_devices
from dflash_prep.train.split.gpus import engine_visible, for_job, node_gpus, per_target

from dflash_prep.tests.train.dflash_fixtures import dflash_cfg


def _node(node: int, *, L: int, K: int, t: int, count: int) -> list:
    return [node_gpus(rank=node * L + r, local_rank=r, local_world=L, target_ranks=K, per_target=t, count=count)
            for r in range(L)]


@pytest.mark.parametrize("L, K", [(3, 1), (8, 2), (8, 8)])
def test_one_gpu_per_target_is_cuda_local_rank_as_colocated(L, K):
    for node in range(2):
        got = _node(node, L=L, K=K, t=1, count=L)
        assert [g.device for g in got] == list(range(L))
        assert [g.engine for g in got] == [(r,) if node * L + r < K else () for r in range(L)]


@pytest.mark.parametrize("L, K, t", [(6, 2, 4), (3, 1, 2), (5, 1, 8), (4, 4, 2)])
def test_every_gpu_of_the_node_is_taken_exactly_once(L, K, t):
    """One node: target rank j's engine on GPUs j*t..j*t+t-1, its process on the first; the drafter
    ranks one each after them; every GPU of the k*t + (L - k) used once."""
    need = K * t + (L - K)
    got = _node(0, L=L, K=K, t=t, count=need)
    taken = [i for g in got for i in (g.engine or (g.device,))]
    assert sorted(taken) == list(range(need))
    for j in range(K):
        assert got[j].engine == tuple(range(j * t, j * t + t)) and got[j].device == j * t
    assert [g.device for g in got[K:]] == list(range(K * t, need))


def test_across_nodes_the_targets_are_the_first_global_ranks():
    """16 processes on 2 nodes of 8, K = 10 targets over 2 GPUs: node 0 runs 8 targets (16 GPUs),
    node 1 the last 2 targets (4 GPUs) and 6 drafters."""
    node0, node1 = _node(0, L=8, K=10, t=2, count=16), _node(1, L=8, K=10, t=2, count=10)
    assert [g.engine for g in node0] == [(2 * j, 2 * j + 1) for j in range(8)]
    assert [g.engine for g in node1[:2]] == [(0, 1), (2, 3)] and [g.device for g in node1[2:]] == [4, 5, 6, 7, 8, 9]
    assert all(g.engine == () for g in node1[2:])


def test_too_few_gpus_is_one_line_naming_the_layout(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    with pytest.raises(ConfigError) as e:
        node_gpus(rank=3, local_rank=3, local_world=6, target_ranks=2, per_target=4, count=8)
    msg = str(e.value)
    assert "\n" not in msg and "2 target rank(s) x 4 GPU(s)" in msg and "4 drafter rank(s), 12 GPUs in all" in msg
    assert "torch sees 8 (CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7)" in msg
    with pytest.raises(ConfigError, match="not a torchrun layout"):
        node_gpus(rank=1, local_rank=2, local_world=2, target_ranks=1, per_target=1, count=2)


def test_the_engine_gets_the_jobs_own_visible_ids():
    assert engine_visible((2, 3), "4,5,6,7") == "6,7"
    assert engine_visible((0, 1), "") == "0,1"
    with pytest.raises(ConfigError, match="GPU 4 asked for and CUDA_VISIBLE_DEVICES=4,5 lists 2"):
        engine_visible((3, 4), "4,5")
    cuda0 = torch.device("cuda", 0)                 # a device object; no GPU is touched
    assert engine_devices(cuda0, {"tensor_parallel_size": 2}, visible="4,5,6", gpus=(1, 2)) == \
        {"CUDA_VISIBLE_DEVICES": "5,6"}
    assert engine_devices(torch.device("cpu"), {"tensor_parallel_size": 2}, gpus=(0, 1)) == {}


def test_the_job_reads_its_place_from_torchrun(monkeypatch):
    """What the trainer's set-up asks (split.cuda_index) and what the target rank gives its engine
    (gpus.for_job) come from RANK / LOCAL_RANK / LOCAL_WORLD_SIZE and the engine's --engine-arg."""
    cfg = dflash_cfg("o", "t", target_engine="vllm", target_ranks=2,
                     engine_args=("tensor_parallel_size=2", "pipeline_parallel_size=2"))
    assert per_target(cfg) == 4 and per_target(dflash_cfg("o", "t", target_ranks=1)) == 1
    env = {"RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    assert for_job(cfg, 16, env).engine == (4, 5, 6, 7)
    for k, v in {**env, "RANK": "3", "LOCAL_RANK": "3"}.items():
        monkeypatch.setenv(k, v)
    assert split.cuda_index(cfg)(10) == 9             # the second drafter, after 2 x 4 engine GPUs
