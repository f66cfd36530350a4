"""``extract --node-rank i --num-nodes N`` without vLLM: the share function's properties, and the
driver's part of a build across machines (one folder, concurrent node processes, one header,
completion, resume of one node's share, refusals) run with a stand-in engine whose states are a
fixed function of the tokens (:mod:`.fake_states_worker`). The same with the real engine, bit for
bit against a single build: test_extract_nodes.py (marker ``engine``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dflash_prep.engine import nodes
from dflash_prep.errors import ConfigError, FormatError
from dflash_prep.formats import states as fmt
from dflash_prep.formats.fileio import atomic_create_json

from dflash_prep.tests.train.dflash_fixtures import tiny_target


# ----------------------------------------------------------------------------- the share function
def check_shares(tokens, num_nodes: int) -> list[list[int]]:
    """Every property of :func:`nodes.node_share` for one plan and N: each shard exactly once,
    each share contiguous and ascending, ranks in order, the same answer twice, and each share's
    tokens within half a shard of T / N at each of its cuts."""
    t = np.asarray(tokens, np.int64)
    shares = [nodes.node_share(t, i, num_nodes) for i in range(num_nodes)]
    assert sorted(k for s in shares for k in s) == list(range(len(t))), shares
    flat = [k for s in shares for k in s]
    assert flat == list(range(len(t))), f"shares not contiguous in rank order: {shares}"
    assert shares == [nodes.node_share(list(t), i, num_nodes) for i in range(num_nodes)], "not deterministic"
    owners = nodes.shard_owners(t, num_nodes)
    assert all(owners[k] == i for i, s in enumerate(shares) for k in s)
    if t.size and t.sum() > 0:
        T, big = int(t.sum()), int(t.max())
        for i, s in enumerate(shares):
            got = int(t[s].sum())
            assert abs(got - T / num_nodes) <= big + 1e-9, (i, got, T / num_nodes, big, list(t))
    return shares


def test_node_share_is_disjoint_covering_contiguous_balanced_and_deterministic():
    rng = np.random.default_rng(0)
    for trial in range(300):
        n = int(rng.integers(0, 40))
        tokens = rng.integers(1, 5000, size=n)
        if trial % 5 == 0 and n:                       # the plan's shape: full shards, then a short last one
            tokens = np.full(n, 4096)
            tokens[-1] = int(rng.integers(1, 4096))
        for num in (1, 2, 3, 4, 7, 16, 64):
            check_shares(tokens, num)
    assert nodes.node_share([5, 5, 5], 0, 1) == [0, 1, 2]
    assert check_shares([10] * 8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert check_shares([10] * 3, 4) == [[0], [], [1], [2]]     # fewer shards than nodes: some idle
    assert check_shares([0, 0, 0, 0], 2) == [[0, 1], [2, 3]]    # no tokens at all: by count
    # by tokens, not by count: one huge shard (a sample longer than --shard-mb) is a share alone
    assert check_shares([100, 100, 100, 100, 1000, 100], 2) == [[0, 1, 2, 3], [4, 5]]


def test_node_share_refuses_a_rank_outside_the_nodes():
    for rank, num in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ConfigError) as e:
            nodes.node_share([1, 2, 3], rank, num)
        assert "\n" not in str(e.value) and f"--node-rank {rank} --num-nodes {num}" in str(e.value)


def test_atomic_create_json_keeps_the_first_file(tmp_path):
    p = tmp_path / "h.json"
    assert atomic_create_json(p, {"a": 1}, format="f", version=1)
    assert not atomic_create_json(p, {"a": 2}, format="f", version=1)
    assert json.loads(p.read_text()) == {"format": "f", "version": 1, "a": 1}
    assert sorted(f.name for f in tmp_path.iterdir()) == ["h.json"], "a temp was left behind"


# ----------------------------------------------------------------------------- the driver, stand-in engine
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A tiny target and 60 chats tokenized with it."""
    from dflash_prep.synth.synth import SynthConfig, synth
    from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize

    root = tmp_path_factory.mktemp("nodes")
    target = tiny_target()
    synth(SynthConfig(out=root / "corpus", profile="mini", n=60, seed=0))
    tokenize(TokenizeConfig(inputs=(str(root / "corpus" / "chat.jsonl"),), out=root / "data", tokenizer=str(target),
                            max_len=256, on_overflow="drop"))
    return {"target": target, "data": root / "data"}


OPTS = dict(objective="dflash", draft_layers=1, dtype="fp32", shard_mb=0.15, timeout_s=120.0)


