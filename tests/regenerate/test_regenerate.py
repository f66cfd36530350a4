"""regenerate: a real ``transformers serve`` (no mock server) on 127.0.0.1 with a tiny random
Qwen3 built here; kill-and-resume equals one run; the in-process engine gives the same text;
bad servers, models, requests and records get clear, counted errors; the output's folder
protocol survives torn writes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dflash_prep.errors import ConfigError, FingerprintMismatch, FormatError
from dflash_prep.regenerate.engines import (EngineError, Reply, Request, RequestFailed, Sampling, parse_reply,
                                            request_seed)
from dflash_prep.regenerate.regenerate import RegenerateConfig, run
from dflash_prep.regenerate.store import INDEX_FILE, Entry, Store, entries_on_disk
from dflash_prep.regenerate.turns import Conversation, apply_reasoning, slots
from dflash_prep.tokenize.records import RecordError

REPO = Path(__file__).resolve().parents[2]
with contextlib.suppress(ImportError):  # the machine is shared: one torch thread in this process too
    import torch

    torch.set_num_threads(1)
N_MESSAGES, N_SHAREGPT = 24, 12
MAX_TOKENS = 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="session")
def target(tmp_path_factory) -> Path:
    pytest.importorskip("torch")
    from dflash_prep.train.target_init import TargetSpec, build_target, default_texts

    spec = TargetSpec(vocab_size=512, hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, intermediate=128)
    return build_target(tmp_path_factory.mktemp("regen") / "target", spec, default_texts(60_000))


@pytest.fixture(scope="session")
def server(target, tmp_path_factory):
    """``transformers serve TARGET`` on a free port, CPU; shut down (SIGTERM, then SIGKILL) with
    its whole process group at the end, and checked: the server is reaped, and (Linux) no process
    of its group runs nor waits for this process to reap it. Zombies whose parent is another
    process are allowed: the server spawns its model's process and a multiprocessing resource
    tracker, which can outlive it by a moment and are then reparented to PID 1, the only process
    that can reap them (``killpg(pgid, 0)`` still finds a group whose members are all zombies)."""
    for mod in ("fastapi", "uvicorn"):
        pytest.importorskip(mod, reason="needs the serve extra: pip install 'dflash-prep[serve]'")
    from dflash_prep.bench.regenerate_speed import local_server

    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with local_server(target, "--log-level", "warning", log=log, timeout_s=180) as (url, _, proc):
        yield {"url": url, "model": str(target), "target": target}
    assert proc.returncode is not None
    if Path("/proc/self/stat").exists():
        assert _left_in_group(proc.pid) == []


def _left_in_group(pgid: int) -> list[tuple[int, str, int]]:
    """(pid, state, parent pid) of the processes of group ``pgid`` that run (any state but
    zombie Z or dead X) or are zombies this process should reap; read from /proc here rather
    than through the helper under test."""
    out = []
    for d in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError):
            stat = (d / "stat").read_bytes()
            state, ppid, pgrp = stat[stat.rindex(b")") + 2:].split()[:3]
            if int(pgrp) == pgid and (state not in (b"Z", b"X") or int(ppid) == os.getpid()):
                out.append((int(d.name), state.decode(), int(ppid)))
    return out


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> list[str]:
    """36 conversations in two schemas: prompt-only, multi-turn with answers, system prompts."""
    d = tmp_path_factory.mktemp("corpus")
    words = "list tuple loop value key string parse file number graph".split()
    msgs = []
    for i in range(N_MESSAGES):
        w = words[i % len(words)]
        if i % 3 == 0:
            m = [{"role": "user", "content": f"Explain {w} number {i}."}]
        elif i % 3 == 1:
            m = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"What is a {w}?"},
                 {"role": "assistant", "content": "An old answer."}, {"role": "user", "content": f"And {i}?"}]
        else:
            m = [{"role": "user", "content": f"Show {w} {i}"}, {"role": "assistant", "content": "old"},
                 {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "old too"}]
        msgs.append({"messages": m})
    share = [{"conversations": [{"from": "human", "value": f"Prompt {i}: {words[-1 - i % 10]}s?"}]}
             for i in range(N_SHAREGPT)]
    (d / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in msgs))
    (d / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in share))
    return [str(d / "a.jsonl"), str(d / "b.jsonl")]


def _cfg(server, corpus, out, **kw) -> RegenerateConfig:
    opts = dict(engine="openai", base_url=server["url"], model=server["model"], concurrency=4, retries=2, timeout=60,
                sampling=Sampling(temperature=0.0, max_tokens=MAX_TOKENS))
    opts.update(kw)
    return RegenerateConfig(inputs=tuple(corpus), out=out, **opts)


@pytest.fixture(scope="session")
def one_run(server, corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "out"
    s = run(_cfg(server, corpus, out))
    assert s["stats"]["records_written"] == N_MESSAGES + N_SHAREGPT and not s["stats"]["failed"]
    return out


def _messages(out: Path) -> list:
    return [json.loads(ln)["messages"] for ln in (out / "chat.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- real server
def test_kill_midway_resume_equals_one_run(server, corpus, one_run, tmp_path, target):
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "dflash_prep.cli", "regenerate", *corpus, "--out", str(out), "--base-url",
           server["url"], "--model", server["model"], "--concurrency", "4", "--max-tokens", str(MAX_TOKENS),
           "--temperature", "0", "--retries", "2", "--timeout", "60"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while entries_on_disk(out) < 4 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    before = entries_on_disk(out)
    total = N_MESSAGES + N_SHAREGPT
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    assert 4 <= before < total, f"killed after {before} of {total} records: not midway"
    assert "regenerate: 36 records" in proc.stderr.read().decode()  # plain log lines off a terminal
    assert json.loads((out / "regenerate.json").read_text())["complete"] is False

    s = run(_cfg(server, corpus, out))
    assert (s["records"], s["stats"]["records_done"]) == (total - before, total)
    assert (out / "chat.jsonl").read_bytes() == (one_run / "chat.jsonl").read_bytes()
    ref = json.loads((one_run / "regenerate.json").read_text())["stats"]
    for k in ("records_written", "turns", "truncated_turns", "prompt_tokens", "completion_tokens"):
        assert s["stats"][k] == ref[k], k

    mtime = (out / "chat.jsonl").stat().st_mtime_ns
    again = run(_cfg(server, corpus, out, concurrency=1))  # a finished run: nothing to do
    assert again["up_to_date"] and (out / "chat.jsonl").stat().st_mtime_ns == mtime

    from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize

    meta = tokenize(TokenizeConfig(inputs=(str(out),), out=tmp_path / "tok", tokenizer=str(target), max_len=4096))
    assert meta["counts"]["samples"] == total, meta["counts"]


@pytest.mark.jobs   # a second server started and killed (~13 s): `make test-jobs` (and CI), not `make test`
def test_two_servers_one_killed_midway_equals_one_run(server, corpus, one_run, tmp_path, capfd, monkeypatch):
    """A second real ``transformers serve`` beside the session's, named first (so ties give it
    work); its process group SIGKILLed once a few records are written: its requests go to the
    other server, each record is written once, and the output is the one-server run's, byte for
    byte (stand-ins for the balancing order and hung servers: test_servers.py)."""
    from dflash_prep.bench.regenerate_speed import local_server

    out, total = tmp_path / "o", N_MESSAGES + N_SHAREGPT
    with local_server(server["target"], "--log-level", "warning", log=tmp_path / "serve2.log",
                      timeout_s=180) as (url2, _, proc), ThreadPoolExecutor(1) as ex:
        # The kill happens in the client's own writer, right after the commit that brings the output
        # to 4 records: midway however fast or loaded the machine. Polling the output from this
        # thread once saw all 36 written between two polls on a loaded CI machine.
        commit, at_kill = Store.commit, []

        def commit_then_kill(store, entries):
            commit(store, entries)
            if not at_kill and store.done >= 4:
                os.killpg(proc.pid, signal.SIGKILL)
                at_kill.append(store.done)

        monkeypatch.setattr(Store, "commit", commit_then_kill)
        s = ex.submit(run, _cfg(server, corpus, out, base_url=(url2, server["url"]))).result(timeout=300)
    assert at_kill and 4 <= at_kill[0] < total, f"killed after {at_kill} of {total} records: not midway"
    assert s["stats"]["records_written"] == total and not s["stats"]["failed"]
    recs = [json.loads(ln) for ln in (out / "chat.jsonl").read_text().splitlines()]
    assert [r["regenerate"]["record"] for r in recs] == list(range(total))     # each record once, in order
    assert (out / "chat.jsonl").read_bytes() == (one_run / "chat.jsonl").read_bytes()
    killed, alive = json.loads((out / "regenerate.json").read_text())["stats"]["last_run"]["servers"]
    assert (killed["url"], alive["url"]) == (url2, server["url"])
    assert killed["died"] and alive["died"] is None and killed["requests"] > 0 and alive["requests"] > 0
    assert killed["requests"] + alive["requests"] == s["requests"]
    assert capfd.readouterr().err.count(f"warning: server {url2} is down") == 1


def test_crash_after_the_last_record_finishes_without_the_server(server, corpus, one_run, tmp_path):
    out = tmp_path / "o"
    shutil.copytree(one_run, out)
    hdr = json.loads((out / "regenerate.json").read_text())
    hdr["complete"] = False  # as if killed between the last commit and the final header
    (out / "regenerate.json").write_text(json.dumps(hdr))
    s = run(_cfg(server, corpus, out, base_url=f"http://127.0.0.1:{_free_port()}/v1"))  # nothing listens there
    assert s["records"] == 0 and s["stats"]["records_written"] == N_MESSAGES + N_SHAREGPT
    assert json.loads((out / "regenerate.json").read_text())["complete"] is True


def test_records_carry_provenance_in_input_order(one_run, corpus):
    lines = [json.loads(ln) for ln in (one_run / "chat.jsonl").read_text().splitlines()]
    assert [r["regenerate"]["record"] for r in lines] == list(range(N_MESSAGES + N_SHAREGPT))
    first, multi, share = lines[0], lines[2], lines[N_MESSAGES]
    assert first["regenerate"]["source"] == {"file": corpus[0], "row": 0, "line": 1}
    assert share["regenerate"]["source"]["file"] == corpus[1]
    assert first["regenerate"]["sampling"]["max_tokens"] == MAX_TOKENS
    assert [t["message"] for t in multi["regenerate"]["turns"]] == [1, 3]  # --turns all: both answers rewritten
    assert all(m["content"] not in ("old", "old too") for m in multi["messages"] if m["role"] == "assistant")
    for r in lines:
        for t in r["regenerate"]["turns"]:
            assert t["truncated"] == (t["finish_reason"] == "length")
            assert 0 < t["completion_tokens"] <= MAX_TOKENS and t["prompt_tokens"] > 0
    assert share["messages"][0] == {"role": "user", "content": "Prompt 0: graphs?"}
    # transformers serve names no software in /v1/models (owned_by is the repo's namespace) and has
    # no /version: the provenance says so rather than guess (a vLLM server: tests/engine)
    assert {r["regenerate"]["target"]["server"]["software"] for r in lines} == {None}
    assert {r["regenerate"]["target"]["engine"] for r in lines} == {"openai"}


def test_hf_engine_writes_the_server_tokens(server, corpus, one_run, tmp_path):
    """Same weights, greedy decoding: ``--engine hf`` (batched, left-padded) generates the same
    tokens as the server (batch of 1). The *texts* differ where ``transformers serve``
    post-processes: for Qwen-family models it runs the raw decode, special tokens kept, through
    its response parser (``transformers.cli.serving.utils._RESPONSE_TEMPLATE_FALLBACKS``), which
    trims whitespace around the content, closes it at ``<|endoftext|>`` and splits ``<think>``
    off. The hf engine writes the plain decode with special tokens skipped, as vLLM and SGLang
    return it. So, on every record's first turn (the same prompt for both engines): equal token
    counts, and the server's text equals that parser applied to the hf engine's tokens. Later
    turns see different contexts once a first turn's texts differ, so they are not compared."""
    from transformers.cli.serving.utils import _RESPONSE_TEMPLATE_FALLBACKS

    from dflash_prep.regenerate.engines import HFEngine
    from dflash_prep.tokenize.records import SHAREGPT_ROLES

    sampling = Sampling(temperature=0.0, max_tokens=MAX_TOKENS)
    cfg = RegenerateConfig(inputs=tuple(corpus), out=tmp_path / "hf", engine="hf", target=server["target"],
                           batch_size=4, device="cpu", sampling=sampling)
    s = run(cfg)
    assert s["stats"]["records_written"] == N_MESSAGES + N_SHAREGPT
    hf = [json.loads(ln) for ln in (tmp_path / "hf" / "chat.jsonl").read_text().splitlines()]
    ref = [json.loads(ln) for ln in (one_run / "chat.jsonl").read_text().splitlines()]

    raw = [json.loads(ln) for f in corpus for ln in Path(f).read_text().splitlines()]
    convs = [r["messages"] if "messages" in r else
             [{"role": SHAREGPT_ROLES[m["from"]], "content": m["value"]} for m in r["conversations"]] for r in raw]
    engine = HFEngine(target=server["target"], sampling=sampling, batch_size=4, device="cpu")
    reqs = [Conversation(cfg, i, {}, "", c).request() for i, c in enumerate(convs)]
    replies = engine.chat_batch(reqs)
    template = next(v for k, v in _RESPONSE_TEMPLATE_FALLBACKS.items() if "qwen3" in k)
    differ = 0
    for req, rep, h, r in zip(reqs, replies, hf, ref):
        th, tr = h["regenerate"]["turns"][0], r["regenerate"]["turns"][0]
        assert (th["prompt_tokens"], th["completion_tokens"], th["finish_reason"]) == \
               (tr["prompt_tokens"], tr["completion_tokens"], tr["finish_reason"])
        assert h["messages"][th["message"]]["content"] == rep.content  # the run wrote the plain decode
        prefix = engine.tok.decode(engine._prompt_ids(req))
        served = engine.tok.parse_response(engine.tok.decode(list(rep.token_ids)), template, prefix=prefix)
        assert r["messages"][tr["message"]]["content"] == served.get("content", ""), engine.tok.decode(rep.token_ids)
        differ += rep.content != served.get("content", "")
    print(f"first turns whose texts differ only by the server's parsing: {differ} of {len(reqs)}")

    import torch  # sampled batches: seeded by the batch's first request, the caller's RNG untouched

    engine.sampling = Sampling(temperature=1.0, top_p=0.9, max_tokens=6, seed=3)
    seeded = [Request(q.messages, request_seed(3, i, 1), None) for i, q in enumerate(reqs[:4])]
    state = torch.random.get_rng_state()
    a, b = engine.chat_batch(seeded), engine.chat_batch(seeded)
    assert [r.token_ids for r in a] == [r.token_ids for r in b] and torch.equal(state, torch.random.get_rng_state())
    assert hf[0]["regenerate"]["target"]["revision"].startswith("local-")


