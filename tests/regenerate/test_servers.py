"""regenerate across several servers (``--base-url`` repeated, dflash_prep.regenerate.servers).

Stand-in servers (``http.server`` on 127.0.0.1, in threads) where a real one cannot show the
point exactly: which server gets which request, a server that dies at its n-th request, hangs,
or answers 503 as a proxy whose backend is gone (more of the fleet: test_fleet.py). Each answers
``echo <prompt>``, a pure function of the prompt, so a run across several equals a run against
one byte for byte. Real servers: the kill test in
tests/regenerate/test_regenerate.py (``transformers serve`` behind a proxy that dies) and
tests/engine/test_regenerate_failover.py (two ``vllm serve``, one SIGKILLed).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dflash_prep.errors import ConfigError
from dflash_prep.regenerate.engines import EngineError, Request, RequestFailed, Sampling
from dflash_prep.regenerate.regenerate import RegenerateConfig, run
from dflash_prep.regenerate.servers import ServerPool
from dflash_prep.regenerate.store import entries_on_disk

MODEL = "stand-in"
N = 12


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _json(self, obj, status: int = 200) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        s = self.server.stand
        if s.hung.is_set():
            s.released.wait(30)
            return
        if self.path != "/version":
            s.listings += 1
        if s.failing:
            self._json({"error": "bad gateway"}, 503)
        elif self.path == "/version":
            self._json({"version": s.version})
        else:
            self._json({"object": "list", "data": [{"id": MODEL, "owned_by": "vllm", **s.identity}]})

    def do_POST(self):
        s = self.server.stand
        prompt = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["messages"][-1]["content"]
        n = s.received(prompt)
        if n == s.die_at:               # the process is gone: no answer, nothing listens any more
            s.die()
            return
        if n == s.hang_at:              # the machine hangs: neither this nor any later request is answered
            s.hung.set()
        if n == s.fail_from:            # its backend is gone: the proxy answers 503 to this and every later one
            s.failing = True
        if s.failing or prompt in s.fail_on:
            self._json({"error": "service unavailable"}, 503)
            return
        if s.hung.is_set():
            s.released.wait(30)
            return
        gate = s.gates.get(prompt)
        if gate is not None:
            gate.wait(30)
        self._json({"choices": [{"message": {"role": "assistant", "content": f"echo {prompt}"},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": len(prompt), "completion_tokens": 2}})


class StandIn:
    """An OpenAI-compatible server on a free port; ``die_at``/``hang_at``/``fail_from``: the n-th
    chat request (from 1) kills it, hangs it, or starts its 503s (to GET too); ``fail_on``: prompts
    answered 503; ``gates[prompt]``: that request waits until the event is set; ``identity``: the
    model entry's ``root``/``max_model_len`` in ``GET /v1/models``."""

    def __init__(self, *, die_at: int = 0, hang_at: int = 0, fail_from: int = 0, fail_on: tuple[str, ...] = (),
                 version: str = "1.0", identity: dict | None = None):
        self.die_at, self.hang_at, self.fail_from, self.version = die_at, hang_at, fail_from, version
        self.fail_on, self.identity, self.failing = set(fail_on), identity or {}, False
        self.listings = 0  # GET /v1/models answered
        self.prompts: list[str] = []
        self.gates: dict[str, threading.Event] = {}
        self.hung, self.released = threading.Event(), threading.Event()
        self._lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.stand = self
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def received(self, prompt: str) -> int:
        with self._lock:
            self.prompts.append(prompt)
            return len(self.prompts)

    def die(self) -> None:
        httpd, self.httpd = self.httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()

    def close(self) -> None:
        self.released.set()
        for g in self.gates.values():
            g.set()
        self.die()


@pytest.fixture
def stand_ins():
    made: list[StandIn] = []

    def make(**kw) -> StandIn:
        made.append(StandIn(**kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


@pytest.fixture
def corpus(tmp_path) -> list[str]:
    f = tmp_path / "c.jsonl"
    f.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"prompt {i}"}]}) + "\n"
                         for i in range(N)))
    return [str(f)]


def _cfg(urls, corpus, out: Path, **kw) -> RegenerateConfig:
    opts = dict(engine="openai", base_url=urls, model=MODEL, concurrency=3, retries=1, timeout=10,
                sampling=Sampling(temperature=0.0, max_tokens=4))
    return RegenerateConfig(inputs=tuple(corpus), out=out, **(opts | kw))


def _records(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "chat.jsonl").read_text().splitlines()]


def _last_run(out: Path) -> dict:
    return json.loads((out / "regenerate.json").read_text())["stats"]["last_run"]


@pytest.fixture
def reference(stand_ins, corpus, tmp_path) -> bytes:
    """chat.jsonl of a run against one server."""
    out = tmp_path / "ref"
    s = run(_cfg(stand_ins().url, corpus, out))
    assert s["stats"]["records_written"] == N
    return (out / "chat.jsonl").read_bytes()


