"""Real vLLM (``.venv-vllm``) on the project's own drafter exports: strict load, lossless, tau from the
engine's counters, our evaluator beside it, and refusals in one line that never hang.

Every test starts real engine processes (about 30 s a start on 2 loaded cores); ``make test-engines``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_prep.engine.evaluate import evaluate_export
from dflash_prep.engine.vllm_server import group_members, vllm_server
from dflash_prep.errors import EngineError

from dflash_prep.tests.engine.conftest import DEMO_BASE_KNOBS, broken_copy

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parents[2]
START_S = 300          # bound on one engine start here: a refusal must come well inside it


def _check_counts(res: dict, k: int) -> None:
    """tau is the counters' ratio, and the per-prompt counters add up to the totals."""
    v = res["vllm"]
    assert v["num_drafts"] > 0
    assert v["tau"] == 1 + v["num_accepted_tokens"] / v["num_drafts"]
    assert v["num_draft_tokens"] == k * v["num_drafts"], (v, k)
    assert len(v["accepted_per_position"]) == k and sum(v["accepted_per_position"]) == v["num_accepted_tokens"]
    assert sum(p["num_drafts"] for p in res["per_prompt"]) == v["num_drafts"]
    assert sum(p["num_accepted_tokens"] for p in res["per_prompt"]) == v["num_accepted_tokens"]


@pytest.mark.timeout(900)
def test_sampling_reports_acceptance_without_a_lossless_claim(built, tmp_path):
    res = evaluate_export(target=built["target"], export=built["eagle3"], prompts=built["prompts"],
                          out=tmp_path / "r.json", max_tokens=16, temperature=0.8, timeout_s=START_S)
    assert res["lossless"]["checked"] is False and res["lossless"]["ok"] is None
    assert all(p["lossless"] is None for p in res["per_prompt"])
    assert "skipped" in res["ours"] and res["strict_load"]["ok"]
    _check_counts(res, 7)


def _refused(built, tmp_path, export, *, target=None) -> tuple[str, float]:
    t0 = time.monotonic()
    with pytest.raises(EngineError) as e:
        evaluate_export(target=target or built["target"], export=export, prompts=built["prompts"],
                        out=tmp_path / "r.json", max_tokens=8, max_prompts=2, ours=False, timeout_s=START_S)
    msg = str(e.value)
    assert "\n" not in msg
    # what completed before the refusal (the base run) is kept, the report marked partial
    partial = json.loads((tmp_path / "r.json").read_text())["partial"]
    assert partial["base_run"] is True and partial["exports_done"] == [] and partial["exports_not_done"] == [str(export)]
    return msg, time.monotonic() - t0


@pytest.mark.timeout(600)
def test_a_missing_tensor_is_refused_though_vllm_would_serve_it(built, tmp_path):
    bad = broken_copy(built["dflash"], tmp_path / "x", drop="layers.0.self_attn.k_proj.weight")
    msg, took = _refused(built, tmp_path, bad)
    assert msg.startswith(f"{bad.resolve()}: not a strict load into vLLM's DFlashQwen3ForCausalLM")
    assert "model.layers.0.self_attn.qkv_proj.weight (" in msg and "elements loaded" in msg, msg
    assert took < START_S


@pytest.mark.timeout(600)
def test_taps_out_of_range_are_refused_with_the_engines_message(built, tmp_path):
    bad = broken_copy(built["dflash"], tmp_path / "x", config={"dflash_config": {"target_layer_ids": [7]}})
    msg, took = _refused(built, tmp_path, bad)
    assert "vLLM refused the export" in msg and "engine: ValueError:" in msg, msg           # the engine's own words
    assert "dflash_config.target_layer_ids [7] reach outside the target's 4 layers (0..3)" in msg
    assert took < START_S


@pytest.mark.timeout(600)
def test_a_draft_vocabulary_that_contradicts_d2t_is_refused(built, tmp_path):
    bad = broken_copy(built["eagle3"], tmp_path / "x", config={"draft_vocab_size": 60})
    msg, took = _refused(built, tmp_path, bad)
    assert "exited with code" in msg and "AssertionError: Attempted to load weight" in msg, msg
    assert "config.json draft_vocab_size 60 but d2t has 64 rows" in msg
    assert took < START_S


@pytest.mark.timeout(600)
def test_dflash2_is_served_with_cuda_and_refused_in_one_line_without(built, engine_build, tmp_path):
    # DFlash2 runs only on vLLM's V2 model runner (Triton on a GPU): a build with CUDA serves it,
    # strictly and losslessly; one without refuses it at start, in one line, well inside the timeout
    env = {**os.environ, "COLUMNS": "200"}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "dflash_prep.cli", "evaluate", "--target", str(built["target"]),
                        "--export", str(built["dflash2"]), "--prompts", str(built["prompts"]), "--out",
                        str(tmp_path / "r.json"), "--max-prompts", "1", "--no-ours", "--timeout", str(START_S)],
                       capture_output=True, text=True, env=env, timeout=START_S + 60, cwd=tmp_path)
    if engine_build["cuda"]:
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        from dflash_prep.engine.evaluate import cell

        res = cell(json.loads((tmp_path / "r.json").read_text()))
        assert res["strict_load"]["ok"] and res["lossless"]["ok"], res
        return
    assert r.returncode == 1, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "needs vLLM's V2 model runner (Triton; GPU)" in lines[0]
    assert "Model Runner V1 does not support: DFlash candidate-head drafts" in lines[0], lines[0]
    assert time.monotonic() - t0 < START_S


