"""The contamination check of ``dflash-prep evaluate`` (:mod:`dflash_prep.engine.contamination`), no
engine needed: overlaps planted at the token level (exactly n tokens found, n - 1 not, none across two
samples, hash collisions confirmed away, any slicing of the scan) and at the text level through the
project's own ``tokenize`` (a benchmark prompt copied into a chat is found; a default system prompt in
every sample and every rendered prompt, and the benchmark's own prompt format, are not), the data
found through an export's provenance or refused with one line, and the report's shape."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view

from dflash_prep.engine import contamination as cm
from dflash_prep.formats import dataset as ds_mod
from dflash_prep.formats.fileio import atomic_save_npy, fingerprint_array, fingerprint_json

SYSTEM = "You are a helpful assistant. You answer every question carefully, clearly and with kindness."
DEFAULT_SYSTEM = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\n" + SYSTEM + "<|im_end|>\n{% endif %}"
                  "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_dataset(folder: Path, samples: list[np.ndarray], *, rows_per_batch: int = 8) -> Path:
    """A dataset folder through the format's own writer (ShardWriter + write_meta)."""
    folder.mkdir(parents=True)
    lens = np.array([len(s) for s in samples], np.int32)
    key = "k" * 32
    w = ds_mod.ShardWriter(folder, 1 << 30, key)
    for i in range(0, len(samples), rows_per_batch):
        chunk = samples[i:i + rows_per_batch]
        ids = np.concatenate(chunk).astype(np.int32)
        w.add(ids, np.ones(len(ids), np.uint8), lens[i:i + rows_per_batch],
              np.arange(i, i + len(chunk), dtype=np.int64))
    shards = w.finish()
    atomic_save_npy(folder / ds_mod.LENGTHS_FILE, lens)
    lfp = fingerprint_array(lens)
    ds_mod.write_meta(folder, {
        "fingerprint": fingerprint_json({"inputs": key, "lengths": lfp}), "inputs_fingerprint": key,
        "tokenizer": {"vocab_size": 1000, "pad_id": 0, "eos_id": 1, "bos_id": None, "name": "test", "fingerprint": "t"},
        "counts": {"samples": len(samples)}, "tokens": {"total": int(lens.sum())},
        "lengths": {"file": ds_mod.LENGTHS_FILE, "dtype": "int32", "fingerprint": lfp}, "shards": shards})
    return folder


def _rng_samples(seed: int, count: int, lo: int = 20, hi: int = 90) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(500, 1000, size=int(rng.integers(lo, hi))).astype(np.int32) for _ in range(count)]


def test_hash_windows_is_the_hash_of_each_window():
    t = np.random.default_rng(0).integers(0, 1 << 17, size=200).astype(np.int32)
    h = cm.hash_windows(t, 13)
    assert h.dtype == np.uint64 and h.shape == (188,)
    assert np.array_equal(h, cm._hash_rows(sliding_window_view(t.astype(np.int64), 13), cm.BASE))
    assert len(np.unique(h)) == 188 and cm.hash_windows(t[:12], 13).shape == (0,)


def test_planted_spans_exactly_n_tokens_and_within_one_sample(tmp_path):
    """Prompt 0 copied whole into sample 5; prompt 1's first 12 tokens into sample 9; prompt 2's first
    13 tokens split over the end of sample 20 and the start of sample 21; prompt 3 nowhere."""
    p = [list(range(100 + 40 * k, 130 + 40 * k)) for k in range(4)]      # 4 prompts of 30 distinct tokens
    samples = _rng_samples(1, 48)
    samples[5] = np.r_[samples[5][:10], p[0], samples[5][10:]].astype(np.int32)
    samples[9] = np.r_[samples[9][:7], p[1][:12], samples[9][7:]].astype(np.int32)
    samples[20] = np.r_[samples[20], p[2][:6]].astype(np.int32)
    samples[21] = np.r_[p[2][6:13], samples[21]].astype(np.int32)
    ds = ds_mod.open_dataset(write_dataset(tmp_path / "data", samples, rows_per_batch=7))
    grams = cm.PromptGrams([[x] for x in p], 13)
    assert cm.scan(ds, grams) == {0: 5}, "only the whole copy: 12 tokens and a span across samples do not count"
    assert cm.scan(ds, cm.PromptGrams([[x] for x in p], 12)) == {0: 5, 1: 9}      # 12 tokens at n = 12 do
    for chunk in (1, 7, 13, 50, 333):                # the scan's slicing changes nothing (windows straddle slices)
        assert cm.scan(ds, grams, chunk=chunk) == {0: 5}, chunk
    # a prompt split in two user turns: no n-gram spans the turns
    assert cm.scan(ds, cm.PromptGrams([[p[0][:15], p[0][15:]]], 16)) == {}
    assert cm.scan(ds, cm.PromptGrams([[p[0][:15], p[0][15:]]], 15)) == {0: 5}
    short = cm.PromptGrams([[p[0][:12]], []], 13)                    # nothing of n tokens: nothing checked
    assert cm.scan(ds, short) == {} and short.checked.size == 0