def test_unreachable_server(corpus, tmp_path):
    cfg = RegenerateConfig(inputs=tuple(corpus), out=tmp_path / "o", base_url=f"http://127.0.0.1:{_free_port()}/v1",
                           model="m", retries=1, timeout=5)
    with pytest.raises(EngineError, match=r"cannot reach the server at http://127\.0\.0\.1:\d+/v1/models "
                                          r"\(ConnectionRefusedError.*2 tries\)\. Start the server"):
        run(cfg)


def test_wrong_model_name(server, corpus, tmp_path):
    with pytest.raises(EngineError, match=r"model 'no-such-model' is not served at .*: it lists '.*target' and "
                                          r"answered HTTP 400.*pinned.*Pass --model with a served name"):
        run(_cfg(server, corpus, tmp_path / "o", model="no-such-model"))
    assert entries_on_disk(tmp_path / "o") == 0


def test_refused_request_fails_or_is_counted(server, corpus, tmp_path):
    # transformers serve refuses fields it does not know (vLLM would take top_k): a real HTTP 422
    refused = Sampling(max_tokens=4, extra_body={"top_k": 5})
    with pytest.raises(RequestFailed, match=r"a\.jsonl:1 message 1: the server refused the request, HTTP 422: "
                                            r".*top_k") as e:
        run(_cfg(server, corpus, tmp_path / "fail", sampling=refused))
    assert e.value.kind == "refused" and entries_on_disk(tmp_path / "fail") == 0

    s = run(_cfg(server, corpus, tmp_path / "skip", sampling=refused, on_error="skip"))
    total = N_MESSAGES + N_SHAREGPT
    assert s["stats"]["failed"] == {"refused": total} and s["stats"]["records_written"] == 0
    logged = [json.loads(ln) for ln in (tmp_path / "skip" / "failures.log").read_text().splitlines()]
    assert [f["record"] for f in logged] == list(range(total)) and {f["kind"] for f in logged} == {"refused"}
    assert "HTTP 422" in s["failures"][0]


