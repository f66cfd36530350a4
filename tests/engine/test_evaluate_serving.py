"""``dflash-prep evaluate`` serves a target as users serve it, checked without vLLM: the server's
command line per build (a GPU build keeps vLLM's defaults, the CPU build float32, eager and 8
sequences; ``--engine-arg`` replaces or adds, ``--tensor-parallel-size`` / ``--pipeline-parallel-size``
reach it), ``--dtype auto``'s resolution, the build asked once per engine python, our evaluator off by
default above :data:`~dflash_prep.engine.ours.OURS_MAX_PARAMETERS` target parameters, outputs that
cannot be written refused before any engine starts, and the conditions tokens/s were measured under
in the report.

Stand-in engine pythons (bash scripts answering the version and CUDA probes, then failing as a
server would) play a GPU build and the CPU build; the target and export are the tiny ones of
:mod:`dflash_prep.bench.tiny_engine`, built offline. New names are imported inside each test, so
that each test fails on its own on code without them.
"""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path

import pytest

from dflash_prep.engine import backends
from dflash_prep.errors import ConfigError, EngineError

PY = Path("/engine/bin/python")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from dflash_prep.bench.tiny_engine import build_exports, build_target

    root = tmp_path_factory.mktemp("serving")
    target = build_target(root)
    return {"root": root, "target": target, **build_exports(root, target, kinds=("dflash",))}


def _fake_engine(folder: Path, *, cuda: bool) -> Path:
    """A stand-in engine python: ``vllm 0.0-test`` to the version probe, ``cuda`` to the torch probe
    (each torch probe appended to ``folder/probes``), and as a server a ValueError and exit 3."""
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / "python"
    p.write_text(f"""#!/bin/bash
if [ "$1" = "-c" ]; then
  case "$2" in
    *torch*) echo probe >> {folder}/probes; echo {int(cuda)} ;;
    *) echo "vllm 0.0-test" ;;
  esac
  exit 0
fi
echo "ValueError: stand-in server"; exit 3
""")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return p


def _flag(cmd: list[str], name: str) -> str | None:
    """The value after the last ``name`` in ``cmd`` (None when absent)."""
    idx = [i for i, t in enumerate(cmd) if t == name]
    return cmd[idx[-1] + 1] if idx else None


# ----------------------------------------------------------------------------- the command line per build
def test_the_cpu_build_serves_float32_eager_8_and_a_gpu_build_the_engines_defaults():
    from dflash_prep.engine.vllm_server import server_command, server_settings

    def cmd(gpu, **kw):
        return server_command(PY, "/m", server_settings(gpu=gpu, **kw), port=8000, speculative_config=None,
                              max_model_len=64, seed=0)

    cpu, gpu = cmd(False), cmd(True)
    assert "--enforce-eager" in cpu and _flag(cpu, "--max-num-seqs") == "8" and _flag(cpu, "--dtype") == "float32"
    assert "--enforce-eager" not in gpu and "--max-num-seqs" not in gpu and _flag(gpu, "--dtype") == "auto", gpu
    # an explicit dtype is kept on both builds
    assert _flag(cmd(False, dtype="bfloat16"), "--dtype") == _flag(cmd(True, dtype="bfloat16"), "--dtype") == "bfloat16"
    # no parallelism flags at 1 (the engine's default); the sizes given reach the command
    assert "--tensor-parallel-size" not in gpu and "--pipeline-parallel-size" not in gpu
    tp = cmd(True, tensor_parallel_size=4, pipeline_parallel_size=2)
    assert _flag(tp, "--tensor-parallel-size") == "4" and _flag(tp, "--pipeline-parallel-size") == "2"