def test_hash_collisions_are_confirmed_away(tmp_path):
    """With a hash that collides on purpose (base 1: the sum of the window), a training window holding a
    prompt's tokens in another order hits the hash table but is not counted; the real copy still is."""
    prompt = list(range(200, 230))
    shuffled = np.array(prompt[:13][::-1], np.int32)       # the first 13-gram's tokens in another order
    samples = _rng_samples(2, 16)
    samples[3] = np.r_[samples[3][:4], shuffled, samples[3][4:]].astype(np.int32)
    ds = ds_mod.open_dataset(write_dataset(tmp_path / "data", samples))
    weak = cm.PromptGrams([[prompt]], 13, base=1)
    window = cm.hash_windows(shuffled, 13, 1)
    i, _ = weak.lookup(window)
    assert len(i) == 1, "the reversed window's sum collides with the prompt's first 13-gram"
    assert cm.scan(ds, weak) == {}, "a hash hit alone is no contamination"
    samples[7] = np.r_[samples[7], prompt[5:20]].astype(np.int32)
    ds2 = ds_mod.open_dataset(write_dataset(tmp_path / "data2", samples))
    assert cm.scan(ds2, weak) == {0: 7} and cm.scan(ds2, cm.PromptGrams([[prompt]], 13)) == {0: 7}
    # the same n-gram in two prompts: both are counted, from one hash run
    both = cm.PromptGrams([[prompt], [prompt[5:20]], [list(range(900, 950))]], 13)
    assert both.max_run == 2 and cm.scan(ds2, both) == {0: 7, 1: 7}


# ----------------------------------------------------------------------------- text level
@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    """A BPE tokenizer whose chat template adds a default system prompt; a training corpus that holds one
    GSM8K prompt's question verbatim (sample 3), a chat ending in GSM8K's own prompt format around another
    question, and synth chats; tokenized by ``dflash-prep tokenize``."""
    from transformers import AutoTokenizer

    from dflash_prep.engine.prompt_sets import build_sets
    from dflash_prep.evalsets import sample_benchmark
    from dflash_prep.synth.synth import SynthConfig, synth
    from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize
    from dflash_prep.tests.assets.fixtures import train_bpe, write_jsonl

    root = tmp_path_factory.mktemp("contam")
    tok_dir = train_bpe(root / "tok", vocab_size=600)
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = DEFAULT_SYSTEM
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    items = sample_benchmark("gsm8k", 4, 0)
    synth(SynthConfig(out=root / "corpus", profile="mini", n=6, seed=0))
    rows = [json.loads(x) for x in (root / "corpus" / "chat.jsonl").read_text().splitlines()]
    question = items[2].turns[0].split("\nPlease reason step by step")[0]
    rows.insert(3, {"messages": [{"role": "user", "content": "Solve this one for me: " + question + " Thanks!"},
                                 {"role": "assistant", "content": "Let me think. The answer is 42."}]})
    rows.insert(4, {"messages": [{"role": "user", "content": "How many legs do 3 spiders have?\nPlease reason step "
                                                              "by step, and put your final answer within \\boxed{}."},
                                 {"role": "assistant", "content": "8 each, so \\boxed{24}."}]})
    write_jsonl(root / "train.jsonl", rows)
    tokenize(TokenizeConfig(inputs=(str(root / "train.jsonl"),), out=root / "data", tokenizer=str(tok_dir)))
    prompts = write_jsonl(root / "held.jsonl", [
        {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of "
                                                                                           "a country you like most?"}]},
        {"prompt": "A raw prompt that says nothing anyone trained on, in a few more than thirteen tokens."}])
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    sets = build_sets(tok, benches=["gsm8k"], prompts=prompts, n=4, max_prompts=0, seed=0, enable_thinking=None)
    return {"root": root, "tok_dir": tok_dir, "tok": tok, "data": root / "data", "sets": sets, "items": items,
            "export": _export(root / "export", None, None)}


