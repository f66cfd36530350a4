"""``dflash-prep evaluate --bench``: two drafters of different methods side by side on three shipped
benchmarks in one run of a real vLLM (one engine without speculation, one with per export), per
set: tau from the counters' change over that set, lossless, our evaluator within 2 %; MT-Bench's
second turns asked after the target's own first answers; the ids sent saved for replay; the table
and the picture; vLLM's n-gram speculator (``--baseline ngram``) as a row beside them, on the same
base run. Each export's strict load, its exact ``--speculative-config`` and k tokens a draft are checked
here too, on this run's engines, rather than on an engine pair of their own.

Four engine starts (about 30 s each on 2 loaded cores); ``make test-engines``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dflash_prep.engine.evaluate import cell
from dflash_prep.formats.fileio import fingerprint_json

pytestmark = pytest.mark.engine
SETS = ["gsm8k", "humaneval", "mt-bench"]


@pytest.fixture(scope="module")
def run(built, engine_python, tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    env = {**os.environ, "COLUMNS": "200", "DFLASH_PREP_VLLM_PYTHON": str(engine_python)}
    r = subprocess.run([sys.executable, "-m", "dflash_prep.cli", "evaluate", "--target", str(built["target"]),
                        "--export", str(built["dflash"]), "--export", str(built["eagle3"]), "--baseline", "ngram",
                        "--bench", ",".join(SETS), "--n", "3", "--seed", "5", "--max-tokens", "12",
                        "--save-prompts", str(d / "sent"), "--out", str(d / "r.json"), "--timeout", "300"],
                       capture_output=True, text=True, env=env, timeout=900, cwd=d)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return d, json.loads((d / "r.json").read_text()), r


@pytest.mark.timeout(900)
def test_each_drafter_on_each_set_is_lossless_and_agrees_with_ours(run):
    _, res, _ = run
    assert res["version"] == 2 and [s["name"] for s in res["sets"]] == SETS
    assert [(s["prompts"], s["conversations"], s["turns"]) for s in res["sets"]] == [(3, 3, 1), (3, 3, 1), (6, 3, 2)]
    assert [e["kind"] for e in res["exports"]] == ["dflash", "eagle3"]
    for i, e in enumerate(res["exports"]):
        assert e["strict_load"]["ok"]
        k = e["num_speculative_tokens"]
        for s in SETS:
            c = cell(res, i, s)
            v = c["vllm"]
            assert c["lossless"] == {"checked": True, "equal": c["prompts"]["n"], "of": c["prompts"]["n"], "ok": True}
            assert c["prompts"]["engine_saw_same_tokens"] is True
            assert v["num_drafts"] > 0 and v["tau"] == 1 + v["num_accepted_tokens"] / v["num_drafts"]
            # each prompt's counters are its own: a drafter drafts at every step after the prefill's
            # token and a step gives its accepted tokens plus one, so drafts + accepted cover the new
            # tokens; counters read a request early or late (shifted to a neighbour) break this,
            # which a sum over the set, equal by construction, would not show
            for p in c["per_prompt"]:
                assert p["num_accepted_tokens"] <= k * p["num_drafts"], (e["label"], s, p)
                assert p["num_drafts"] + p["num_accepted_tokens"] >= p["new_tokens_spec"] - 1, (e["label"], s, p)
            assert c["ours"]["agree"] and c["ours"]["lossless"], (e["label"], s, c["ours"])
        new = sum(p["new_tokens_spec"] - 1 for s in SETS for p in cell(res, i, s)["per_prompt"])
        assert e["vllm"]["num_drafts"] + e["vllm"]["num_accepted_tokens"] >= new
        assert e["vllm"]["num_accepted_tokens"] <= k * e["vllm"]["num_drafts"]



@pytest.mark.timeout(900)
@pytest.mark.parametrize("i, kind, k", [(0, "dflash", 3), (1, "eagle3", 7)])
def test_each_export_loads_strictly_and_drafts_k_tokens_a_step(run, built, i, kind, k):
    # vLLM's loader is the judge of a strict load: every tensor of the export used (EAGLE-3's t2d the
    # one the engine skips); the exact --speculative-config; k tokens a draft, counted per position;
    # our evaluator accepting what vLLM accepts, prompt by prompt
    _, res, _ = run
    assert res["format"] == "dflash-prep/engine-eval"
    for s in SETS:
        c = cell(res, i, s)
        st = c["strict_load"]
        assert st["ok"] and not st["missing"] and not st["unused"], st
        assert st["used"] == st["tensors"] - len(st["engine_skips"])
        assert set(st["engine_skips"]) == ({"t2d"} if kind == "eagle3" else set())
        assert c["export"]["num_speculative_tokens"] == k
        assert json.loads(c["engine"]["speculative_config_json"]) == {
            "method": kind, "model": str(built[kind].resolve()), "num_speculative_tokens": k}
        v = c["vllm"]
        assert v["num_draft_tokens"] == k * v["num_drafts"], (v, k)
        assert len(v["accepted_per_position"]) == k and sum(v["accepted_per_position"]) == v["num_accepted_tokens"]
        assert c["ours"]["prompts_same_acceptance"] == c["prompts"]["n"], (s, c["ours"])

@pytest.mark.timeout(900)
def test_the_second_turn_follows_the_targets_own_first_answer(run, built):
    from transformers import AutoTokenizer

    d, res, _ = run
    tok = AutoTokenizer.from_pretrained(str(built["target"]))
    sent = [json.loads(ln)["prompt_token_ids"] for ln in (d / "sent" / "mt-bench.jsonl").read_text().splitlines()]
    assert len(sent) == 6
    c = cell(res, 0, "mt-bench")
    firsts, seconds = sent[:3], sent[3:]
    for first, second, p in zip(firsts, seconds, c["per_prompt"]):
        text, head = tok.decode(second), tok.decode(first)
        assert text.startswith(head)                                # the conversation so far, then the answer
        answer = text[len(head):].split("<|im_end|>\n<|im_start|>user\n")[0]
        # the target's own answer is in the history: one cut at --max-tokens had 12 tokens and no end
        assert answer.strip() or p["finish_reason"] != "length", (answer, p)
    # first answers cut at their cap (finish_reason length) are counted; with --max-tokens 12 and the
    # automatic --max-model-len, the cap is what the length leaves
    (mt,) = [s for s in res["sets"] if s["name"] == "mt-bench"]
    f = mt["first_answers"]
    assert f["of"] == 3 and f["cap"] >= 12 and 0 <= f["truncated"] <= 3
    if f["cap"] == 12:                                              # nothing asked again: cut as measured
        assert f["truncated"] == sum(p["finish_reason"] == "length" for p in c["per_prompt"][:3])


@pytest.mark.timeout(900)
def test_saved_prompts_are_the_ids_sent_and_the_table_and_picture_are_written(run):
    d, res, r = run
    for s in res["sets"]:
        lines = (d / "sent" / f"{s['name']}.jsonl").read_text().splitlines()
        ids = [json.loads(ln)["prompt_token_ids"] for ln in lines]
        assert fingerprint_json(ids) == s["tokens_fingerprint"] and len(ids) == s["prompts"]
    md = (d / "r.md").read_text()
    head = next(ln for ln in md.splitlines() if ln.startswith("| drafter | method"))
    assert head == "| drafter | method | gsm8k | humaneval | mt-bench | all |"
    for label in ("dflash", "eagle3"):                         # per drafter: its tau row, its new-tokens-per-step
        rows = [ln for ln in md.splitlines() if ln.startswith(f"| {label} |")]      # row, one detail row per set
        assert len(rows) == 2 + len(SETS), rows
        assert rows[0].count("|") == rows[1].count("|") + 1 == len(SETS) + 4, rows[:2]
        assert [r.split(" | ")[1] for r in rows[2:]] == list(SETS), rows[2:]
    assert (d / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "tau per benchmark" in r.stdout and "eagle3" in r.stdout
    assert res["saved_prompts"] == [str(d / "sent" / f"{s}.jsonl") for s in SETS]


@pytest.mark.timeout(900)
def test_the_ngram_baseline_is_a_row_on_the_same_base_run(run):
    d, res, r = run
    (b,) = res["baselines"]
    assert (b["label"], b["kind"], b["method"], b["path"], b["strict_load"]) == \
        ("ngram (k=7, 2-4)", "baseline", "ngram", None, None)
    assert b["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_min": 2,
                                       "prompt_lookup_max": 4}
    assert "--speculative-config" in b["engine"]["command"] and b["speculative_config_json"] in b["engine"]["command"]
    pooled = {"num_drafts": 0, "num_accepted_tokens": 0}
    for s in res["sets"]:
        c, n = b["sets"][s["name"]], s["prompts"]
        assert c["lossless"] == {"checked": True, "equal": n, "of": n, "ok": True}, (s["name"], c["per_prompt"])
        assert c["engine_saw_same_tokens"] is True and c["ours"] == {"skipped": "a baseline: no drafter for our "
                                                                               "evaluator to decode"}
        v = c["vllm"]
        assert sum(p["num_drafts"] for p in c["per_prompt"]) == v["num_drafts"]
        assert sum(p["num_accepted_tokens"] for p in c["per_prompt"]) == v["num_accepted_tokens"]
        assert v["tau"] == (1 + v["num_accepted_tokens"] / v["num_drafts"] if v["num_drafts"] else None)
        # the base run is the drafters' own: the same new tokens, the same base tokens/s
        e = res["exports"][0]["sets"][s["name"]]
        assert c["throughput"]["base_tokens_per_s"] == e["throughput"]["base_tokens_per_s"]
        assert [p["new_tokens_base"] for p in c["per_prompt"]] == [p["new_tokens_base"] for p in e["per_prompt"]]
        pooled = {k: pooled[k] + v[k] for k in pooled}
    assert pooled["num_drafts"] > 0 and b["vllm"]["tau"] >= 1.0
    assert {k: b["vllm"][k] for k in pooled} == pooled
    md = (d / "r.md").read_text()
    assert sum(ln.startswith("| ngram (k=7, 2-4) |") for ln in md.splitlines()) == 2 + len(SETS)   # tau, tokens/step, sets
    assert "ngram (k=7, 2-4)" in r.stdout