def test_server_error_is_retried_then_reported(server, corpus, tmp_path):
    # A forced end-of-sequence token outside the vocabulary: transformers serve (5.25) takes the
    # generation_config (it parses the JSON, not the token ids), and generate's
    # ForcedEOSTokenLogitsProcessor raises IndexError indexing the logits at the last step; the
    # model's process reports it as a RuntimeError, which the server answers with a real HTTP 500
    # (a ValueError, e.g. unparsable JSON, is a 400). max_tokens=1: the first step is the last,
    # whatever the random weights generate.
    broken = Sampling(max_tokens=1, extra_body={"generation_config": json.dumps({"forced_eos_token_id": 1_000_000})})
    t0 = time.monotonic()
    with pytest.raises(RequestFailed, match=r"a\.jsonl:1 message 1: .* answered HTTP 500.*\(2 tries\); check the "
                                            r"server's log") as e:
        run(_cfg(server, corpus, tmp_path / "o", sampling=broken, retries=1, concurrency=1))
    assert e.value.kind == "server_error" and time.monotonic() - t0 >= 0.375  # one backoff (0.5 s -25%)


def test_bad_record_fails_with_its_line_or_is_counted(server, tmp_path):
    c = tmp_path / "c.jsonl"
    c.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
                 + json.dumps({"messages": [{"role": "system", "content": "no prompt"}]}) + "\n"
                 + json.dumps({"messages": [{"role": "user", "content": "bye"}]}) + "\n")
    with pytest.raises(RecordError, match=r"c\.jsonl:2: no non-empty user message"):
        run(_cfg(server, [str(c)], tmp_path / "fail", sampling=Sampling(max_tokens=2)))
    assert entries_on_disk(tmp_path / "fail") == 1  # the record before the bad one is kept
    s = run(_cfg(server, [str(c)], tmp_path / "fail", sampling=Sampling(max_tokens=2), on_error="skip"))
    assert s["stats"]["failed"] == {"bad_input": 1} and s["stats"]["records_written"] == 2