def test_a_copied_prompt_is_found_and_framing_is_not(chats):
    lines = []
    sec = cm.check_run(exports=[chats["export"]], sets=chats["sets"], tokenizer=chats["tok"],
                       target=chats["tok_dir"], train_data=chats["data"], say=lines.append)
    (chk,) = sec["checks"]
    g, held = chk["sets"]["gsm8k"], chk["sets"]["held"]
    assert g["prompts"] == 4 and g["checked"] == 4 and g["contaminated"] == 1, g
    assert g["examples"] == [{"id": chats["items"][2].id, "sample": 3}]
    assert held == {"prompts": 2, "checked": 2, "contaminated": 0, "examples": []}
    assert lines == [f"warning: gsm8k: 1 of 4 prompts share a 13-token span with the training data "
                     f"({chats['data']}); their tau overstates unseen prompts"]
    assert chk["tokens"] > 0 and chk["samples"] == 8 and chk["from"] == "--train-data" and sec["n"] == 13


def test_the_rendered_prompts_would_have_matched_through_the_framing(chats):
    """What the rule is for: n-grams of the prompts as sent (template, default system prompt, GSM8K's format)
    hit the training samples' framing, so every chat prompt would count (the raw ``prompt`` record has no template)."""
    ds = ds_mod.open_dataset(chats["data"])
    naive = [sorted(cm.scan(ds, cm.PromptGrams([[ids] for ids in ps.ids], 13))) for ps in chats["sets"]]
    assert naive == [[0, 1, 2, 3], [0]], naive
    enc = chats["tok"]([SYSTEM, "Please reason step by step, and put your final answer within \\boxed{}."],
                       add_special_tokens=False)["input_ids"]
    assert min(map(len, enc)) > 13
    found = cm.scan(ds, cm.PromptGrams([[x] for x in enc], 13))
    assert found == {0: 0, 1: 4}, "the default system prompt and GSM8K's own wording are in the training data"


def test_user_texts_leave_the_prompt_format_out(chats):
    g, held = chats["sets"]
    ids, texts = cm.user_texts(g)
    assert ids == [str(it.id) for it in chats["items"]]
    assert texts[0] == [chats["items"][0].turns[0].split("\nPlease reason step by step")[0]]
    assert cm.user_texts(held) == (["0", "1"], [["What is the capital of a country you like most?"],
                                                ["A raw prompt that says nothing anyone trained on, in a few more "
                                                 "than thirteen tokens."]])


def _export(folder: Path, fingerprint: str | None, checkpoint: Path | None) -> Path:
    from dflash_prep.engine.serving_mode import BLOCK_KEY, export_block

    folder.mkdir(parents=True)
    cfg = {"architectures": ["DFlashDraftModel"]}
    if fingerprint:
        cfg[BLOCK_KEY] = export_block(serving=None, dataset_fingerprint=fingerprint, recipe={})
    (folder / "config.json").write_text(json.dumps(cfg))
    if checkpoint is not None:
        (folder / "export.json").write_text(json.dumps({"format": "dflash-prep/drafter-export", "version": 1,
                                                        "source": {"checkpoint": str(checkpoint)}}))
    return folder


