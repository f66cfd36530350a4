"""``regenerate`` through a real ``vllm serve`` (``.venv-vllm``): the answers are vLLM's own greedy
ones, a server killed midway and restarted loses and duplicates nothing, and every record names
the engine and its version.

vLLM's own answers come from its offline ``LLM.chat`` in a process of its own (another engine
instance, not the server regenerate talks to), on the same prompts and settings. Two server
starts and one offline engine: about three minutes on 2 loaded cores; ``make test-engines``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dflash_prep.engine.vllm_server import free_port, vllm_server
from dflash_prep.regenerate.engines import Sampling
from dflash_prep.regenerate.regenerate import RegenerateConfig, run
from dflash_prep.regenerate.store import entries_on_disk

from dflash_prep.tests.engine.regen_kill import build_regen_target, kill_midway, write_prompts

pytestmark = pytest.mark.engine
MAX_TOKENS = 12
N = 16
N_KILL = 48

OFFLINE = textwrap.dedent('''
    import json, sys

    from vllm import LLM, SamplingParams


    def main(target, corpus, out, max_tokens):
        convs = [json.loads(ln)["messages"] for ln in open(corpus)]
        llm = LLM(model=target, dtype="float32", enforce_eager=True, seed=0, max_model_len=2048, max_num_seqs=4)
        outs = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=int(max_tokens)), use_tqdm=False)
        json.dump([o.outputs[0].text for o in outs], open(out, "w"))


    if __name__ == "__main__":   # vLLM's engine core is a spawned process
        main(*sys.argv[1:])
''')


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Single-turn prompts (the answer is the whole generated turn, as LLM.chat gives it)."""
    return write_prompts(tmp_path_factory.mktemp("regen-vllm") / "prompts.jsonl", N)


@pytest.fixture(scope="module")
def target(engine_python, tmp_path_factory) -> Path:
    return build_regen_target(tmp_path_factory.mktemp("regen-target") / "target")


@pytest.fixture(scope="module")
def served(target, tmp_path_factory):
    with vllm_server(target, log=tmp_path_factory.mktemp("serve") / "vllm.log", max_num_seqs=4) as srv:
        yield srv


def _cfg(base_url: str, model: str, corpus: Path, out: Path, **kw) -> RegenerateConfig:
    opts = dict(engine="openai", base_url=f"{base_url}/v1", model=model, concurrency=2, retries=1, timeout=120,
                sampling=Sampling(temperature=0.0, max_tokens=MAX_TOKENS))
    return RegenerateConfig(inputs=(str(corpus),), out=out, **{**opts, **kw})


def _answers(out: Path) -> list[str]:
    return [json.loads(ln)["messages"][-1]["content"] for ln in (out / "chat.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_run(served, corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one") / "out"
    s = run(_cfg(served.base_url, served.model, corpus, out))
    assert s["stats"]["records_written"] == N and not s["stats"]["failed"], s["stats"]
    return out


def test_the_answers_are_vllms_own_greedy_outputs(target, engine_python, corpus, one_run, tmp_path):
    script = tmp_path / "offline.py"
    script.write_text(OFFLINE)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    proc = subprocess.run([str(engine_python), str(script), str(target), str(corpus), str(tmp_path / "o.json"),
                           str(MAX_TOKENS)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    offline = json.loads((tmp_path / "o.json").read_text())
    answers = _answers(one_run)
    assert len(answers) == N and all(answers), answers
    assert answers == offline, [(i, a, b) for i, (a, b) in enumerate(zip(answers, offline)) if a != b]


def test_every_record_names_the_engine_and_its_version(served, one_run):
    recs = [json.loads(ln)["regenerate"] for ln in (one_run / "chat.jsonl").read_text().splitlines()]
    assert [r["record"] for r in recs] == list(range(N))
    version = served.version.split()[-1]          # "vllm-cpu 0.32.0": the distribution, then what /version says
    assert {json.dumps(r["target"]["server"]) for r in recs} == {json.dumps({"software": "vllm", "version": version})}
    assert all(r["target"]["engine"] == "openai" and r["target"]["name"] == served.model for r in recs)


def test_a_server_killed_midway_then_restarted_loses_and_duplicates_nothing(target, tmp_path):
    """N_KILL records, the server killed once 4 are on disk (the client held still meanwhile,
    tests/engine/regen_kill.py), a restarted server for the rest: each record once, in order, and
    the bytes of the answers a straight run against the restarted server writes."""
    corpus, out, port = write_prompts(tmp_path / "prompts.jsonl", N_KILL), tmp_path / "out", free_port()
    with vllm_server(target, log=tmp_path / "vllm.log", port=port, max_num_seqs=4) as srv:
        cmd = [sys.executable, "-m", "dflash_prep.cli", "regenerate", str(corpus), "--out", str(out), "--base-url",
               f"{srv.base_url}/v1", "--model", srv.model, "--concurrency", "1", "--max-tokens", str(MAX_TOKENS),
               "--temperature", "0", "--retries", "1", "--timeout", "60"]
        client = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
        at_kill = kill_midway(client, out, srv.pid, after=4)
        _, err = client.communicate(timeout=120)
    before = entries_on_disk(out)
    assert client.returncode == 1, err[-2000:]
    assert "cannot reach the server" in err, err[-2000:]
    assert 4 <= at_kill <= before < N_KILL, f"the server died after {at_kill} of {N_KILL} records: not midway"
    assert json.loads((out / "regenerate.json").read_text())["complete"] is False

    with vllm_server(target, log=tmp_path / "vllm2.log", port=port, max_num_seqs=4) as srv:
        s = run(_cfg(srv.base_url, srv.model, corpus, out))
        straight = run(_cfg(srv.base_url, srv.model, corpus, tmp_path / "straight", concurrency=1))
    assert (s["records"], s["stats"]["records_done"]) == (N_KILL - before, N_KILL)
    assert straight["stats"]["records_written"] == N_KILL and not straight["stats"]["failed"], straight["stats"]
    recs = [json.loads(ln) for ln in (out / "chat.jsonl").read_text().splitlines()]
    assert [r["regenerate"]["record"] for r in recs] == list(range(N_KILL))  # each record once, in order
    assert _answers(out) == _answers(tmp_path / "straight")                 # and what one run writes
