"""regenerate over a fleet (dflash_prep.regenerate.servers): what a real one does to a run.

A server down at start, a proxy answering 503 for a backend that is gone, a host that stops
answering mid-run, a server serving another checkpoint under the same name, and multi-turn
records whose turns two servers wrote. Stand-in servers from test_servers.py: each answers
``echo <prompt>``, so a run across several must equal a run against one, byte for byte.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from dflash_prep.errors import FormatError
from dflash_prep.regenerate import servers
from dflash_prep.regenerate.engines import EngineError
from dflash_prep.regenerate.regenerate import run
from dflash_prep.regenerate.store import HEADER_FILE, entries_on_disk

from .test_servers import N, _cfg, _closed_port_url, _last_run, _records, corpus, reference, stand_ins  # noqa: F401


def _warnings(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("regenerate: warning:")]


# ----------------------------------------------------------------------------- start
def test_one_of_two_servers_down_at_start_runs_on_the_other(stand_ins, corpus, tmp_path, reference, capfd):
    down, b = _closed_port_url(), stand_ins()
    out = tmp_path / "o"
    s = run(_cfg((down, b.url), corpus, out))
    assert (out / "chat.jsonl").read_bytes() == reference and s["stats"]["records_written"] == N
    assert sorted(b.prompts) == sorted(f"prompt {i}" for i in range(N))
    lines = _warnings(capfd.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith(f"regenerate: warning: server {down} is down at start: GET "
                                                   "/models: ConnectionRefusedError") and lines[0].endswith(b.url)
    first, second = _last_run(out)["servers"]
    assert first["died"].startswith("down at start:") and first["requests"] == 0
    assert second["died"] is None and second["requests"] == N


def test_cli_names_the_server_skipped_at_start(stand_ins, corpus, tmp_path, reference):
    from typer.testing import CliRunner

    from dflash_prep.cli import app

    down, b = _closed_port_url(), stand_ins()
    r = CliRunner().invoke(app, ["regenerate", *corpus, "--out", str(tmp_path / "o"), "--base-url", down,
                                 "--base-url", b.url, "--model", "stand-in", "--max-tokens", "4"])
    assert r.exit_code == 0, r.output
    assert f"{down} 0 requests (down at start); {b.url} {N} requests" in r.output
    assert (tmp_path / "o" / "chat.jsonl").read_bytes() == reference


def test_a_server_silent_at_start_is_skipped_after_the_probe(stand_ins, corpus, tmp_path, reference, monkeypatch):
    monkeypatch.setattr(servers, "PROBE_S", 1.0)
    a, b = stand_ins(), stand_ins()
    a.hung.set()                                              # accepts connections, answers nothing
    t0 = time.monotonic()
    run(_cfg((a.url, b.url), corpus, tmp_path / "o", timeout=30))
    assert time.monotonic() - t0 < 10, "waited on the silent server"
    assert (tmp_path / "o" / "chat.jsonl").read_bytes() == reference
    assert _last_run(tmp_path / "o")["servers"][0]["died"] == "down at start: no answer to GET /models within 1 s"


# ----------------------------------------------------------------------------- same model
@pytest.mark.parametrize("field,va,vb", [("root", "/ckpt/qwen3-8b", "/ckpt/qwen3-8b-sft"),
                                         ("max_model_len", 32768, 8192)])
def test_servers_serving_another_model_are_refused(stand_ins, corpus, tmp_path, field, va, vb):
    a, b = stand_ins(identity={field: va}), stand_ins(identity={field: vb})
    with pytest.raises(EngineError) as e:
        run(_cfg((a.url, b.url), corpus, tmp_path / "o"))
    msg = str(e.value)
    assert msg == (f"the servers serve different models: {a.url} reports {field} {va!r}, {b.url} reports {field} "
                   f"{vb!r} for 'stand-in'; point every --base-url at servers of one checkpoint (same path) and one "
                   "--max-model-len"), msg
    assert entries_on_disk(tmp_path / "o") == 0 and a.prompts == b.prompts == []


def test_same_model_and_unreported_fields_are_allowed(stand_ins, corpus, tmp_path, reference):
    same = {"root": "/ckpt/qwen3-8b", "max_model_len": 4096}
    a, b, c = stand_ins(identity=same), stand_ins(identity=same), stand_ins()   # c reports neither: not compared
    run(_cfg((a.url, b.url, c.url), corpus, tmp_path / "o"))
    assert (tmp_path / "o" / "chat.jsonl").read_bytes() == reference
    report = _last_run(tmp_path / "o")["servers"]
    assert [(v["root"], v["max_model_len"]) for v in report] == [tuple(same.values())] * 2 + [(None, None)]


# ----------------------------------------------------------------------------- 5xx
@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_a_503_proxy_is_dead_and_its_records_complete_on_the_other(stand_ins, corpus, tmp_path, reference, capfd,
                                                                   on_error):
    a, b = stand_ins(fail_from=1), stand_ins()     # passes the start check, then 503 to everything
    out = tmp_path / "o"
    s = run(_cfg((a.url, b.url), corpus, out, concurrency=1, on_error=on_error))
    assert (out / "chat.jsonl").read_bytes() == reference                   # nothing lost, nothing twice
    assert s["stats"]["records_written"] == N and not s["stats"]["failed"]
    # concurrency 1: ties go to a while it lives; 2 tries each, then the request is handed to b
    assert a.prompts == [f"prompt {i}" for i in range(servers.DEAD_AFTER_5XX) for _ in range(2)]
    assert b.prompts == [f"prompt {i}" for i in range(N)]
    first, second = _last_run(out)["servers"]
    assert first["died"] == "HTTP 503 to 3 requests in a row, each through 2 tries" and first["requests"] == 0
    assert second["requests"] == N
    lines = _warnings(capfd.readouterr().err)
    assert len(lines) == 1 and f"server {a.url} is down (HTTP 503 to 3 requests in a row" in lines[0]


def test_a_request_every_server_answers_503_is_the_records_failure(stand_ins, corpus, tmp_path, capfd):
    a, b = stand_ins(fail_on=("prompt 5",)), stand_ins(fail_on=("prompt 5",))
    out = tmp_path / "o"
    s = run(_cfg((a.url, b.url), corpus, out, concurrency=1, on_error="skip"))
    assert s["stats"]["records_written"] == N - 1 and s["stats"]["failed"] == {"server_error": 1}
    assert (a.prompts.count("prompt 5"), b.prompts.count("prompt 5")) == (2, 2)   # each server once, 2 tries
    assert [r["regenerate"]["record"] for r in _records(out)] == [i for i in range(N) if i != 5]
    assert all(v["died"] is None for v in _last_run(out)["servers"]) and not _warnings(capfd.readouterr().err)


# ----------------------------------------------------------------------------- stuck requests
@pytest.fixture
def quick_watch(monkeypatch):
    """The watchdog's limits scaled down from minutes to a fraction of a second."""
    monkeypatch.setattr(servers, "STALL_FLOOR_S", 0.3)
    monkeypatch.setattr(servers, "WATCH_S", 0.05)
    monkeypatch.setattr(servers, "PROBE_S", 2.0)          # generous: a loaded machine must not fail a live probe


