"""``dflash-prep evaluate``'s parts that need no engine: the prompt sets and the ids they send
(``--save-prompts``), the serving mode reaching the rendered ids and its warnings, the
``--max-model-len`` it picks, refusals before any engine, the counters added over sets, and the
table and picture of a report of the real v2 shape.

The target is the tiny Qwen3 of :mod:`dflash_prep.bench.tiny_engine` (built offline, a few seconds);
a copy of it gets a chat template with a thinking switch.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dflash_prep.engine.evaluate import cell, needed_model_len, prepare
from dflash_prep.engine.prompt_sets import build_sets, save_prompts
from dflash_prep.engine.report_plot import write_plot
from dflash_prep.engine.report_table import markdown_table, report_rows
from dflash_prep.engine.vllm_server import SpecCounters
from dflash_prep.errors import ConfigError
from dflash_prep.formats.fileio import fingerprint_json

SWITCH = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not "
          "enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from dflash_prep.bench.tiny_engine import build_exports, build_target

    root = tmp_path_factory.mktemp("plan")
    target = build_target(root)
    exports = build_exports(root, target, kinds=("dflash", "eagle3"))
    switch = root / "target-switch"
    shutil.copytree(target, switch)
    cfg = json.loads((switch / "tokenizer_config.json").read_text())
    cfg["chat_template"] = SWITCH
    (switch / "tokenizer_config.json").write_text(json.dumps(cfg))
    (switch / "chat_template.jinja").unlink(missing_ok=True)
    return {"root": root, "target": target, "switch": switch, **exports}


def _trained_in(export: Path, dst: Path, thinking: str, template_sha: str | None) -> Path:
    """A copy of ``export`` whose config.json says it was trained in ``thinking`` on a template of that hash."""
    from dflash_prep.engine.serving_mode import BLOCK_KEY, export_block

    shutil.copytree(export, dst)
    c = json.loads((dst / "config.json").read_text())
    c[BLOCK_KEY] = export_block(serving={"thinking": thinking, "source": "records (regenerate --reasoning)",
                                         "chat_template_sha256": template_sha},
                                dataset_fingerprint="d" * 16, recipe={"objective": "dflash"})
    (dst / "config.json").write_text(json.dumps(c))
    return dst


def test_sets_are_the_sampled_prompts_in_the_benchmarks_format(tiny):
    from dflash_prep.evalsets import sample_benchmark

    p = prepare(target=tiny["target"], exports=[tiny["dflash"], tiny["eagle3"]], benches=["gsm8k", "mt-bench"],
                n=4, seed=3)
    assert [s.name for s in p.sets] == ["gsm8k", "mt-bench"] and [len(s.ids) for s in p.sets] == [4, 4]
    want = sample_benchmark("gsm8k", 4, 3)
    assert p.sets[0].source["ids"] == [w.id for w in want]
    text = p.tokenizer.decode(p.sets[0].ids[0])
    assert want[0].turns[0] in text and text.endswith("<|im_start|>assistant\n")
    assert "within \\boxed{}" in text                               # the benchmark's format, not the bare question
    assert p.sets[1].multi_turn and p.sets[1].turn_of == [1] * 4     # second turns wait for the base engine
    assert [m.k for m in p.methods] == [3, 7]
    # the same sample, seed and ids every time: the fingerprint the report records
    again = prepare(target=tiny["target"], exports=[tiny["dflash"]], benches=["gsm8k"], n=4, seed=3)
    assert fingerprint_json(again.sets[0].ids) == fingerprint_json(p.sets[0].ids)


def test_second_turns_follow_the_answer_and_saved_prompts_replay(tiny, tmp_path):
    p = prepare(target=tiny["target"], exports=[tiny["dflash"]], benches=["mt-bench"], n=2, seed=0)
    s = p.sets[0]
    answers = [p.tokenizer("A first answer.", add_special_tokens=False)["input_ids"],
               p.tokenizer("Another.", add_special_tokens=False)["input_ids"]]
    new = s.add_second_turns(p.tokenizer, answers, None)
    assert len(new) == 2 and s.turn_of == [1, 1, 2, 2] and len(s.ids) == 4
    text = p.tokenizer.decode(new[0])
    assert text.startswith(p.tokenizer.decode(s.ids[0])) and "A first answer." in text
    assert s.turns[0][1] in text and text.endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="1 first answers for 2 conversations"):
        s.add_second_turns(p.tokenizer, answers[:1], None)
    paths = save_prompts(p.sets, tmp_path / "sent")
    assert paths == [tmp_path / "sent" / "mt-bench.jsonl"]
    back = [json.loads(ln)["prompt_token_ids"] for ln in paths[0].read_text().splitlines()]
    assert back == s.ids and s.facts()["tokens_fingerprint"] == fingerprint_json(back)
    assert s.facts()["turns"] == 2 and s.facts()["conversations"] == 2


def test_the_thinking_mode_reaches_the_ids_and_a_mismatch_warns(tiny, tmp_path):
    from dflash_prep.tokenize.identity import chat_template_sha256
    from transformers import AutoTokenizer

    sha = chat_template_sha256(AutoTokenizer.from_pretrained(str(tiny["switch"])).chat_template)
    on = _trained_in(tiny["dflash"], tmp_path / "on", "on", sha)
    ids = {}
    for flag in ("on", "off"):
        p = prepare(target=tiny["switch"], exports=[on], benches=["gsm8k"], n=2, thinking=flag)
        ids[flag] = p.sets[0].ids
        assert p.enable_thinking is (flag == "on") and not p.notes
        warned = p.warnings[str(on.resolve())]
        if flag == "on":
            assert warned == []
        else:                                                       # evaluated off, trained on
            assert len(warned) == 1 and "--thinking on" in warned[0] and "2-3x" in warned[0], warned
    assert p.tokenizer.decode(ids["off"][0]).endswith("<think>\n\n</think>\n\n") != \
        p.tokenizer.decode(ids["on"][0]).endswith("<think>\n\n</think>\n\n")
    auto = prepare(target=tiny["switch"], exports=[on], benches=["gsm8k"], n=2, thinking="auto")
    assert auto.enable_thinking is True and auto.sets[0].ids == ids["on"]     # auto: the training mode
    # the same export against the target whose template it was not trained on: a warning naming it
    other = prepare(target=tiny["target"], exports=[on], benches=["gsm8k"], n=2, thinking="on")
    assert any("chat template" in w for w in other.warnings[str(on.resolve())])
    assert other.notes and "no enable_thinking switch" in other.notes[0]     # ChatML: the flag changes nothing


def test_refusals_come_before_any_engine(tiny, tmp_path):
    with pytest.raises(ConfigError, match="at least one --export"):
        prepare(target=tiny["target"], exports=[], benches=["gsm8k"])
    with pytest.raises(ConfigError, match="the same --export is given twice"):
        prepare(target=tiny["target"], exports=[tiny["dflash"], tiny["dflash"]], benches=["gsm8k"])
    with pytest.raises(ConfigError, match="nothing to evaluate"):
        prepare(target=tiny["target"], exports=[tiny["dflash"]])
    with pytest.raises(ConfigError, match="--thinking must be one of"):
        prepare(target=tiny["target"], exports=[tiny["dflash"]], benches=["gsm8k"], thinking="maybe")
    f = tmp_path / "gsm8k.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ConfigError, match="two prompt sets named 'gsm8k'"):
        prepare(target=tiny["target"], exports=[tiny["dflash"]], benches=["gsm8k"], prompts=f, n=1)
    with pytest.raises(ConfigError, match="over --max-model-len 64"):
        prepare(target=tiny["target"], exports=[tiny["dflash"]], benches=["humaneval"], n=1, max_model_len=64)


def test_max_model_len_covers_the_longest_prompt_and_second_turns(tiny):
    p = prepare(target=tiny["target"], exports=[tiny["dflash"]], benches=["gsm8k", "mt-bench"], n=3,
                max_tokens=40)
    longest = max(len(x) for s in p.sets for x in s.ids)
    need, limit = needed_model_len(p.target, p.sets, p.tokenizer, 40, None, draft=3)     # the DFlash export's k
    assert p.cfg.max_model_len == need and need % 16 == 0 and need >= longest + 40 + 3 + 1 and limit == 4096
    second = max(len(p.tokenizer.apply_chat_template(
        [{"role": "user", "content": t[0]}, {"role": "assistant", "content": ""}, {"role": "user", "content": t[1]}],
        tokenize=True, add_generation_prompt=True)) for t in p.sets[1].turns)
    assert need >= second + 3 * 40
    fixed = prepare(target=tiny["target"], exports=[tiny["dflash"]], benches=["gsm8k"], n=3, max_model_len=2048)
    assert fixed.cfg.max_model_len == 2048


def test_counters_add_over_sets():
    a = SpecCounters(num_drafts=4, num_draft_tokens=12, num_accepted_tokens=5, accepted_per_position=(3, 2))
    b = SpecCounters(num_drafts=2, num_draft_tokens=6, num_accepted_tokens=1, accepted_per_position=(1, 0, 0))
    s = a + b
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, s.accepted_per_position) == (6, 18, 6, (4, 2, 0))
    assert (s - b) == SpecCounters(4, 12, 5, (3, 2, 0)) and (a + SpecCounters()).num_draft_tokens is None


def _cell(tau_drafts: tuple[int, int], lossless: bool = True, agree: bool = True) -> dict:
    drafts, accepted = tau_drafts
    n = 2
    return {"lossless": {"checked": True, "equal": n if lossless else n - 1, "of": n, "ok": lossless},
            "vllm": {"tau": 1 + accepted / drafts, "num_drafts": drafts, "num_draft_tokens": 3 * drafts,
                     "num_accepted_tokens": accepted, "accepted_per_position": [accepted, 0, 0],
                     "acceptance_per_position": [accepted / drafts, 0.0, 0.0]},
            "throughput": {"spec_tokens_per_s": 10.0, "base_tokens_per_s": 8.0, "speedup": 1.25, "new_tokens_spec": 9,
                           "new_tokens_base": 9, "note": None},
            "engine_saw_same_tokens": True,
            "ours": {"tau": 1 + accepted / drafts, "tau_pooled": (1 + accepted / drafts) * (1 if agree else 1.1),
                     "blocks": drafts, "lossless": True, "proposer": "drafter", "block_size": 4, "stop_rule": "engine",
                     "rel_diff": 0.0 if agree else 0.09, "agree": agree, "prompts_same_acceptance": n,
                     "prompts_same_length": n, "of": n, "differing_prompts": []},
            "per_prompt": []}


REPORT = {
    "format": "dflash-prep/engine-eval", "version": 2,
    "engine": {"name": "vllm", "version": "0.32.0+cpu", "base": {"version": "0.32.0+cpu", "command": [], "start_s": 20.0,
                                                               "log": "b.log"}},
    "target": {"path": "/t", "chat_template_sha256": "ab"},
    "thinking": {"flag": "off", "enable_thinking": False, "why": "--thinking off", "notes": []},
    "prompts_sent_as": "token ids, /v1/completions",
    "sets": [{"name": "gsm8k", "kind": "shipped", "prompts": 2, "conversations": 2, "turns": 1, "tokens_fingerprint": "f1"},
             {"name": "mt-bench", "kind": "shipped", "prompts": 2, "conversations": 1, "turns": 2,
              "tokens_fingerprint": "f2"}],
    "sampling": {"max_tokens": 16, "temperature": 0.0, "seed": 0}, "config": {}, "saved_prompts": [],
    "exports": [
        {"label": "ours", "path": "/e/ours", "architecture": "DFlashDraftModel", "kind": "dflash", "block_size": 4,
         "num_speculative_tokens": 3, "speculative_config": {}, "speculative_config_json": "{}",
         "engine": {"version": "0.32.0+cpu", "start_s": 25.0}, "strict_load": {"ok": True}, "warnings": [],
         "vllm": {"tau": 2.5}, "sets": {"gsm8k": _cell((4, 6)), "mt-bench": _cell((2, 1), lossless=False)}},
        {"label": "public", "path": "/e/public", "architecture": "LlamaForCausalLMEagle3", "kind": "eagle3",
         "block_size": None, "num_speculative_tokens": 7, "speculative_config": {}, "speculative_config_json": "{}",
         "engine": {"version": "0.32.0+cpu", "start_s": 26.0}, "strict_load": {"ok": True},
         "warnings": ["public: trained with thinking on, evaluated off"],
         "vllm": {"tau": 1.8}, "sets": {"gsm8k": _cell((5, 4)), "mt-bench": _cell((2, 2), agree=False)}},
    ],
    "seconds": 99.0, "phases_s": {"base_engine": 30.0},
}


def test_the_table_puts_drafters_in_rows_and_benchmarks_in_columns():
    md = markdown_table(REPORT)
    lines = md.splitlines()
    assert lines[0] == "# tau per benchmark: vLLM 0.32.0+cpu, temperature 0, thinking off, <= 16 new tokens"
    i = lines.index("| drafter | method | gsm8k | mt-bench | all |")
    assert lines[i + 2] == "| ours | DFlash, k = 3 | 2.50 | 1.50 (not lossless) | 2.50 |"
    assert lines[i + 3] == "| public | EAGLE-3, k = 7 | 1.80 | 2.00 (ours differs) | 1.80 |"
    assert "Prompts: gsm8k 2 prompts, mt-bench 2 prompts (1 conversations); seed 0." in md
    assert "| public | mt-bench | 2.000 | 2.200 | NO 9.00% | 2/2 | 1.00 0.00 0.00 | 10 / 8 |" in lines
    assert lines[-1] == "- public: trained with thinking on, evaluated off"


def test_cell_is_the_v1_shape_report_rows_prints():
    c = cell(REPORT, 1, "mt-bench")
    assert c["export"]["architecture"] == "LlamaForCausalLMEagle3" and c["prompts"]["set"] == "mt-bench"
    assert c["vllm"]["tau"] == 2.0 and c["engine"]["base"]["start_s"] == 20.0
    rows = dict(report_rows({**c, "strict_load": {"ok": True, "used": 5, "tensors": 5, "loaded": 5,
                                                   "shared_with_target": [], "engine_skips": {}, "missing": [],
                                                   "unused": []}}))
    assert rows["tau (vLLM)"] == "2.000 = 1 + 2 accepted / 2 drafts"
    assert cell(REPORT)["prompts"]["set"] == "gsm8k"              # no name: the first set


def test_the_picture_is_a_png(tmp_path):
    p = write_plot(REPORT, tmp_path / "r.png")
    data = p.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_a_file_set_is_named_after_its_file(tiny, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny["target"]))
    f = tmp_path / "held.jsonl"
    f.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q {i}"}]}) + "\n" for i in range(5)))
    (s,) = build_sets(tok, benches=[], prompts=f, n=0, max_prompts=3, seed=0, enable_thinking=None)
    assert s.name == "held" and len(s.ids) == 3 and s.source == {"kind": "file", "path": str(f), "max_prompts": 3}