def _wait_for(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


# ----------------------------------------------------------------------------- balancing
def test_requests_go_to_the_least_busy_server_ties_by_order(stand_ins):
    a, b = stand_ins(), stand_ins()
    for s in (a, b):
        s.gates.update({p: threading.Event() for p in ("p0", "p1", "p2", "p3")})
    pool = ServerPool(base_urls=(a.url, b.url), model=MODEL, sampling=Sampling(max_tokens=4), retries=0, timeout=10)
    pool.check()
    replies: dict[str, object] = {}

    def ask(p: str) -> threading.Thread:
        t = threading.Thread(target=lambda: replies.__setitem__(p, pool.chat(Request([{"role": "user", "content": p}],
                                                                                   None, None), p)))
        t.start()
        return t

    threads = [ask("p0")]                                   # 0, 0 in flight: the first named
    _wait_for(lambda: a.prompts == ["p0"], "p0 at a")
    threads.append(ask("p1"))                               # 1, 0: the idle one
    _wait_for(lambda: b.prompts == ["p1"], "p1 at b")
    threads.append(ask("p2"))                               # 1, 1: a tie, the first named again
    _wait_for(lambda: a.prompts == ["p0", "p2"], "p2 at a")
    b.gates["p1"].set()                                     # b answers: 2, 0
    threads[1].join(10)
    threads.append(ask("p3"))
    _wait_for(lambda: b.prompts == ["p1", "p3"], "p3 at b")
    for s in (a, b):
        for g in s.gates.values():
            g.set()
    for t in threads:
        t.join(10)
    assert (a.prompts, b.prompts) == (["p0", "p2"], ["p1", "p3"])
    assert {p: r.content for p, r in replies.items()} == {p: f"echo {p}" for p in ("p0", "p1", "p2", "p3")}
    assert [(r["requests"], r["died"]) for r in pool.report()] == [(2, None), (2, None)]
    pool.close()


def test_one_url_is_one_server_and_both_share_the_work(stand_ins, corpus, tmp_path, reference):
    a, b = stand_ins(), stand_ins()
    out = tmp_path / "two"
    s = run(_cfg((a.url, b.url), corpus, out))
    assert (out / "chat.jsonl").read_bytes() == reference
    servers = _last_run(out)["servers"]
    assert [v["url"] for v in servers] == [a.url, b.url] and sum(v["requests"] for v in servers) == N
    assert all(v["requests"] > 0 and v["died"] is None and v["version"] == "1.0" for v in servers), servers
    assert sorted(a.prompts + b.prompts) == sorted(f"prompt {i}" for i in range(N))  # each asked once
    assert s["servers"] == servers


# ----------------------------------------------------------------------------- failover
def test_a_server_dying_midway_hands_its_requests_to_the_other(stand_ins, corpus, tmp_path, reference, capfd):
    a, b = stand_ins(die_at=3), stand_ins()
    out = tmp_path / "o"
    s = run(_cfg((a.url, b.url), corpus, out))
    recs = _records(out)
    assert [r["regenerate"]["record"] for r in recs] == list(range(N))   # each record once, in order
    assert (out / "chat.jsonl").read_bytes() == reference                  # what one server writes
    assert s["stats"]["records_written"] == N and not s["stats"]["failed"]
    died = a.prompts[2]                                                    # in flight when a died: b answered it
    answered_by_a = [p for p in a.prompts if p != died]
    assert died in b.prompts and not set(answered_by_a) & set(b.prompts) and len(b.prompts) == len(set(b.prompts))
    servers = {v["url"]: v for v in _last_run(out)["servers"]}
    assert servers[a.url]["requests"] == len(answered_by_a) >= 2
    assert servers[a.url]["died"].endswith("; 2 tries") and "Error" in servers[a.url]["died"]
    assert servers[b.url]["requests"] == N - len(answered_by_a) and servers[b.url]["died"] is None
    err = capfd.readouterr().err
    assert err.count("warning: server") == 1 and f"server {a.url} is down" in err and b.url in err


def test_no_server_left_stops_the_run_then_resume_equals_one_run(stand_ins, corpus, tmp_path, reference):
    a, b = stand_ins(die_at=2), stand_ins(die_at=4)
    out = tmp_path / "o"
    with pytest.raises(EngineError, match=r"^no server left: all 2 died; the last, http://127\.0\.0\.1:\d+/v1: .*"
                                          r"cannot reach the server") as e:
        run(_cfg((a.url, b.url), corpus, out, concurrency=1))
    assert "\n" not in str(e.value)
    done = entries_on_disk(out)
    assert done == 4  # a answered 1, b answered 3 (concurrency 1: a until it died)
    s = run(_cfg(stand_ins().url, corpus, out))
    assert s["records"] == N - done and (out / "chat.jsonl").read_bytes() == reference


def test_one_server_dying_is_todays_error(stand_ins, corpus, tmp_path):
    a = stand_ins(die_at=2)
    with pytest.raises(EngineError, match=r"^.*c\.jsonl:2 message 1: cannot reach the server at http://127\.0\.0\.1:"
                                          r"\d+/v1/chat/completions \(.*; 2 tries\)\. Start the server, or fix "
                                          r"--base-url \(e\.g\. http://127\.0\.0\.1:8000/v1\)$"):
        run(_cfg(a.url, corpus, tmp_path / "o", concurrency=1))
    assert entries_on_disk(tmp_path / "o") == 1


def test_a_hung_server_is_dead_after_its_timeouts_and_a_silent_probe(stand_ins, corpus, tmp_path, reference, capfd):
    a, b = stand_ins(hang_at=2), stand_ins()
    out = tmp_path / "o"
    run(_cfg((a.url, b.url), corpus, out, timeout=0.5, retries=0, concurrency=2))
    assert (out / "chat.jsonl").read_bytes() == reference
    servers = {v["url"]: v for v in _last_run(out)["servers"]}
    assert servers[a.url]["died"] == "no answer within 0.5 s, nor to GET /models within 0.5 s"
    assert f"server {a.url} is down" in capfd.readouterr().err


def test_a_slow_request_on_a_live_server_stays_the_records_timeout(stand_ins, corpus, tmp_path):
    a, b = stand_ins(), stand_ins()
    for s in (a, b):
        s.gates["prompt 0"] = threading.Event()   # only this request is slow; GET /models still answers
    with pytest.raises(RequestFailed, match=r"c\.jsonl:1 message 1: .*gave no answer within 0\.5 s") as e:
        run(_cfg((a.url, b.url), corpus, tmp_path / "o", timeout=0.5, retries=0, concurrency=1))
    assert e.value.kind == "timeout" and b.prompts == []   # nothing moved: a is alive


# ----------------------------------------------------------------------------- start, records, config
def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}/v1"