def test_a_hung_server_is_noticed_well_before_the_timeout(stand_ins, corpus, tmp_path, reference, capfd, quick_watch):
    a, b = stand_ins(hang_at=2), stand_ins()
    out = tmp_path / "o"
    t0 = time.monotonic()
    run(_cfg((a.url, b.url), corpus, out, timeout=30, retries=0))
    elapsed = time.monotonic() - t0
    assert elapsed < 10, f"{elapsed:.1f} s: waited for --timeout (30 s)"
    assert (out / "chat.jsonl").read_bytes() == reference
    stuck = a.prompts[1]
    assert stuck in b.prompts and len(b.prompts) == len(set(b.prompts))   # handed on, answered once
    died = {v["url"]: v for v in _last_run(out)["servers"]}[a.url]["died"]
    assert died.startswith("a request in flight ") and died.endswith("and no answer to GET /models within 2 s")
    lines = _warnings(capfd.readouterr().err)
    assert len(lines) == 1 and f"server {a.url} is down (a request in flight" in lines[0]


def test_a_long_request_on_a_live_server_goes_on(stand_ins, corpus, tmp_path, reference, capfd, quick_watch):
    a, b = stand_ins(), stand_ins()
    a.gates["prompt 0"] = threading.Event()                  # one long answer; GET /models still answers
    threading.Timer(1.5, a.gates["prompt 0"].set).start()
    out = tmp_path / "o"
    run(_cfg((a.url, b.url), corpus, out, timeout=30))
    assert a.listings > b.listings == 2       # the start's probe and check, then the watchdog's probes of a
    assert (out / "chat.jsonl").read_bytes() == reference
    assert "prompt 0" not in b.prompts and all(v["died"] is None for v in _last_run(out)["servers"])
    assert not _warnings(capfd.readouterr().err)


# ----------------------------------------------------------------------------- records
def test_each_turn_names_the_server_that_wrote_it(stand_ins, tmp_path):
    f = tmp_path / "multi.jsonl"
    f.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                                  {"role": "assistant", "content": "old"},
                                                  {"role": "user", "content": f"q{i} again"}]}) + "\n"
                         for i in range(3)))
    a, b = stand_ins(die_at=2, version="1.0"), stand_ins(version="2.0")
    out = tmp_path / "o"
    run(_cfg((a.url, b.url), [str(f)], out, concurrency=1))
    v1, v2 = {"software": "vllm", "version": "1.0"}, {"software": "vllm", "version": "2.0"}
    recs = _records(out)
    assert [[t["server"] for t in r["regenerate"]["turns"]] for r in recs] == [[v1, v2], [v2, v2], [v2, v2]]
    assert [r["regenerate"]["target"]["server"] for r in recs] == [v2, v2, v2]   # the last turn's, as before
    assert recs[0]["messages"][3]["content"] == "echo q0 again"                  # b answered a's second turn


def test_an_unfinished_v1_output_is_not_resumed(stand_ins, corpus, tmp_path):
    out = tmp_path / "o"
    with pytest.raises(EngineError):
        run(_cfg(stand_ins(die_at=3).url, corpus, out, concurrency=1))
    hdr = json.loads((out / HEADER_FILE).read_text())
    (out / HEADER_FILE).write_text(json.dumps({**hdr, "version": 1}))
    with pytest.raises(FormatError, match=r"an unfinished regenerate output of format v1, .* pass --overwrite"):
        run(_cfg(stand_ins().url, corpus, out))
    s = run(_cfg(stand_ins().url, corpus, out, overwrite=True))
    assert s["stats"]["records_written"] == N
    hdr = json.loads((out / HEADER_FILE).read_text())
    (out / HEADER_FILE).write_text(json.dumps({**hdr, "version": 1}))      # a finished v1 output: up to date
    assert run(_cfg(stand_ins().url, corpus, out))["up_to_date"] is True