def test_engine_args_replace_the_builds_settings_and_add_flags():
    from dflash_prep.engine.extract import parse_engine_args
    from dflash_prep.engine.vllm_server import server_command, server_settings

    args = parse_engine_args(["max_num_seqs=64", "enforce-eager=false", "gpu_memory_utilization=0.85",
                              "enable_chunked_prefill=true", "enable_prefix_caching=false",
                              'compilation_config={"level": 3}', "kv_cache_dtype=fp8"])
    cpu = server_command(PY, "/m", server_settings(gpu=False, engine_args=args), port=8000, speculative_config=None,
                         max_model_len=64, seed=0)
    assert _flag(cpu, "--max-num-seqs") == "64" and cpu.count("--max-num-seqs") == 1 and "--enforce-eager" not in cpu
    tail = cpu[cpu.index("--gpu-memory-utilization"):]
    assert tail == ["--gpu-memory-utilization", "0.85", "--enable-chunked-prefill", "--no-enable-prefix-caching",
                    "--compilation-config", '{"level":3}', "--kv-cache-dtype", "fp8"], tail
    gpu = server_command(PY, "/m", server_settings(gpu=True, engine_args=parse_engine_args(["enforce_eager=true"])),
                         port=8000, speculative_config=None, max_model_len=64, seed=0)
    assert "--enforce-eager" in gpu and "--max-num-seqs" not in gpu


@pytest.mark.parametrize("arg, match", [
    ("dtype=bfloat16", r"--engine-arg dtype: it has its own flag; pass --dtype instead"),
    ("tensor_parallel_size=2", r"pass --tensor-parallel-size instead"),
    ("max_model_len=4096", r"pass --max-model-len instead"),
    ("port=9000", r"--engine-arg port: dflash-prep sets it itself"),
    ("speculative_config={}", r"--engine-arg speculative_config: dflash-prep sets it itself"),
    ("enforce_eager=yes", r"enforce_eager='yes': write true or false"),
    ("max_num_seqs=0", r"max_num_seqs=0: write a whole number >= 1"),
])
def test_engine_args_that_cannot_apply_are_refused_in_one_line(arg, match):
    from dflash_prep.engine.evaluate import EvaluateConfig
    from dflash_prep.engine.extract import parse_engine_args

    with pytest.raises(ConfigError, match=match) as e:
        EvaluateConfig(engine_args=parse_engine_args([arg]))
    assert "\n" not in str(e.value)


def test_dtype_defaults_to_auto_float32_on_the_cpu_build():
    from dflash_prep.engine.evaluate import EvaluateConfig
    from dflash_prep.engine.vllm_server import server_settings

    cfg = EvaluateConfig()
    assert cfg.dtype == "auto" and cfg.serving()["dtype"] == "auto"
    assert server_settings(gpu=False, dtype=cfg.dtype).dtype == "float32"
    assert server_settings(gpu=True, dtype=cfg.dtype).dtype == "auto"
    with pytest.raises(ConfigError, match="--tensor-parallel-size and --pipeline-parallel-size must be >= 1"):
        EvaluateConfig(tensor_parallel_size=0)


@pytest.mark.parametrize("cuda", [True, False], ids=["gpu-build", "cpu-build"])
def test_vllm_server_asks_the_build_once_and_serves_with_its_settings(tmp_path, monkeypatch, cuda):
    from dflash_prep.engine.vllm_server import gpu_build, vllm_server

    py = _fake_engine(tmp_path / "engine", cuda=cuda)
    monkeypatch.setenv(backends.get("vllm").python_var, str(py))
    gpu_build.cache_clear()
    for run in ("a", "b"):
        with pytest.raises(EngineError, match=r"exited with code 3 before serving: ValueError: stand-in server"):
            with vllm_server("m", log=tmp_path / f"{run}.log", timeout_s=60, tensor_parallel_size=2,
                             engine_args=(("gpu_memory_utilization", 0.85),)):
                pass
    cmd = (tmp_path / "b.log").read_text().splitlines()[0].removeprefix("$ ").split()
    assert (tmp_path / "engine" / "probes").read_text().count("probe") == 1      # asked once for both starts
    assert _flag(cmd, "--tensor-parallel-size") == "2" and _flag(cmd, "--gpu-memory-utilization") == "0.85"
    if cuda:
        assert "--enforce-eager" not in cmd and "--max-num-seqs" not in cmd and _flag(cmd, "--dtype") == "auto", cmd
    else:
        assert "--enforce-eager" in cmd and _flag(cmd, "--max-num-seqs") == "8" and _flag(cmd, "--dtype") == "float32"