def test_no_server_answering_at_start_is_refused_by_name(corpus, tmp_path):
    down = [_closed_port_url(), _closed_port_url()]
    with pytest.raises(EngineError, match=r"^listing models: none of the 2 servers answers: "
                                          + "; ".join(rf"{u} \(down at start: GET /models: ConnectionRefusedError: .*\)"
                                                      for u in down)
                                          + r"\. Start them, or fix --base-url") as e:
        run(_cfg(tuple(down), corpus, tmp_path / "o", retries=0))
    assert "\n" not in str(e.value) and entries_on_disk(tmp_path / "o") == 0
    with pytest.raises(EngineError, match=rf"^listing models: cannot reach the server at {down[0]}/models "):
        run(_cfg(down[0], corpus, tmp_path / "one", retries=0))            # one URL: its own error, as ever


def test_records_name_the_server_that_answered_them(stand_ins, corpus, tmp_path, capfd):
    a, b = stand_ins(die_at=3, version="1.0"), stand_ins(version="2.0")
    out = tmp_path / "o"
    run(_cfg((a.url, b.url), corpus, out, concurrency=1))
    assert "the servers differ" in capfd.readouterr().err
    versions = [r["regenerate"]["target"]["server"]["version"] for r in _records(out)]
    assert versions == ["1.0"] * 2 + ["2.0"] * (N - 2)
    assert {r["regenerate"]["target"]["server"]["software"] for r in _records(out)} == {"vllm"}


def test_config_takes_one_url_or_several():
    cfg = RegenerateConfig(inputs=("x",), out=Path("o"), base_url="http://h/v1", model="m")
    assert cfg.base_urls == ("http://h/v1",)
    assert RegenerateConfig(inputs=("x",), out=Path("o"), base_url=("http://a/v1", "http://b/v1"),
                            model="m").base_urls == ("http://a/v1", "http://b/v1")
    with pytest.raises(ConfigError, match="names a server twice"):
        RegenerateConfig(inputs=("x",), out=Path("o"), base_url=("http://a/v1", "http://a/v1"), model="m")
    with pytest.raises(ConfigError, match="needs --base-url"):
        RegenerateConfig(inputs=("x",), out=Path("o"), base_url=(), model="m")


def test_cli_repeats_base_url(stand_ins, corpus, tmp_path, reference):
    from typer.testing import CliRunner

    from dflash_prep.cli import app

    a, b = stand_ins(), stand_ins()
    r = CliRunner().invoke(app, ["regenerate", *corpus, "--out", str(tmp_path / "o"), "--base-url", a.url,
                                 "--base-url", b.url, "--model", MODEL, "--max-tokens", "4", "--concurrency", "2"])
    assert r.exit_code == 0, r.output
    assert "servers" in r.output and a.url in r.output and b.url in r.output
    assert (tmp_path / "o" / "chat.jsonl").read_bytes() == reference