def test_the_data_is_found_through_the_exports_provenance(chats, tmp_path, monkeypatch):
    """A run trained from ``work/`` with ``--data data --out runs/r``: the export's provenance leads back to the
    folder from anywhere; a changed folder, a gone run and a bare export are each skipped with one line."""
    import shutil

    work = tmp_path / "work"
    shutil.copytree(chats["data"], work / "data")
    run = work / "runs" / "r"
    run.mkdir(parents=True)
    (run / "log.jsonl").write_text(json.dumps({"format": "dflash-prep/train-log", "version": 1,
                                               "config": {"data": "data", "out": "runs/r"}}) + "\n")
    fp = ds_mod.open_dataset(chats["data"]).fingerprint
    good = _export(tmp_path / "e1", fp, run / "checkpoint.pt")
    stale = _export(tmp_path / "e2", "f" * 16, run / "checkpoint.pt")
    gone = _export(tmp_path / "e3", fp, tmp_path / "nowhere" / "checkpoint.pt")
    bare = _export(tmp_path / "e4", None, None)
    monkeypatch.chdir(tmp_path)
    assert cm.provenance_data(good) == (run / "../../data", "")
    lines = []
    sec = cm.check_run(exports=[good, stale, gone, bare], sets=chats["sets"], tokenizer=chats["tok"],
                       target=chats["tok_dir"], say=lines.append)
    assert [c["exports"] for c in sec["checks"]] == [[str(good)]] and sec["checks"][0]["from"] == "the export's provenance"
    assert sec["checks"][0]["data"] == str((work / "data").resolve())
    why = {s["export"]: s["why"] for s in sec["skipped"]}
    assert "now holds other data" in why[str(stale)] and "ffffffffffff" in why[str(stale)]
    assert "log.jsonl is gone" in why[str(gone)] and "records no training data" in why[str(bare)]
    notes = [x for x in lines if x.startswith("note:")]
    assert len(notes) == 3 and all("\n" not in x and x.endswith("pass --train-data DATA to check") for x in notes)
    assert sum(x.startswith("warning: gsm8k: 1 of 4") for x in lines) == 1
    # another vocabulary: skipped, said once
    other = cm.check_run(exports=[good], sets=chats["sets"], tokenizer=chats["tok"],
                         target=Path(__file__).parent, train_data=chats["data"], say=lines.append)
    assert other["checks"] == [] and "records no tokenizer file the target has" in other["skipped"][0]["why"]


def test_the_report_section_and_its_table(chats):
    exports = [str(chats["export"]), "/x/b"]
    sec = cm.check_run(exports=[chats["export"]], sets=chats["sets"], tokenizer=chats["tok"],
                       target=chats["tok_dir"], train_data=chats["data"])
    sec["skipped"].append({"export": exports[1], "why": "it records no training data"})
    report = {"exports": [{"path": e, "sets": {"gsm8k": {}, "held": {}}} for e in exports]}
    cm.attach(report, sec)
    a, b = (e["sets"] for e in report["exports"])
    assert a["gsm8k"]["contamination"] == {"data": str(chats["data"]), "n": 13, "prompts": 4, "checked": 4,
                                           "contaminated": 1,
                                           "examples": [{"id": chats["items"][2].id, "sample": 3}]}
    assert b["held"]["contamination"] == {"skipped": "it records no training data"}
    assert set(report["contamination"]) == {"n", "rule", "checks", "skipped"}
    md = cm.markdown_lines(report)
    assert f"| {chats['data']} | gsm8k | 4 | 4 | 1 | {chats['items'][2].id}: 3 |" in md
    assert "- not checked for /x/b: it records no training data" in md
    off = cm.check_run(exports=[Path("/x/a")], sets=chats["sets"], tokenizer=None, target=chats["tok_dir"], n=0)
    assert off["checks"] == [] and off["skipped"] == [{"export": "/x/a", "why": "--contamination-n 0"}]


def test_sidecar_formats_are_the_objectives():
    from dflash_prep.train.objectives.dflash.export import EXPORT_FORMAT as DFLASH
    from dflash_prep.train.objectives.eagle3.export import EXPORT_FORMAT as EAGLE3

    assert set(cm.SIDECAR_FORMATS) == {DFLASH, EAGLE3}