class Stop(Exception):
    """Raised by a stand-in server factory: the run ends where an engine would start."""


def _stop_at_engine(monkeypatch, calls: list):
    """Replace the server factory the engine runs use: each call is recorded in ``calls``, then stops the run."""
    import dflash_prep.engine.evaluate_runs as runs

    def factory(model, **kw):
        calls.append(kw)
        raise Stop

    monkeypatch.setattr(runs, "vllm_server", factory)


def test_the_cli_passes_engine_args_and_parallel_sizes_to_the_engine(tiny, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from dflash_prep.cli import app

    calls: list[dict] = []
    _stop_at_engine(monkeypatch, calls)
    r = CliRunner().invoke(app, ["evaluate", "--target", str(tiny["target"]), "--export", str(tiny["dflash"]),
                                 "--bench", "gsm8k", "--n", "2", "--out", str(tmp_path / "e.json"),
                                 "--tensor-parallel-size", "2", "--pipeline-parallel-size", "3",
                                 "--engine-arg", "gpu_memory_utilization=0.85", "--engine-arg", "max_num_seqs=16"])
    assert isinstance(r.exception, Stop), r.output
    assert {k: calls[0][k] for k in ("dtype", "tensor_parallel_size", "pipeline_parallel_size", "engine_args")} == {
        "dtype": "auto", "tensor_parallel_size": 2, "pipeline_parallel_size": 3,
        "engine_args": (("gpu_memory_utilization", 0.85), ("max_num_seqs", 16))}


# ----------------------------------------------------------------------------- our evaluator's size cutoff
def _header_only_safetensors(path: Path, shapes: dict[str, list[int]]) -> None:
    """A safetensors header naming ``shapes`` (float32) with no tensor bytes: what a parameter count
    reads, never the weights."""
    header, at = {}, 0
    for name, shape in shapes.items():
        n = 4
        for d in shape:
            n *= d
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw)


@pytest.fixture(scope="module")
def big(tiny, tmp_path_factory):
    """The tiny target with one more weight file whose header names 1.6 B parameters."""
    dst = tmp_path_factory.mktemp("big") / "target"
    shutil.copytree(tiny["target"], dst)
    _header_only_safetensors(dst / "model-extra.safetensors", {"extra.weight": [40_000, 40_000]})
    return dst


def test_target_parameters_are_counted_from_the_headers(tiny, big, tmp_path):
    from safetensors import safe_open

    from dflash_prep.engine.ours import target_parameters

    exact = 0
    for f in tiny["target"].glob("*.safetensors"):
        with safe_open(str(f), "np") as s:
            exact += sum(s.get_tensor(k).size for k in s.keys())
    assert target_parameters(tiny["target"]) == exact > 0
    assert target_parameters(big) == exact + 40_000 * 40_000
    # no safetensors: estimated from config.json (Qwen3-8B's sizes: 8.19 B, as published "8.2B")
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936,
        "tie_word_embeddings": False}))
    assert 8.15e9 < target_parameters(tmp_path) < 8.25e9


def test_our_evaluator_is_off_by_default_above_the_cutoff_and_on_when_asked(tiny, big):
    from dflash_prep.engine.ours import OURS_MAX_PARAMETERS, ours_default

    small = ours_default(tiny["target"], None)
    assert small["on"] and small["line"] is None and small["target_parameters"] <= OURS_MAX_PARAMETERS
    off = ours_default(big, None)
    assert not off["on"] and off["target_parameters"] > OURS_MAX_PARAMETERS
    assert off["line"].startswith("our evaluator is off: the target has 1.60 B parameters, over 1 B") \
        and off["line"].endswith("pass --ours to run it anyway"), off["line"]
    assert ours_default(big, True)["on"] and ours_default(big, True)["line"] is None
    assert not ours_default(tiny["target"], False)["on"]