def _node(data, out, delay: float = 0.0, **kw) -> subprocess.Popen:
    """One ``extract`` process with the stand-in engine (``kw``: ExtractConfig fields over OPTS)."""
    cfg = {**OPTS, "data": str(data["data"]), "target": str(data["target"]), "out": str(out), **kw}
    env = {**os.environ, "FAKE_STATES_DELAY": str(delay)}
    return subprocess.Popen([sys.executable, "-m", "dflash_prep.tests.engine.fake_states_worker", "--extract",
                             json.dumps(cfg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=Path(__file__).resolve().parents[2])


def _done(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _refused(p: subprocess.Popen) -> str:
    out, err = p.communicate(timeout=300)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert p.returncode == 1 and len(lines) == 1, err[-3000:]
    return lines[0]


def _stamps(out: Path, names) -> dict:
    return {n: ((out / n).stat().st_ino, (out / n).stat().st_mtime_ns) for n in names}


def _shares(out: Path, num: int) -> list[list[int]]:
    h = fmt.read_header(out)
    lens = np.load(Path(out / h["dataset"]["path"]) / "lengths.npy")
    return [nodes.node_share(nodes.shard_tokens(h["plan"], lens), i, num) for i in range(num)]


@pytest.mark.jobs   # concurrent node processes (~20 s each): `make test-jobs` (and CI), not `make test`
def test_two_concurrent_nodes_build_the_single_build_s_cache(data, tmp_path):
    single = _done(_node(data, tmp_path / "single"))
    assert single["complete"] and single["num_nodes"] == 1 and single["shards"] >= 4, single
    out = tmp_path / "cache"
    procs = [_node(data, out, 0.2, node_rank=i, num_nodes=2) for i in (0, 1)]
    got = [_done(p) for p in procs]
    assert any(g["complete"] for g in got), got               # the last to finish completed it
    shares = _shares(out, 2)
    assert [g["shards_written"] for g in got] == [len(s) for s in shares] and all(shares), (got, shares)
    h, h1 = fmt.read_header(out), fmt.read_header(tmp_path / "single")
    assert h["complete"] and h["shards"] == h1["shards"] and h["plan"] == h1["plan"]
    for e in h["shards"]:                                     # the shard files: the single build's bytes
        assert (out / e["file"]).read_bytes() == (tmp_path / "single" / e["file"]).read_bytes(), e["file"]
    fmt.verify_states(out)
    assert not [f.name for f in out.iterdir() if f.name.startswith(".")], "temp files left behind"
    assert not list(tmp_path.glob(".cache*.lock")), "a node's lock file was left behind"
    assert sorted(f.name for f in out.glob("*.log")) == ["extract.node-0-of-2.log", "extract.node-1-of-2.log"]
    again = _done(_node(data, out, node_rank=1, num_nodes=2))
    assert again["up_to_date"] and again["complete"]


@pytest.mark.jobs   # concurrent node processes (~20 s each): `make test-jobs` (and CI), not `make test`
def test_a_node_resumes_only_its_share_and_any_node_finishes(data, tmp_path):
    out = tmp_path / "cache"
    s0 = _done(_node(data, out, node_rank=0, num_nodes=2))
    share0, share1 = _shares(out, 2)
    assert not s0["complete"] and s0["present"] == len(share0) and s0["missing"] == {"1": share1}, s0
    line = nodes.progress_line({**s0, "missing": {int(k): v for k, v in s0["missing"].items()}}, out)
    assert f"holds {len(share0)} of {len(share0) + len(share1)} shards" in line, line
    assert f"node 1: shard(s) {fmt.index_ranges(share1)}" in line and "--node-rank R --num-nodes 2" in line, line
    with pytest.raises(FormatError) as e:                     # the trainer's open: one line naming them
        fmt.open_states(out)
    assert "\n" not in str(e.value) and f"shard(s) {fmt.index_ranges(share1)} of " in str(e.value), str(e.value)
    mine = _stamps(out, [fmt.shard_name(k) for k in share0])
    log = out / "extract.node-0-of-2.log"
    size = log.stat().st_size
    t0 = time.monotonic()
    r = _done(_node(data, out, node_rank=0, num_nodes=2))     # a rerun of node 0: nothing to build
    assert r["shards_written"] == 0 and not r["complete"], r
    assert _stamps(out, mine) == mine and log.stat().st_size == size, "the rerun rewrote or started something"
    # a shard of node 0 lost: its rerun rebuilds that one alone; a leftover temp of node 1 stays
    other_tmp = out / f".{fmt.shard_name(share1[0])}.99999.abcdefgh.tmp"
    own_tmp = out / f".in-{share0[0]:05d}.99999.abcdefgh.tmp"
    spool1 = out / ".spool-node-1-of-2.99999.abcdefgh.tmp"
    for f in (other_tmp, own_tmp):
        f.write_bytes(b"x")
    spool1.mkdir()
    (out / fmt.shard_name(share0[-1])).unlink()
    r = _done(_node(data, out, node_rank=0, num_nodes=2))
    assert r["shards_written"] == 1 and r["present"] == len(share0), r
    assert _stamps(out, [fmt.shard_name(k) for k in share0[:-1]]) == {k: v for k, v in mine.items()
                                                                       if k != fmt.shard_name(share0[-1])}
    assert other_tmp.exists() and spool1.exists() and not own_tmp.exists(), sorted(f.name for f in out.iterdir())
    other_tmp.unlink()
    spool1.rmdir()
    done = _done(_node(data, out, node_rank=1, num_nodes=2))  # the last node completes the cache
    assert done["complete"] and done["shards_written"] == len(share1)
    fmt.verify_states(out)
    # any node can verify and finish: a plain build over it is up to date; a lost shard of node 1
    (out / fmt.shard_name(share1[0])).unlink()
    with pytest.raises(FormatError, match="cannot read it"):
        fmt.open_states(out)
    r = _done(_node(data, out))                               # a plain extract (one node) rebuilds it
    assert r["complete"] and r["shards_written"] == 1, r
    fmt.verify_states(out)


@pytest.mark.jobs   # concurrent node processes (~20 s each): `make test-jobs` (and CI), not `make test`
def test_nodes_of_other_options_and_overlapping_builds_are_refused(data, tmp_path):
    out = tmp_path / "cache"
    slow = _node(data, out, 60.0, node_rank=0, num_nodes=2)
    deadline = time.monotonic() + 120
    while not (out / "extract.node-0-of-2.log").exists():    # node 0's worker started: it is building
        assert slow.poll() is None and time.monotonic() < deadline, slow.communicate()
        time.sleep(0.05)
    header = (out / fmt.HEADER_FILE).read_bytes()
    planted = [out / f".{fmt.shard_name(k)}.99999.abcdefgh.tmp" for k in range(16)]   # as node 0's in flight
    for f in planted:
        f.write_bytes(b"x")
    msg = _refused(_node(data, out, node_rank=1, num_nodes=2, shard_mb=0.05))   # another plan, other indices
    assert "holds a states cache of other settings" in msg, msg
    assert all(f.exists() for f in planted), "a node of other options deleted temps of the running node"
    msg = _refused(_node(data, out, node_rank=1, num_nodes=2, dtype="fp8"))
    assert "holds a states cache of other settings" in msg and "start node 1 with those options" in msg, msg
    msg = _refused(_node(data, out, node_rank=1, num_nodes=2, engine_args=[["gpu_memory_utilization", 0.5]]))
    assert "other settings" in msg, msg
    msg = _refused(_node(data, out, node_rank=0, num_nodes=2))
    assert "cache.node-0-of-2 is being written by another dflash-prep process" in msg, msg
    msg = _refused(_node(data, out))                          # a plain build while node 0 runs
    assert f"{out} is being built by node 0 of 2 (pid {slow.pid} on " in msg and "same --num-nodes" in msg, msg
    msg = _refused(_node(data, out, node_rank=0, num_nodes=3))
    assert "is being built by node 0 of 2" in msg, msg
    assert (out / fmt.HEADER_FILE).read_bytes() == header and not (out / "extract.node-1-of-2.log").exists(), \
        "a refused node touched the header or started its engine"
    slow.kill()
    slow.communicate()
    plain = _node(data, tmp_path / "plain", 60.0)            # and a node while a single build runs
    while not (tmp_path / "plain" / "extract.log").exists():
        assert plain.poll() is None and time.monotonic() < deadline + 120, plain.communicate()
        time.sleep(0.05)
    msg = _refused(_node(data, tmp_path / "plain", node_rank=1, num_nodes=2))
    assert f"is being built by a single-node extract (pid {plain.pid} on " in msg, msg
    plain.kill()
    plain.communicate()
    with pytest.raises(ConfigError, match="--overwrite with --num-nodes > 1"):
        from dflash_prep.engine.extract import ExtractConfig

        ExtractConfig(data=data["data"], target=data["target"], out=out, overwrite=True, node_rank=1, num_nodes=2)