def test_plain_text_prompts(server, tmp_path):
    c = tmp_path / "p.jsonl"
    c.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(["Say hi.", "Count."])))
    s = run(_cfg(server, [str(c)], tmp_path / "o", format="text", text_field="prompt", sampling=Sampling(max_tokens=3)))
    assert s["stats"]["records_written"] == 2
    msgs = _messages(tmp_path / "o")
    assert [[m["role"] for m in r] for r in msgs] == [["user", "assistant"]] * 2 and msgs[1][0]["content"] == "Count."


def test_cli_error_is_one_line(corpus, tmp_path):
    from typer.testing import CliRunner

    from dflash_prep.cli import app

    r = CliRunner().invoke(app, ["regenerate", *corpus, "--out", str(tmp_path / "o"), "--base-url",
                                 f"http://127.0.0.1:{_free_port()}", "--model", "m", "--retries", "0"])
    assert r.exit_code == 1 and "error: " in r.output and "cannot reach" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(app, ["regenerate", *corpus, "--out", str(tmp_path / "o"), "--engine", "hf"])
    assert r.exit_code == 1 and "--engine hf needs --target" in r.output


# ----------------------------------------------------------------------------- no server
def test_parse_reply_rejects_broken_bodies():
    ok = {"choices": [{"message": {"content": "hi", "reasoning_content": "hmm"}, "finish_reason": "length"}],
          "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    assert parse_reply(json.dumps(ok).encode()) == Reply("hi", "hmm", "length", 3, 2)
    with pytest.raises(RequestFailed, match="not UTF-8") as e:
        parse_reply(b'{"choices": [{"message": {"content": "caf\xe9"}}]}')
    assert e.value.kind == "bad_response"
    with pytest.raises(RequestFailed, match="lone surrogate"):
        parse_reply(b'{"choices": [{"message": {"content": "a\\ud800b"}}]}')
    with pytest.raises(RequestFailed, match="no choices"):
        parse_reply(b'{"error": "overloaded"}')
    with pytest.raises(RequestFailed, match="not JSON"):
        parse_reply(b"<html>502</html>")


def test_reasoning_modes():
    r = Reply("<think>\nplan\n</think>\n\nAnswer.", None, "stop", 1, 1)
    assert apply_reasoning(r, "keep") == (r.content, 0)
    assert apply_reasoning(r, "strip") == ("Answer.", len(r.content) - len("Answer."))
    assert apply_reasoning(Reply("Answer.", "plan", "stop", 1, 1), "keep") == ("<think>\nplan\n</think>\n\nAnswer.", 0)
    assert apply_reasoning(Reply("Answer.", "plan", "stop", 1, 1), "disable") == ("Answer.", 4)
    assert apply_reasoning(Reply("plan</think>\n\nAnswer.", None, "stop", 1, 1), "strip")[0] == "Answer."
    assert apply_reasoning(Reply("<think>never closed", None, "length", 1, 1), "strip") == ("", 19)


def test_slots_and_contexts():
    m = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
         {"role": "user", "content": "u2"}]
    out, idx = slots(m, "all")
    assert idx == [2, 4] and out[4] == {"role": "assistant", "content": None}
    assert slots(m, "last")[1] == [4]
    cfg = RegenerateConfig(inputs=("x",), out=Path("o"), base_url="http://h/v1", model="m",
                           sampling=Sampling(seed=7), reasoning="disable")
    c = Conversation(cfg, 5, {}, "x:1", m)
    assert c.request().messages == m[:2] and c.request().enable_thinking is False
    assert c.request().seed == request_seed(7, 5, 2) != request_seed(7, 5, 4)
    c.accept(Reply("new", None, "stop", 3, 1))
    assert c.request().messages[2]["content"] == "new"  # turn 2 sees the regenerated turn 1
    keep = Conversation(RegenerateConfig(inputs=("x",), out=Path("o"), base_url="http://h/v1", model="m",
                                         keep_assistant=True), 0, {}, "x:1", m)
    keep.accept(Reply("new", None, "stop", 3, 1))
    assert keep.request().messages[2]["content"] == "a1"  # --keep-assistant: the original as context
    with pytest.raises(RequestFailed, match=r"x:1 message 4: the target's answer is empty after removing") as e:
        c.accept(Reply("<think>all thought", None, "length", 3, 9))
    assert e.value.kind == "empty"
    with pytest.raises(ConfigError, match="--keep-assistant applies to --turns all"):
        RegenerateConfig(inputs=("x",), out=Path("o"), base_url="u", model="m", turns="last", keep_assistant=True)


