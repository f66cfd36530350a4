"""Fault injection on regenerate's HTTP path (issue 24): real HTTP servers on 127.0.0.1
(``http.server`` in a thread, so each fault is exact) that die mid-run and come back, answer
what is not JSON, cut an answer mid-body, or answer 200 with an unknown schema. Each is a
retry or a clear error, never a half-written record: every line of ``chat.jsonl`` is a whole
record, the index names exactly those lines, and a resumed run equals one that never failed.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dflash_prep.regenerate.engines import EngineError, RequestFailed, Sampling
from dflash_prep.regenerate.store import ENTRY, INDEX_FILE, INDEX_HEADER
from dflash_prep.regenerate.regenerate import RegenerateConfig, run

N_PROMPTS = 8
MODEL = "fake-target"


class _Handler(BaseHTTPRequestHandler):
    """HTTP/1.0, one request per connection: an answer is a pure function of the prompt."""

    def log_message(self, *args):  # quiet
        pass

    def _send(self, status: int, body: bytes, *, length: int | None = None, ctype: str = "application/json"):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(200, json.dumps({"object": "list", "data": [{"id": MODEL}]}).encode())

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv = self.server.fake
        n = srv.count()
        prompt = req["messages"][-1]["content"]
        mode = srv.mode(n, prompt)
        good = json.dumps({"choices": [{"message": {"role": "assistant", "content": f"echo {prompt}"},
                                        "finish_reason": "stop"}],
                           "usage": {"prompt_tokens": len(prompt), "completion_tokens": 2}}).encode()
        if mode == "ok":
            self._send(200, good, length=len(good))
            srv.sent(prompt)
        elif mode == "crash":                 # the server dies while this request is in flight
            srv.die()
        elif mode == "not_json":
            self._send(200, b"<html><body>502 Bad Gateway</body></html>", ctype="text/html")
        elif mode == "cut_length":            # Content-Length promises the whole body, half arrives
            self._send(200, good[: len(good) // 2], length=len(good))
        elif mode == "cut_eof":               # no length: the connection closes mid-body
            self._send(200, good[: len(good) // 2])
        elif mode == "schema":
            self._send(200, json.dumps({"id": "x", "output": [{"text": "hi"}]}).encode())


class FakeServer:
    """An OpenAI-compatible server on 127.0.0.1:``port``; ``modes(n, prompt)`` picks the answer
    to the n-th request (counted from 1), whose last message is ``prompt``."""

    def __init__(self, port: int, modes=lambda n, prompt: "ok"):
        self.port, self._modes, self._n, self._lock = port, modes, 0, threading.Lock()
        self._sent: set[str] = set()
        self._sent_cv = threading.Condition(self._lock)
        self.httpd = None
        self.start()

    url = property(lambda self: f"http://127.0.0.1:{self.port}/v1")

    def count(self) -> int:
        with self._lock:
            self._n += 1
            return self._n

    def mode(self, n: int, prompt: str) -> str:
        return self._modes(n, prompt)

    def sent(self, prompt: str) -> None:
        """The whole answer to ``prompt`` has been written to its connection."""
        with self._sent_cv:
            self._sent.add(prompt)
            self._sent_cv.notify_all()

    def wait_sent(self, prompts: set[str], timeout: float = 30.0) -> bool:
        """Block until every prompt of ``prompts`` has been answered whole (False after ``timeout``)."""
        with self._sent_cv:
            return self._sent_cv.wait_for(lambda: prompts <= self._sent, timeout)

    def answer(self, modes) -> None:
        """From now on answer with ``modes``, counting requests from 1 again."""
        with self._lock:
            self._modes, self._n = modes, 0

    def start(self) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.fake = self
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def die(self) -> None:
        """Stop listening now (new connections are refused); the request in flight gets no answer."""
        httpd, self.httpd = self.httpd, None
        if httpd is not None:
            httpd.shutdown()      # the accept loop stops (handlers run in their own threads) ...
            httpd.server_close()  # ... and the port is free again

    def close(self) -> None:
        self.die()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def corpus(tmp_path) -> list[str]:
    f = tmp_path / "c.jsonl"
    f.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"prompt {i}"}]}) + "\n"
                         for i in range(N_PROMPTS)))
    return [str(f)]


@pytest.fixture
def port():
    return _free_port()


def _cfg(url: str, corpus, out: Path, **kw) -> RegenerateConfig:
    opts = dict(engine="openai", base_url=url, model=MODEL, concurrency=2, retries=1, timeout=10,
                sampling=Sampling(temperature=0.0, max_tokens=4))
    return RegenerateConfig(inputs=tuple(corpus), out=out, **(opts | kw))


def _whole_records(out: Path) -> list[dict]:
    """Every chat.jsonl line is one whole record, and the index names exactly those lines."""
    raw = (out / "chat.jsonl").read_bytes()
    assert raw == b"" or raw.endswith(b"\n"), raw[-80:]
    recs = [json.loads(ln) for ln in raw.splitlines()]
    idx = (out / INDEX_FILE).read_bytes()[INDEX_HEADER.size:]
    entries = [idx[i:i + ENTRY.itemsize] for i in range(0, len(idx), ENTRY.itemsize)]
    assert len(idx) % ENTRY.itemsize == 0
    ends = [int.from_bytes(e[:8], "little") for e in entries]
    assert (ends[-1] if ends else 0) == len(raw)             # the index ends where the last whole line ends
    for r in recs:
        turn = r["regenerate"]["turns"][0]
        assert r["messages"][turn["message"]]["content"].startswith("echo prompt")
    return recs


@pytest.fixture
def reference(corpus, tmp_path, port) -> bytes:
    srv = FakeServer(port)
    try:
        s = run(_cfg(srv.url, corpus, tmp_path / "ref"))
    finally:
        srv.close()
    assert s["stats"]["records_written"] == N_PROMPTS
    _whole_records(tmp_path / "ref")
    return (tmp_path / "ref" / "chat.jsonl").read_bytes()


def test_server_dies_mid_run_then_resume_equals_one_run(corpus, tmp_path, port, reference):
    # The server dies on prompt 4, once it has answered prompts 0-3 (with two workers, a worker
    # starved under load could otherwise send prompt 0 after three others: nothing finished)
    before = {f"prompt {i}" for i in range(4)}
    srv = FakeServer(port, lambda n, p: "crash" if p == "prompt 4" and srv.wait_sent(before) else "ok")
    out = tmp_path / "o"
    try:
        with pytest.raises(EngineError, match=r"cannot reach the server at http://127\.0\.0\.1:\d+/v1/chat/"
                                              r"completions .*2 tries\)\. Start the server"):
            run(_cfg(srv.url, corpus, out))
    finally:
        srv.close()
    done = len(_whole_records(out))
    assert 1 <= done < N_PROMPTS
    assert json.loads((out / "regenerate.json").read_text())["complete"] is False
    back = FakeServer(port)                                 # the server comes back on the same port
    try:
        s = run(_cfg(back.url, corpus, out))
    finally:
        back.close()
    assert s["records"] == N_PROMPTS - done and s["stats"]["records_written"] == N_PROMPTS
    assert (out / "chat.jsonl").read_bytes() == reference
    _whole_records(out)


def test_server_down_for_a_moment_is_retried(corpus, tmp_path, port, reference):
    srv = FakeServer(port, lambda n, _: "crash" if n == 3 else "ok")
    threading.Timer(0.3, srv.start).start()                 # back before the first backoff (0.5 s) ends
    out = tmp_path / "o"
    try:
        s = run(_cfg(srv.url, corpus, out, retries=3))
    finally:
        time.sleep(0.35)
        srv.close()
    assert s["stats"]["records_written"] == N_PROMPTS and not s["stats"]["failed"]
    assert (out / "chat.jsonl").read_bytes() == reference


@pytest.mark.parametrize("mode,message", [
    ("not_json", r"the response is not JSON .*502 Bad Gateway"),
    ("cut_eof", r"the response is not JSON"),
    ("schema", r"the response has no choices: .*output"),
])
def test_broken_answer_is_a_clear_error_and_no_half_record(corpus, tmp_path, port, reference, mode, message):
    srv = FakeServer(port, lambda n, _: mode if n == 3 else "ok")
    out = tmp_path / "o"
    try:
        with pytest.raises(RequestFailed, match=r"c\.jsonl:\d+ message 1: " + message) as e:
            run(_cfg(srv.url, corpus, out, concurrency=1))
        assert e.value.kind == "bad_response"
        assert len(_whole_records(out)) == 2                # the records before it, whole; it is not written
        srv.answer(lambda n, prompt: mode if int(prompt.split()[-1]) % 3 == 0 else "ok")   # prompts 0, 3, 6
        skip = tmp_path / "skip"
        s = run(_cfg(srv.url, corpus, skip, concurrency=1, on_error="skip"))
    finally:
        srv.close()
    failed = s["stats"]["failed"]
    assert failed == {"bad_response": 3} and s["stats"]["records_written"] == N_PROMPTS - 3
    logged = [json.loads(ln) for ln in (skip / "failures.log").read_text().splitlines()]
    assert [(f["record"], f["kind"]) for f in logged] == [(0, "bad_response"), (3, "bad_response"), (6, "bad_response")]
    assert all(re.search(message, f["message"]) for f in logged)
    ref = [json.loads(ln) for ln in reference.splitlines()]
    recs = _whole_records(skip)
    assert len(recs) == s["stats"]["records_written"] and all(r in ref for r in recs)   # the others, whole


def test_answer_cut_mid_body_is_retried_then_reported(corpus, tmp_path, port, reference):
    srv = FakeServer(port, lambda n, _: "cut_length" if n == 2 else "ok")  # once: the retry gets the whole answer
    try:
        s = run(_cfg(srv.url, corpus, tmp_path / "once", concurrency=1))
        assert s["stats"]["records_written"] == N_PROMPTS
        assert (tmp_path / "once" / "chat.jsonl").read_bytes() == reference
        srv.answer(lambda n, _: "cut_length")                    # always: a clear error after the retries
        with pytest.raises(RequestFailed, match=r"c\.jsonl:1 message 1: .* cut its answer off mid-body "
                                                r"\(IncompleteRead.*2 tries\); check the server's log") as e:
            run(_cfg(srv.url, corpus, tmp_path / "always", concurrency=1))
        assert e.value.kind == "server_error"
    finally:
        srv.close()
    assert _whole_records(tmp_path / "always") == []


def test_out_through_a_link_writes_its_target(corpus, tmp_path, port, reference):
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    link.symlink_to(real, target_is_directory=True)
    srv = FakeServer(port)
    try:
        run(_cfg(srv.url, corpus, link))
        s = run(_cfg(srv.url, corpus, link, retries=2, overwrite=True))     # other settings: start over
    finally:
        srv.close()
    assert s["stats"]["records_written"] == N_PROMPTS and link.is_symlink()
    assert (real / "chat.jsonl").read_bytes() == reference
    assert not [q.name for q in tmp_path.iterdir() if ".old-" in q.name or q.name.endswith(".tmp")]