def test_evaluate_says_before_any_engine_that_our_evaluator_is_off(tiny, big, tmp_path, monkeypatch):
    from dflash_prep.engine.evaluate import evaluate_exports

    for ours in (None, True):
        said: list[str] = []
        calls: list[dict] = []
        _stop_at_engine(monkeypatch, calls)
        with pytest.raises(Stop):
            evaluate_exports(target=big, exports=[tiny["dflash"]], benches=["gsm8k"], n=2, ours=ours,
                             out=tmp_path / f"e-{ours}.json", log=said.append, contamination_n=0)
        assert len(calls) == 1
        offs = [s for s in said if "our evaluator is off" in s]
        assert (len(offs) == 1 and offs[0].startswith("note: ") and "--ours" in offs[0]) if ours is None \
            else offs == [], said
        report = json.loads((tmp_path / f"e-{ours}.json").read_text())      # partial: the run stopped at its engine
        assert report["ours_evaluator"]["on"] is (ours is True) and report["partial"]["base_run"] is False


# ----------------------------------------------------------------------------- outputs refused up front
@pytest.fixture
def no_engine(monkeypatch):
    """Any engine start fails the test: the server factory replaced wherever evaluate's modules import it."""
    import importlib

    def started(*a, **k):
        pytest.fail("an engine was started before the output was refused")

    for name in ("vllm_server", "evaluate", "evaluate_runs"):
        try:
            module = importlib.import_module(f"dflash_prep.engine.{name}")
        except ModuleNotFoundError:       # evaluate_runs: split out of evaluate after fb56586
            continue
        if hasattr(module, "vllm_server"):
            monkeypatch.setattr(module, "vllm_server", started)


def test_save_prompts_onto_an_existing_file_is_refused_before_any_engine(tiny, tmp_path, no_engine):
    from typer.testing import CliRunner

    from dflash_prep.cli import app

    f = tmp_path / "sent"
    f.write_text("keep me\n")
    r = CliRunner().invoke(app, ["evaluate", "--target", str(tiny["target"]), "--export", str(tiny["dflash"]),
                                 "--bench", "gsm8k", "--n", "2", "--out", str(tmp_path / "e.json"),
                                 "--save-prompts", str(f)])
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 1 and len(errors) == 1 and "Traceback" not in r.output, r.output
    assert errors[0] == (f"error: --save-prompts {f} is an existing file; it names a folder (one <set>.jsonl per "
                         "set): pass a new or existing folder")
    assert f.read_text() == "keep me\n" and not (tmp_path / "e.logs").exists()


@pytest.mark.parametrize("case", ["under-a-file", "out-is-a-folder", "out-under-a-file"])
def test_outputs_that_cannot_be_written_are_refused_before_any_engine(tiny, tmp_path, no_engine, case):
    from dflash_prep.engine.evaluate import evaluate_exports

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    out, save = tmp_path / "e.json", None
    if case == "under-a-file":
        save, match = blocker / "sent", rf"--save-prompts {blocker / 'sent'}: cannot write there"
    elif case == "out-is-a-folder":
        out, match = tmp_path, rf"--out {tmp_path} is a folder; name the report's JSON file"
    else:
        out, match = blocker / "e.json", rf"--out {blocker / 'e.json'}: cannot write there"
    with pytest.raises(ConfigError, match=match):
        evaluate_exports(target=tiny["target"], exports=[tiny["dflash"]], benches=["gsm8k"], n=2, out=out,
                         save_prompts_dir=save, log=None)


