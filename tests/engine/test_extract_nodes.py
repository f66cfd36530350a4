"""A states cache built by several engines at once equals the single-engine build's bit for bit
(``--batch-tokens 1``: each sample's states a function of the sample alone), with the real vLLM
engine (marked ``engine``), on the tiny target and data of test_extract.py. One single-engine
build (the module fixture) is the reference of both ways to spread a build:

- ``extract --node-rank i --num-nodes 2``: two node processes at once into one folder; ``dflash-prep
  verify`` passes the cache; a node's rerun rebuilds only its own lost shard and touches none of
  the other node's; a node of other options is refused in one line. The driver's logic without
  vLLM: test_nodes.py.
- ``extract --engine ray --replicas 2``: two engine replicas as tasks of a local Ray, each building
  its share of the one cache (dflash_prep/engine/ray_replicas.py). Resources without an engine:
  test_extract_ray.py, test_ray_replicas.py.

Eight engine starts in all (about a minute each on 2 cores, two at a time in each test)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from dflash_prep.engine import nodes
from dflash_prep.formats import states as fmt

pytestmark = pytest.mark.engine


def _cmd(world, out, *more):
    return [sys.executable, "-m", "dflash_prep.cli", "extract", str(world["data"]), "--target", str(world["target"]),
            "--objective", "dflash", "--draft-layers", "1", "--loss", "kl", "--dtype", "bf16", "--shard-mb", "0.25",
            "--batch-tokens", "1", "--engine-arg", "dtype=float32", "--timeout", "300", "--out", str(out), *more]


def _env(world):
    return {**os.environ, "DFLASH_PREP_VLLM_PYTHON": world["py"]}


def _run(world, out, *more, rc=0):
    r = subprocess.run(_cmd(world, out, *more), env=_env(world), capture_output=True, text=True, timeout=600)
    assert r.returncode == rc, (r.stdout[-2000:], r.stderr[-3000:])
    return r


def _node(rank):
    return ("--node-rank", str(rank), "--num-nodes", "2")


def _stamps(out, names):
    return {n: ((out / n).stat().st_ino, (out / n).stat().st_mtime_ns) for n in names}


@pytest.fixture(scope="module")
def single(world, tmp_path_factory):
    """The single-engine build: the reference both ways of spreading a build must equal."""
    out = tmp_path_factory.mktemp("single") / "cache"
    _run(world, out)
    return out


def _same_shards(out, single):
    """``out`` is complete and holds the single build's shard table and bytes."""
    h, h1 = fmt.read_header(out), fmt.read_header(single)
    assert h["complete"] and len(h["plan"]) >= 4 and h["shards"] == h1["shards"], \
        "the shard table differs from the single build's"
    for e in h1["shards"]:
        assert (out / e["file"]).read_bytes() == (single / e["file"]).read_bytes(), e["file"]
    return h, h1


def test_two_nodes_at_once_build_the_single_engine_cache_bit_for_bit(world, single, tmp_path):
    out = tmp_path / "cache"
    procs = [subprocess.Popen(_cmd(world, out, *_node(i)), env=_env(world), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    outs = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-3000:] for o in outs]
    said = " ".join(o[0] for o in outs)
    assert f"wrote {out} (node " in said and "the cache complete" in said, said
    h, h1 = _same_shards(out, single)
    lens = np.load(world["data"] / "lengths.npy")
    share0, share1 = (nodes.node_share(nodes.shard_tokens(h["plan"], lens), i, 2) for i in (0, 1))
    assert share0 and share1, h["plan"]
    v = subprocess.run([sys.executable, "-m", "dflash_prep.cli", "verify", str(out)], capture_output=True, text=True)
    assert v.returncode == 0 and "verified" in v.stderr + v.stdout, v.stderr[-2000:]
    assert not [f.name for f in out.iterdir() if f.name.startswith(".")], "temp files left behind"

    # a rerun of a node of a complete cache: up to date, no engine started
    logs = {f.name: f.stat().st_size for f in out.glob("*.log")}
    t0 = time.monotonic()
    r = _run(world, out, *_node(0))
    assert "is complete; nothing to do" in r.stdout and time.monotonic() - t0 < 60, r.stdout
    assert {f.name: f.stat().st_size for f in out.glob("*.log")} == logs

    # one shard of each node lost: node 0's rerun rebuilds its own alone, bit for bit, and touches
    # none of node 1's; the cache is then incomplete, naming node 1's shard, until node 1 reruns
    lost0, lost1 = fmt.shard_name(share0[-1]), fmt.shard_name(share1[0])
    (out / lost0).unlink()
    (out / lost1).unlink()
    keep1 = _stamps(out, [fmt.shard_name(k) for k in share1[1:]])
    keep0 = _stamps(out, [fmt.shard_name(k) for k in share0[:-1]])
    r = _run(world, out, *_node(0))
    assert f"node 0 of 2: its share is in place (1 of its {len(share0)} shard(s) written now)" in r.stdout, r.stdout
    assert f"missing (node 1: shard(s) {share1[0]})" in r.stdout, r.stdout
    assert (out / lost0).read_bytes() == (single / lost0).read_bytes() and not (out / lost1).exists()
    assert _stamps(out, keep1) == keep1 and _stamps(out, keep0) == keep0, "a rerun touched shards it did not lose"
    v = subprocess.run([sys.executable, "-m", "dflash_prep.cli", "verify", str(out)], capture_output=True, text=True)
    lines = [ln for ln in v.stderr.splitlines() if ln.strip()]
    assert v.returncode == 1 and len(lines) == 1 and f"shard(s) {share1[0]} of {len(h['plan'])} missing" in lines[0], \
        v.stderr[-2000:]

    # a node started with other options is refused in one line, before its engine, touching nothing
    before = {f.name: f.read_bytes() for f in out.iterdir() if f.is_file() and f.suffix != ".log"}
    r = _run(world, out, *_node(1), "--shard-mb", "0.5", rc=1)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "holds a states cache of other settings" in lines[0] and "Traceback" not in r.stderr
    assert {f.name: f.read_bytes() for f in out.iterdir() if f.is_file() and f.suffix != ".log"} == before

    r = _run(world, out, *_node(1))
    assert f"wrote {out} (node 1 of 2: 1 shard(s) now, the cache complete)" in r.stdout, r.stdout
    assert fmt.read_header(out)["shards"] == h1["shards"] and (out / lost1).read_bytes() == (single / lost1).read_bytes()
    fmt.verify_states(out)


@pytest.mark.timeout(1200)
def test_two_ray_replicas_build_the_single_engine_cache_bit_for_bit(world, single, tmp_path):
    out = tmp_path / "cache"
    env = {**_env(world), "RAY_DISABLE_USAGE_STATS": "1"}
    r = subprocess.run(_cmd(world, out, "--engine", "ray", "--replicas", "2"), env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert "2 engine replicas on Ray" in r.stdout + r.stderr, r.stdout[-2000:]
    _same_shards(out, single)
    logs = sorted(f.name for f in out.glob("*.log"))
    assert len(logs) >= 2, logs                        # one engine per replica, each its own log
    v = subprocess.run([sys.executable, "-m", "dflash_prep.cli", "verify", str(out)], capture_output=True, text=True)
    assert v.returncode == 0, v.stderr[-2000:]
