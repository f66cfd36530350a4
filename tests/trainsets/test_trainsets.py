"""trainsets: the shipped training prompts match their manifest, are licence-clean, keep clear of every
shipped evaluation prompt (and the check catches a planted copy), rebuild byte for byte, sample
deterministically, and export as a file regenerate reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_prep.errors import ConfigError, FormatError
from dflash_prep.evalsets import describe as describe_eval
from dflash_prep.evalsets import benchmark_names
from dflash_prep.evalsets.sets import load_raw, sample_key
from dflash_prep.tests.evalsets import shipped_checks as checks
from dflash_prep.tests.evalsets.shipped_checks import one_line
from dflash_prep.trainsets import describe, export, load_set, parse_sets, sample_set, set_names
from dflash_prep.trainsets import overlap
from dflash_prep.trainsets.build import build, main, select
from dflash_prep.trainsets.sets import ROOT

#: Records shipped per set: 3,000 of GSM8K train's 7,473 and of Code-Instruct's 4,535; all 1,923 of Roleplay.
COUNTS = {"train-math": 3000, "train-code": 3000, "train-chat": 1923}


@pytest.fixture(scope="module")
def index() -> overlap.EvalIndex:
    return overlap.build_index(overlap.eval_turns()[0])


# ----------------------------------------------------------------------------- the shipped files
def test_manifest_counts_hashes_and_size_match_the_shipped_files():
    checks.check_manifest_hashes(ROOT, "dflash-prep/trainsets")
    assert set_names() == list(COUNTS)
    for name in set_names():
        e = describe(name)
        recs = load_set(name)
        assert e["count"] == COUNTS[name] == len(recs) == len({r["id"] for r in recs}), name
        sel = e["selection"]
        dropped = sum(len(v) for v in sel["overlap_dropped"].values())
        assert sel["eligible"] == sel["upstream_records"] - sel["duplicates_dropped"] - dropped, name
        assert e["count"] == min(sel["eligible"], sel["max_records"]), name
    assert {p.name for p in (ROOT / "data").iterdir()} == {f"{n}.jsonl.gz" for n in COUNTS}
    total = sum(p.stat().st_size for p in (ROOT / "data").iterdir())
    assert total < 3_000_000, f"the shipped training prompts take {total} bytes, over 3 MB"


def test_every_set_is_licence_clean_and_attributed():
    notice = (ROOT / "NOTICE").read_text()
    for name in set_names():
        e = describe(name)
        assert e["license"] == "MIT" and e["copyright"] in notice, name  # MIT: the copyright line travels with it
        assert e["source"]["repo"] in notice and e["source"]["commit"] in notice and e["file"] in notice, name
        assert len(e["source"]["commit"]) == 40 and len(e["source"]["git_blob"]) == 40, name
    assert notice.count("Permission is hereby granted") == 2  # one licence text per upstream repository


def test_the_overlap_check_was_run_against_the_shipped_evaluation_sets():
    """The manifest names the evaluation sets' content it was checked against: a changed evaluation
    set makes this fail until the training prompts are rebuilt (and rechecked)."""
    against = json.loads((ROOT / "manifest.json").read_text())["overlap_check"]["against"]
    assert against == {n: describe_eval(n)["content_sha256"] for n in benchmark_names()}


def test_no_shipped_training_prompt_overlaps_an_evaluation_prompt(index):
    found = {}
    for name in set_names():
        recs = load_set(name)
        found[name] = overlap.offenders([(r["id"], r["turns"][0]) for r in recs], index)
        assert len({overlap.normalise(r["turns"][0]) for r in recs}) == len(recs), f"{name}: a repeated prompt"
        dropped = describe(name)["selection"]["overlap_dropped"]
        assert not {r["id"] for r in recs} & set(dropped["contains"] + dropped["ngram"]), name
    assert found == {n: {} for n in set_names()}, found
    # what the build dropped: 4 GSM8K train questions and 2 code tasks quote an evaluation prompt
    assert {n: sum(len(v) for v in describe(n)["selection"]["overlap_dropped"].values()) for n in COUNTS} == \
        {"train-math": 4, "train-code": 2, "train-chat": 0}


# ----------------------------------------------------------------------------- the check itself
def test_the_check_catches_a_planted_copy(index):
    gsm = load_raw("gsm8k")[0]["turns"][0]
    mbpp = min((r["turns"][0] for r in load_raw("mbpp")), key=len)  # too few words for a 13-word run
    mt2 = load_raw("mt-bench")[0]["turns"][1]         # a second turn counts too
    spaced = "  \n".join(mbpp.split(" "))             # the same words, other whitespace
    assert index.offence(gsm) == "ngram"              # equal (a long turn: found by its 13-word runs)
    assert index.offence("Please help.\n" + spaced + "\nThanks!") == "contains"
    assert index.offence(f"First this. {mt2}") == "contains"
    words = gsm.split()
    assert index.offence("Unrelated start. " + " ".join(words[10:23]).upper() + " unrelated end.") == "ngram"
    assert index.offence("Unrelated start. " + " ".join(words[10:22]) + " unrelated end.") is None  # 12 words
    assert index.offence(mbpp[:-1]) is None           # a prefix of a prompt does not contain it
    got = overlap.offenders([("a", "Write a haiku about rain."), ("b", f"Solve: {gsm}")], index)
    assert got == {"b": "ngram"}


def test_normalise_and_ngrams():
    assert overlap.normalise("  a\t b\n\nc ") == "a b c"
    assert overlap.ngrams("One two, THREE!", n=2) == {("one", "two"), ("two", "three")}
    assert overlap.ngrams("too short", n=3) == set()


# ----------------------------------------------------------------------------- sampling and export
def test_sampling_is_deterministic_nested_and_in_upstream_order():
    full = load_set("train-chat")
    order = {r["id"]: i for i, r in enumerate(full)}
    prev: set = set()
    for n in (1, 2, 5, 50, 51):
        ids = [r["id"] for r in sample_set("train-chat", n, seed=3)]
        assert len(ids) == n and [order[i] for i in ids] == sorted(order[i] for i in ids)
        assert prev <= set(ids)
        prev = set(ids)
    want = sorted(full, key=lambda r: sample_key("train-chat", r["id"], 3))[:5]
    assert sample_set("train-chat", 5, 3) == [r for r in full if r in want]
    assert sample_set("train-chat", 5, 0) != sample_set("train-chat", 5, 1)
    assert sample_set("train-math", 0, 9) == load_set("train-math")
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError) as e:
            sample_set("train-math", bad, 0)
        one_line(e)


def test_parse_sets():
    assert parse_sets("all") == list(COUNTS)
    assert parse_sets(" train-chat, train-math ,train-chat") == ["train-chat", "train-math"]
    for bad in ("", " , ", "gsm8k", "train-math,Train-code"):
        with pytest.raises(ConfigError) as e:
            parse_sets(bad)
        assert "train-math, train-code, train-chat, all" in one_line(e)


def test_export_is_what_regenerate_reads(tmp_path):
    """The exported file goes through regenerate's own reader: schema messages, the ids kept, one
    slot per record (the answer to the user's prompt)."""
    from dflash_prep.regenerate.turns import slots, to_conversation
    from dflash_prep.tokenize import records as rec

    out = tmp_path / "prompts.jsonl"
    assert export(["train-math", "train-code", "train-chat"], out, n=4, seed=0) == dict.fromkeys(COUNTS, 4)
    sources, cleanup = rec.open_all(rec.expand([str(out)]), fmt="auto", text_field="text", on_error="fail")
    try:
        (src,) = sources
        assert src.schema == "messages" and len(src) == 12
        rows = src.get(0, len(src))
    finally:
        cleanup()
    want = [r for n in COUNTS for r in sample_set(n, 4, 0)]
    assert [rec.record_id(r) for r in rows] == [f"{n}/{r['id']}" for n in COUNTS for r in sample_set(n, 4, 0)]
    for row, r in zip(rows, want):
        conv = to_conversation(row, src.schema, src.fields)
        assert conv == [{"role": "user", "content": r["turns"][0]}]
        assert slots(conv, "all")[1] == [1]


def test_prompts_command(tmp_path):
    from typer.testing import CliRunner

    from dflash_prep.cli import app

    out = tmp_path / "p.jsonl"
    r = CliRunner().invoke(app, ["prompts", "--set", "train-code", "--n", "7", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "7 prompts" in r.output and len(out.read_text().splitlines()) == 7
    r = CliRunner().invoke(app, ["prompts", "--set", "train-maths", "--out", str(tmp_path / "q.jsonl")])
    assert r.exit_code == 1 and "unknown training-prompt set 'train-maths'" in r.output
    assert not (tmp_path / "q.jsonl").exists()


# ----------------------------------------------------------------------------- a changed copy
def test_a_changed_file_is_refused_in_one_line(tmp_path):
    dst = checks.copy_sets(ROOT, tmp_path / "trainsets")
    path = dst / "data" / "train-chat.jsonl.gz"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError) as e:
        load_set("train-chat", root=dst)
    msg = one_line(e)
    assert str(path) in msg and "sha256" in msg and "trainsets.build" in msg
    assert load_set("train-math", root=dst) == load_set("train-math")


# ----------------------------------------------------------------------------- rebuilding
@pytest.fixture
def upstream(tmp_path) -> dict[str, Path]:
    """Tiny upstream files in the upstream layouts, each with one planted copy of an evaluation prompt."""
    gsm, mbpp = load_raw("gsm8k")[5]["turns"][0], min((r["turns"][0] for r in load_raw("mbpp")), key=len)
    questions = [f"Tom has {i} apples and buys {i + 2} more. How many apples does he have?" for i in range(6)]
    questions[2] = gsm                                 # planted: a GSM8K test question
    questions[4] = questions[1].replace(" ", "  ")     # a repeat, after whitespace normalisation
    code = [{"instruction": f"Write a Python function that returns {i} squared.", "input": "", "output": "x"}
            for i in range(4)]
    code[1] = {"instruction": "Solve this task:", "input": mbpp, "output": "x"}  # planted: an MBPP test prompt
    code[2]["input"] = "n = 3"
    chat = [{"instruction": f"Imagine you are a sailor in port {i}. Describe the harbour.", "input": "",
             "response": "x"} for i in range(3)]
    return checks.write_upstream(tmp_path, {
        "train-math": ("train.jsonl", "".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n"
                                              for q in questions)),
        "train-code": ("codegen-instruct.json", json.dumps(code)),
        "train-chat": ("roleplay.json", json.dumps(chat))})


def test_build_is_byte_reproducible_and_drops_the_planted_copies(upstream, tmp_path):
    manifest, root = checks.check_rebuild(build, upstream, tmp_path)
    assert [r["id"] for r in load_set("train-math", root=root)] == ["0", "1", "3", "5"]
    assert describe("train-math", root=root)["selection"]["overlap_dropped"] == {"contains": [], "ngram": ["2"]}
    assert describe("train-math", root=root)["selection"]["duplicates_dropped"] == 1
    code = load_set("train-code", root=root)
    assert [r["id"] for r in code] == ["0", "2", "3"]
    assert code[1]["turns"] == ["Write a Python function that returns 2 squared.\n\nn = 3"]
    assert describe("train-code", root=root)["selection"]["overlap_dropped"]["contains"] == ["1"]
    assert len(load_set("train-chat", root=root)) == 3
    checks.check_upstream_identity(manifest, upstream)
    checks.check_gzip_header(root / "data" / "train-math.jsonl.gz")


def test_select_keeps_the_smallest_keys_in_upstream_order(index):
    recs = [{"id": str(i), "turns": [f"Prompt number {i} about boats."]} for i in range(40)]
    kept, stats = select("train-x", recs, index, 10)
    want = sorted(range(40), key=lambda i: sample_key("train-x", str(i), 0))[:10]
    assert [r["id"] for r in kept] == [str(i) for i in sorted(want)]
    assert stats["eligible"] == 40 and stats["max_records"] == 10
    assert {r["id"] for r in select("train-x", recs, index, 9)[0]} < {r["id"] for r in kept}  # nested


def test_build_cli_and_its_refusals(upstream, tmp_path, capsys):
    args = [a for name, p in upstream.items() for a in (f"--{name}", str(p))]
    assert main([*args, "--train-code-commit", "0" * 40, "--out", str(tmp_path / "o")]) == 0
    printed = capsys.readouterr().out
    assert "train-math      4 of     6 records  (1 repeats, 1 overlapping" in printed, printed
    assert describe("train-code", root=tmp_path / "o")["source"]["commit"] == "0" * 40
    upstream["train-chat"].write_text(json.dumps([{"input": "no instruction"}]))
    assert main([*args, "--out", str(tmp_path / "o2")]) == 1
    assert "'instruction'" in capsys.readouterr().err and not (tmp_path / "o2").exists()
    upstream["train-chat"].write_text(json.dumps([{"instruction": "  ", "input": ""}]))
    checks.check_build_refusals(build, upstream, tmp_path, why="empty prompt", first="train-math",
                                missing="train-code, train-chat")