@pytest.mark.timeout(600)
def test_the_gpu_scripts_engine_step_gives_each_builds_answer(engine_python, engine_build, tmp_path):
    # bench/engine_dflash2.py as `make bench-gpu` runs it, with this engine: served and passed with
    # CUDA; without, the refusal is the expected answer, kept whole, with the engine's log beside it
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "dflash_prep.bench.engine_dflash2", "--out", str(out), "--timeout-s",
                        str(START_S)], capture_output=True, text=True, timeout=START_S + 120, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rec = json.loads((out / "engine_dflash2.json").read_text())
    assert rec["vllm"] == engine_build["version"] and rec["passed"] is True
    if engine_build["cuda"]:
        assert rec["status"] == "served" and rec["strict_load"]["ok"] and rec["lossless"]["ok"], rec
    else:
        assert rec["status"] == "refused" and rec["expected"] is True and rec["cuda"] is None
        assert "Model Runner V1 does not support: DFlash candidate-head drafts" in rec["error"]
    assert (out / "eval.logs" / "spec.log").is_file()


@pytest.mark.timeout(300)
def test_a_server_that_cannot_start_fails_fast_and_leaves_no_process(built, tmp_path):
    log = tmp_path / "x.log"
    with pytest.raises(EngineError) as e:
        with vllm_server(tmp_path / "no-such-model", log=log, timeout_s=START_S):
            pass
    assert "exited with code" in str(e.value) and str(log) in str(e.value) and "\n" not in str(e.value)
    text = log.read_text()
    assert "(APIServer pid=" in text, text[-2000:]
    assert not group_members(int(text.split("(APIServer pid=")[1].split(")")[0]))    # the group's leader


@pytest.mark.timeout(600)
def test_the_server_group_is_gone_after_the_block(built, tmp_path):
    with vllm_server(built["target"], log=tmp_path / "s.log", timeout_s=START_S) as s:
        members = group_members(s.pid)
        assert len(members) >= 2, members           # API server, engine core (and its worker)
        assert s.metrics().num_drafts == 0          # no speculation: the counters are absent, read as 0
    assert not group_members(s.pid)


@pytest.mark.timeout(1500)
def test_a_trained_demo_drafter_agrees_with_our_evaluator(engine_python, demo_base, tmp_path):
    """The DFlash demo recipe (small knobs; steps 1-5 the session's ``demo_base``), to its last step:
    a trained drafter served by vLLM on three shipped benchmarks and the held-out set in one run.
    Acceptance is high on the held-out prompts, so every position counts; there vLLM's per-prompt drafts and acceptances must equal
    our evaluator's; on every set, lossless and tau within 2 % of ours."""
    from dflash_prep.engine.evaluate import cell

    demo = tmp_path / "demo"
    env = {**os.environ, **DEMO_BASE_KNOBS, "DEMO_DFLASH": str(demo), "PY": sys.executable, "BASE_FROM": str(demo_base),
           "DRAFT_STEPS": "150", "MAX_NEW": "32", "ENGINE_EVAL": "1", "BENCH_N": "4",
           "DFLASH_PREP_VLLM_PYTHON": str(engine_python)}
    r = subprocess.run(["bash", str(ROOT / "train/recipes/demo_dflash.sh")], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=1300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "a check of the plumbing" in r.stdout and "| drafter " not in r.stdout   # tables drawn, not markdown
    full = json.loads((demo / "eval-bench.json").read_text())
    assert [s["name"] for s in full["sets"]] == ["gsm8k", "humaneval", "mt-bench", "heldout"]
    assert [s["prompts"] for s in full["sets"]] == [4, 4, 8, 8]
    assert (demo / "eval-bench.md").is_file() and (demo / "eval-bench.png").stat().st_size > 10_000
    for name in ("gsm8k", "humaneval", "mt-bench"):
        c = cell(full, 0, name)
        assert c["lossless"]["ok"] and c["ours"]["agree"], (name, c["lossless"], c["ours"])
    res = cell(full, 0, "heldout")
    assert res["strict_load"]["ok"] and res["lossless"]["ok"]
    _check_counts(res, 7)
    o = res["ours"]
    assert res["vllm"]["tau"] > 2.0, res["vllm"]
    assert o["agree"] and o["prompts_same_acceptance"] == o["of"] == 8, o
    assert o["tau_pooled"] == pytest.approx(res["vllm"]["tau"], rel=1e-12)