def _header(fp: str = "ab" * 16, temp: float = 0.0) -> dict:
    return {"fingerprint": fp, "settings": {"temperature": temp}, "inputs": {"fingerprint": "in"}}


def test_store_resume_cuts_torn_writes(tmp_path):
    out = tmp_path / "o"
    s = Store.open(out, _header())
    s.commit([Entry(b'{"a": 1}\n', None, 0, 1, 0, 5, 2), Entry(None, b'{"message": "bad"}\n', 1)])
    s.close()
    with open(out / "chat.jsonl", "ab") as f:  # a line written, then a crash before its index entry
        f.write(b'{"torn": tr')
    with open(out / INDEX_FILE, "ab") as f:  # and half an entry
        f.write(b"\x01" * 17)
    s = Store.open(out, _header())
    assert s.done == 2 and (out / "chat.jsonl").read_bytes() == b'{"a": 1}\n'
    s.commit([Entry(b'{"b": 2}\n', None, 0, 2, 1, 7, 3)])
    st = s.stats()
    assert (st["records_done"], st["records_written"], st["failed"], st["prompt_tokens"], st["truncated_turns"]) == \
           (3, 2, {"bad_input": 1}, 12, 1)
    s.finish({})
    assert (out / "chat.jsonl").read_bytes() == b'{"a": 1}\n{"b": 2}\n'
    assert Store.open(out, _header()).complete
    with pytest.raises(FingerprintMismatch, match=r"temperature: 0\.0 -> 0\.7.*--overwrite"):
        Store.open(out, _header("cd" * 16, 0.7))
    assert Store.open(out, _header("cd" * 16, 0.7), overwrite=True).done == 0
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("mine")
    with pytest.raises(FormatError, match="not a regenerate output"):
        Store.open(tmp_path / "other", _header())