def test_evaluate_warns_and_reports_through_the_exports_provenance(tmp_path, monkeypatch):
    """``evaluate_exports`` end to end with its engine runs stubbed: a drafter whose run trained on data
    holding a GSM8K prompt gets the warning line, the report's section and the table's rows; the
    second export, with no provenance, one note."""
    import shutil

    from dflash_prep.bench.tiny_engine import build_exports, build_target
    from dflash_prep.engine import evaluate as ev
    from dflash_prep.engine.serving_mode import BLOCK_KEY, export_block
    from dflash_prep.evalsets import sample_benchmark
    from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize
    from dflash_prep.tests.assets.fixtures import write_jsonl
    from dflash_prep.tests.engine.test_evaluate_plan import _cell

    target = build_target(tmp_path)
    exp = build_exports(tmp_path, target, kinds=("dflash",))["dflash"]
    item = sample_benchmark("gsm8k", 3, 0)[1]
    question = item.turns[0].split("\nPlease reason step by step")[0]
    write_jsonl(tmp_path / "train.jsonl", [{"messages": [{"role": "user", "content": question},
                                                          {"role": "assistant", "content": "It is 7."}]}])
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    meta = tokenize(TokenizeConfig(inputs=(str(tmp_path / "train.jsonl"),), out=run / "data", tokenizer=str(target)))
    (run / "log.jsonl").write_text(json.dumps({"format": "dflash-prep/train-log", "version": 1,
                                               "config": {"data": str(run / "data"), "out": str(run)}}) + "\n")
    c = json.loads((exp / "config.json").read_text())
    c[BLOCK_KEY] = export_block(serving=None, dataset_fingerprint=meta["fingerprint"], recipe={})
    (exp / "config.json").write_text(json.dumps(c))
    side = json.loads((exp / "export.json").read_text())
    (exp / "export.json").write_text(json.dumps({**side, "source": {"checkpoint": str(run / "checkpoint.pt")}}))
    bare = tmp_path / "bare"
    shutil.copytree(exp, bare)
    (bare / "export.json").unlink()

    def base(plan, logs, say):
        return {"version": "0.32.0+cpu", "command": [], "start_s": 1.0, "log": "b.log"}, {}

    def spec(plan, i, label, base_rows, logs, phases, *, ours, say):
        return {"label": label, "path": str(plan.exports[i]), "architecture": "DFlashDraftModel", "kind": "dflash",
                "block_size": 4, "num_speculative_tokens": 3, "speculative_config": {}, "speculative_config_json": "{}",
                "engine": {"version": "0.32.0+cpu", "start_s": 1.0}, "strict_load": {"ok": True}, "warnings": [],
                "vllm": {"tau": 2.5}, "sets": {s.name: _cell((4, 6)) for s in plan.sets}}

    from dflash_prep.engine import evaluate_runs

    monkeypatch.setattr(evaluate_runs, "run_base", base)      # run_engines' steps, where it looks them up
    monkeypatch.setattr(evaluate_runs, "run_export", spec)
    lines = []
    res = ev.evaluate_exports(target=target, exports=[exp, bare], out=tmp_path / "eval.json", benches=["gsm8k"], n=3,
                              log=lines.append)
    assert f"warning: gsm8k: 1 of 3 prompts share a 13-token span with the training data ({run / 'data'}); their " \
           "tau overstates unseen prompts" in lines
    assert [x for x in lines if "contamination" in x] == [
        f"note: contamination check skipped for {bare}: {bare / 'export.json'} is missing or unreadable, so its run "
        "is unknown; pass --train-data DATA to check"]
    on_disk = json.loads((tmp_path / "eval.json").read_text())
    assert on_disk["contamination"] == res["contamination"] and on_disk["config"]["contamination_n"] == 13
    assert on_disk["exports"][0]["sets"]["gsm8k"]["contamination"]["examples"] == [{"id": item.id, "sample": 0}]
    assert "skipped" in on_disk["exports"][1]["sets"]["gsm8k"]["contamination"]
    assert "contamination" in on_disk["phases_s"]
    md = (tmp_path / "eval.md").read_text()
    assert f"| {run / 'data'} | gsm8k | 3 | 3 | 1 | {item.id}: 0 |" in md
