"""``regenerate`` across two real ``vllm serve`` processes (``.venv-vllm``), one SIGKILLed midway:
its requests go to the other, every record is written exactly once, and the output at
temperature 0 is the one a run against a single server writes, byte for byte.

The stand-in tests (tests/regenerate/test_servers.py) show the balancing order and a hung
server; this one shows the real failure: the whole engine (API server, engine core, worker)
gone at once, a request in flight on it. ``--concurrency 1``: every request goes to the first
server named (ties by order) until it dies, then to the other, so the kill lands midway however
fast the tiny model answers. (At ``--concurrency 2`` two CPU servers on the 2 cores of this
machine starve each other: the one that answers first gets all but one request, that one takes
the whole run, and the writer, in input order, writes everything at the end.) Two server starts:
about a minute and a half on 2 cores; ``make test-engines``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_prep.engine.vllm_server import vllm_server
from dflash_prep.regenerate.engines import Sampling
from dflash_prep.regenerate.regenerate import RegenerateConfig, run

from dflash_prep.tests.engine.regen_kill import build_regen_target, kill_midway, write_prompts

pytestmark = pytest.mark.engine
MAX_TOKENS = 16
N = 40
KILL_AFTER = 4  # records on disk when the second server is killed


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_prompts(tmp_path_factory.mktemp("failover") / "prompts.jsonl", N)


@pytest.fixture(scope="module")
def target(engine_python, tmp_path_factory) -> Path:
    return build_regen_target(tmp_path_factory.mktemp("failover-target") / "target")


def _records(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "chat.jsonl").read_text().splitlines()]


def test_two_servers_one_killed_midway_lose_and_duplicate_nothing(target, corpus, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    with vllm_server(target, log=tmp_path / "a.log", max_num_seqs=4) as a, \
            vllm_server(target, log=tmp_path / "b.log", max_num_seqs=4) as b:
        # each server alone: the reference, twice over (same engine, same weights: same bytes)
        for srv, out in ((a, one), (b, tmp_path / "one-b")):
            ref = run(RegenerateConfig(inputs=(str(corpus),), out=out, base_url=f"{srv.base_url}/v1",
                                       model=srv.model, concurrency=4, retries=1, timeout=120,
                                       sampling=Sampling(temperature=0.0, max_tokens=MAX_TOKENS)))
            assert ref["stats"]["records_written"] == N and not ref["stats"]["failed"], ref["stats"]
        assert (tmp_path / "one-b" / "chat.jsonl").read_bytes() == (one / "chat.jsonl").read_bytes()

        cmd = [sys.executable, "-m", "dflash_prep.cli", "regenerate", str(corpus), "--out", str(two),
               "--base-url", f"{b.base_url}/v1", "--base-url", f"{a.base_url}/v1", "--model", a.model,
               "--concurrency", "1", "--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--retries", "1",
               "--timeout", "120"]
        client = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
        at_kill = kill_midway(client, two, b.pid, after=KILL_AFTER)   # the client held still meanwhile
        stdout, err = client.communicate(timeout=300)
    assert client.returncode == 0, err[-3000:]
    assert KILL_AFTER <= at_kill < N, f"the server died after {at_kill} of {N} records: not midway"
    assert err.count(f"warning: server {b.base_url}/v1 is down") == 1, err[-3000:]

    recs = _records(two)
    assert [r["regenerate"]["record"] for r in recs] == list(range(N))          # each record once, in order
    mine = [json.dumps(r["messages"]) for r in recs]
    theirs = [json.dumps(r["messages"]) for r in _records(one)]
    assert mine == theirs, [(i, x, y) for i, (x, y) in enumerate(zip(mine, theirs)) if x != y][:3]
    assert (two / "chat.jsonl").read_bytes() == (one / "chat.jsonl").read_bytes()   # provenance too

    killed, alive = json.loads((two / "regenerate.json").read_text())["stats"]["last_run"]["servers"]
    assert (killed["url"], alive["url"]) == (f"{b.base_url}/v1", f"{a.base_url}/v1")
    assert killed["died"] and alive["died"] is None, (killed, alive)
    assert killed["requests"] >= at_kill and alive["requests"] > 0 and killed["requests"] + alive["requests"] == N
    assert killed["software"] == alive["software"] == "vllm" and killed["version"] == alive["version"]
    assert "servers" in stdout and "(died)" in stdout
    print(f"killed after {at_kill} of {N} records; requests: killed {killed['requests']}, other {alive['requests']}; "
          f"died: {killed['died']}")