# ----------------------------------------------------------------------------- the conditions in the report
def test_the_conditions_read_back_from_a_command_are_its_settings():
    from dflash_prep.engine.vllm_server import server_command, server_settings, serving_conditions

    for s in (server_settings(gpu=False), server_settings(gpu=True),
              server_settings(gpu=True, engine_args=(("enforce_eager", True), ("max_num_seqs", 4)),
                              tensor_parallel_size=8, pipeline_parallel_size=2, dtype="bfloat16"),
              server_settings(gpu=False, engine_args=(("enforce_eager", False),), dtype="bfloat16")):
        cmd = server_command(PY, "/m", s, port=1, speculative_config={"method": "dflash"}, max_model_len=64, seed=0)
        assert serving_conditions(cmd, gpu=s.gpu) == s.conditions(), cmd
    gpu = server_settings(gpu=True).conditions()
    assert {k: gpu[k] for k in ("build", "enforce_eager", "max_num_seqs", "dtype", "tensor_parallel_size",
                                "pipeline_parallel_size", "requests", "note")} == {
        "build": "GPU", "enforce_eager": False, "max_num_seqs": None, "dtype": "auto", "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1, "requests": "one at a time", "note": None}
    assert gpu["line"] == ("vLLM GPU build, CUDA graphs, dtype auto, max-num-seqs the engine's default, tensor "
                           "parallel 1, pipeline parallel 1, one request at a time")
    eager = server_settings(gpu=True, engine_args=(("enforce_eager", True),)).conditions()
    assert "no CUDA graphs" in eager["note"]
    assert "CPU build" in server_settings(gpu=False).conditions()["note"]


def test_the_report_records_the_conditions_of_the_engine_that_ran(tiny, tmp_path):
    from dflash_prep.engine.evaluate import EVAL_FORMAT, EVAL_VERSION, _report, prepare, report_markdown, serving_facts
    from dflash_prep.engine.vllm_server import gpu_build, server_command, server_settings

    py = _fake_engine(tmp_path / "gpu-engine", cuda=True)
    gpu_build.cache_clear()
    plan = prepare(target=tiny["target"], exports=[tiny["dflash"]], benches=["gsm8k"], n=2, contamination_n=0,
                   engine_args=(("max_num_seqs", 32),), tensor_parallel_size=2)
    cmd = server_command(py, tiny["target"], server_settings(gpu=True, **plan.cfg.serving()), port=1,
                         speculative_config=None, max_model_len=plan.cfg.max_model_len, seed=0)
    facts = serving_facts({"version": "vllm 0.0-test", "command": cmd, "start_s": 1.0, "log": "base.log"})
    res = _report(plan, facts, [], [], [])
    assert res["serving"] == res["engine"]["base"]["serving"]
    assert {k: res["serving"][k] for k in ("build", "enforce_eager", "max_num_seqs", "dtype", "tensor_parallel_size",
                                            "requests")} == {
        "build": "GPU", "enforce_eager": False, "max_num_seqs": 32, "dtype": "auto", "tensor_parallel_size": 2,
        "requests": "one at a time"}
    assert res["ours_evaluator"]["on"] is True and res["config"]["tensor_parallel_size"] == 2
    md = report_markdown({"format": EVAL_FORMAT, "version": EVAL_VERSION, **res, "seconds": 1.0, "phases_s": {}})
    assert md.endswith(f"\ntokens/s measured with: {res['serving']['line']}.\n"), md


# ----------------------------------------------------------------------------- a whole run, on a stand-in engine
def _standin(tmp_path: Path, monkeypatch, *, cuda: bool) -> None:
    """``standin_engine.py`` as the engine's python, its CUDA probe answered ``cuda``; it records
    each engine start's argv in ``tmp_path/standin/starts.jsonl``."""
    import sys

    from dflash_prep.engine.vllm_server import gpu_build

    standin = Path(__file__).with_name("standin_engine.py")
    py = tmp_path / "standin-python"
    py.write_text(f"""#!/bin/bash
if [ "$1" = "-c" ] && [[ "$2" == *torch.cuda* ]]; then echo {int(cuda)}; exit 0; fi
exec "{sys.executable}" "{standin}" "$@"
""")
    py.chmod(0o755)
    (tmp_path / "standin").mkdir()
    monkeypatch.setenv(backends.get("vllm").python_var, str(py))
    monkeypatch.setenv("STANDIN_DIR", str(tmp_path / "standin"))
    gpu_build.cache_clear()


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu-build", "gpu-build"])
def test_a_run_serves_every_engine_with_its_settings_and_reports_them(tiny, tmp_path, monkeypatch, cuda):
    """``evaluate_exports`` end to end on ``standin_engine.py`` (a stdlib OpenAI-style server started
    by the real ``vllm_server``), its CUDA probe answered as a GPU or the CPU build: every engine's
    command carries the run's settings, and the report, the printed line and the .md say them."""
    from dflash_prep.engine.evaluate import evaluate_exports, measured_with

    _standin(tmp_path, monkeypatch, cuda=cuda)
    said: list[str] = []
    res = evaluate_exports(target=tiny["target"], exports=[tiny["dflash"]], benches=["gsm8k"], n=2, ours=False,
                           out=tmp_path / "e.json", log=said.append, contamination_n=0, tensor_parallel_size=2,
                           engine_args=(("gpu_memory_utilization", 0.85),))
    starts = [json.loads(x)["argv"] for x in (tmp_path / "standin" / "starts.jsonl").read_text().splitlines()]
    assert len(starts) == 2                                      # the base engine and the export's
    for argv in starts:
        assert _flag(argv, "--tensor-parallel-size") == "2" and _flag(argv, "--gpu-memory-utilization") == "0.85"
        if cuda:
            assert "--enforce-eager" not in argv and "--max-num-seqs" not in argv and _flag(argv, "--dtype") == "auto"
        else:
            assert "--enforce-eager" in argv and _flag(argv, "--max-num-seqs") == "8" \
                and _flag(argv, "--dtype") == "float32"
    serving = res["serving"]
    assert serving["build"] == ("GPU" if cuda else "CPU") and serving["tensor_parallel_size"] == 2
    assert serving["enforce_eager"] is (not cuda) and serving["max_num_seqs"] == (None if cuda else 8)
    assert res["exports"][0]["engine"]["serving"] == serving and res["ours_evaluator"]["requested"] is False
    assert said.count(measured_with(serving)) == 1, said
    assert (tmp_path / "e.md").read_text().endswith(measured_with(serving) + ".\n")


def test_a_run_that_fails_after_its_base_run_writes_a_partial_report_with_its_conditions(tiny, tmp_path, monkeypatch):
    """``evaluate_exports`` hands its engine runs a failure hook: the export's engine refuses to start,
    and the report on disk holds the base run, the prompts saved after it, and the conditions."""
    from dflash_prep.engine.evaluate import evaluate_exports

    _standin(tmp_path, monkeypatch, cuda=False)
    monkeypatch.setenv("STANDIN_FAIL_START", str(tiny["dflash"]))
    said: list[str] = []
    with pytest.raises(EngineError, match="vLLM refused the export"):
        evaluate_exports(target=tiny["target"], exports=[tiny["dflash"]], benches=["gsm8k"], n=2, ours=False,
                         out=tmp_path / "e.json", save_prompts_dir=tmp_path / "sent", log=said.append,
                         contamination_n=0, max_tokens=6)
    res = json.loads((tmp_path / "e.json").read_text())
    assert res["partial"]["base_run"] is True and res["partial"]["exports_not_done"] == [str(tiny["dflash"])]
    assert res["exports"] == [] and res["serving"]["build"] == "CPU" and res["serving"]["max_num_seqs"] == 8
    assert res["saved_prompts"] == [str(tmp_path / "sent" / "gsm8k.jsonl")]
    assert len((tmp_path / "sent" / "gsm8k.jsonl").read_text().splitlines()) == 2
    assert said[-1] == f"partial report (what completed): {tmp_path / 'e.json'}", said
    assert (tmp_path / "e.md").exists() and not (tmp_path / "e.png").exists()     # no row: no picture
