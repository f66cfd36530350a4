"""evalsets: the shipped prompt sets match their manifest, are license-clean and small, read back in each
benchmark's prompt format, sample deterministically, refuse a changed file, and rebuild byte for byte."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import pytest

from dflash_prep.errors import ConfigError, FormatError
from dflash_prep.evalsets import (
    BenchPrompt,
    benchmark_names,
    describe,
    load_benchmark,
    parse_benchmarks,
    sample_benchmark,
)
from dflash_prep.evalsets.build import build, deterministic_gzip, main
from dflash_prep.evalsets.sets import ROOT, sample_key
from dflash_prep.tests.evalsets import shipped_checks as checks
from dflash_prep.tests.evalsets.shipped_checks import one_line

#: The upstream counts: GSM8K test, HumanEval, MBPP sanitized task_ids 11..510, MT-Bench.
COUNTS = {"gsm8k": 1319, "humaneval": 164, "mbpp": 257, "mt-bench": 80}
STEP = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_HEAD = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"


# ----------------------------------------------------------------------------- the shipped files
def test_manifest_counts_hashes_and_size_match_the_shipped_files():
    manifest = checks.check_manifest_hashes(ROOT, "dflash-prep/evalsets")
    assert benchmark_names() == ["gsm8k", "humaneval", "mbpp", "mt-bench"]
    for name in benchmark_names():
        entry = describe(name)
        assert entry["count"] == COUNTS[name] == len(load_benchmark(name)), (name, entry["count"])
        assert len({p.id for p in load_benchmark(name)}) == entry["count"], f"{name}: ids not unique"
    shipped = [ROOT / "manifest.json", ROOT / manifest["notice"], *(ROOT / "data").iterdir()]
    assert {p.name for p in (ROOT / "data").iterdir()} == {f"{n}.jsonl.gz" for n in COUNTS}
    total = sum(p.stat().st_size for p in shipped)
    assert total < 2_000_000, f"the shipped prompt sets take {total} bytes, over 2 MB"


def test_every_set_is_license_clean_and_attributed():
    notice = (ROOT / "NOTICE").read_text()
    for name in benchmark_names():
        e = describe(name)
        assert e["license"] in ("MIT", "Apache-2.0", "CC-BY-4.0"), (name, e["license"])
        assert "arXiv:" in e["attribution"] and e["copyright"], name
        assert e["source"]["repo"] in notice and e["source"]["commit"] in notice and e["file"] in notice, name
        if e["license"] == "MIT":  # MIT: the upstream copyright line and licence text travel with the data
            assert e["copyright"] in notice and notice.count("Permission is hereby granted") == 2
        if e["license"] == "CC-BY-4.0":  # CC BY: credit, licence link, and what was changed
            assert "creativecommons.org/licenses/by/4.0" in e["attribution"] and "Changes:" in e["attribution"]
    assert "Apache License" in notice and "END OF TERMS AND CONDITIONS" in notice


def test_math500_is_not_shipped_and_says_why():
    manifest = json.loads((ROOT / "manifest.json").read_text())
    (skipped,) = manifest["not_shipped"]
    assert skipped["name"] == "math500" and "Git LFS pointer" in skipped["reason"]
    assert skipped["source"] == {"repo": "openai/prm800k", "path": "prm800k/math_splits/test.jsonl",
                                 "commit": "7ecc794703b2877f63226f2477a49b34f9b25163"}
    for call in (lambda: parse_benchmarks("gsm8k,math500"), lambda: load_benchmark("math500"),
                 lambda: describe("math500")):
        with pytest.raises(ConfigError) as e:
            call()
        msg = one_line(e)
        assert "math500" in msg and "Git LFS" in msg and "--prompts FILE" in msg, msg


def test_each_prompt_format_on_a_known_record():
    gsm = load_benchmark("gsm8k")[0]
    assert gsm == BenchPrompt(bench="gsm8k", id="0", turns=(
        "Janet\u2019s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for "
        "her friends every day with four. She sells the remainder at the farmers' market daily for $2 per fresh "
        "duck egg. How much in dollars does she make every day at the farmers' market?" + STEP,))
    he = load_benchmark("humaneval")[0]
    assert he.id == "HumanEval/0" and len(he.turns) == 1
    assert he.turns[0].startswith(HUMANEVAL_HEAD + "from typing import List\n\n\ndef has_close_elements(")
    assert he.turns[0].endswith('    True\n    """\n\n```')
    mbpp = load_benchmark("mbpp")
    assert [p.id for p in mbpp[:3]] == ["11", "12", "14"] and mbpp[-1].id == "479"  # sanitized: gaps
    assert mbpp[0].turns == ("Write a python function to remove first and last occurrence of a given character "
                             "from the string.",)
    mt = load_benchmark("mt-bench")[0]
    assert mt == BenchPrompt(bench="mt-bench", id="81", turns=(
        "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences "
        "and must-see attractions.", "Rewrite your previous response. Start every sentence with the letter A."))
    assert describe("humaneval")["prompt_format"]["convention"] == {
        "repo": "z-lab/dflash", "path": "dflash/benchmark.py", "commit": "44947fbf71114e241c96de194f4b382b5dd330d0"}


def test_parse_benchmarks():
    assert parse_benchmarks("all") == benchmark_names()
    assert parse_benchmarks(" mt-bench, gsm8k ,mt-bench") == ["mt-bench", "gsm8k"]
    assert parse_benchmarks("humaneval,all") == ["humaneval", "gsm8k", "mbpp", "mt-bench"]
    for bad in ("", " , ", "gsm9k", "gsm8k,MBPP"):
        with pytest.raises(ConfigError) as e:
            parse_benchmarks(bad)
        msg = one_line(e)
        assert "gsm8k, humaneval, mbpp, mt-bench, all" in msg, msg


# ----------------------------------------------------------------------------- sampling
def test_sampling_is_deterministic_nested_seeded_and_in_upstream_order():
    full = load_benchmark("mt-bench")
    order = {p.id: i for i, p in enumerate(full)}
    prev: list[str] = []
    for n in range(1, len(full)):
        got = sample_benchmark("mt-bench", n, seed=7)
        ids = [p.id for p in got]
        assert len(ids) == n and [order[i] for i in ids] == sorted(order[i] for i in ids), n
        assert set(prev) <= set(ids), f"the sample of {n - 1} is not inside the sample of {n}"
        prev = ids
    # the rule itself, recomputed here: the n smallest sha256("{seed}:{name}:{id}")
    want = sorted(full, key=lambda p: hashlib.sha256(f"7:mt-bench:{p.id}".encode()).hexdigest())[:10]
    assert [p.id for p in sample_benchmark("mt-bench", 10, 7)] == [p.id for p in full if p in want]
    assert sample_key("mt-bench", "81", 7) == hashlib.sha256(b"7:mt-bench:81").hexdigest()
    assert sample_benchmark("gsm8k", 20, 0) == sample_benchmark("gsm8k", 20, 0)
    assert sample_benchmark("gsm8k", 20, 0) != sample_benchmark("gsm8k", 20, 1)
    assert sample_benchmark("humaneval", 0, 3) == sample_benchmark("humaneval", 10**6, 3) == load_benchmark("humaneval")
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError) as e:
            sample_benchmark("gsm8k", bad, 0)
        one_line(e)


def test_sample_ids_are_pinned():
    """sha256 of fixed keys is exact by construction, so these ids are the same on every platform."""
    got = [p.id for p in sample_benchmark("gsm8k", 5, 0)]
    want = sorted(range(1319), key=lambda i: hashlib.sha256(f"0:gsm8k:{i}".encode()).hexdigest())[:5]
    assert got == [str(i) for i in sorted(want)]


# ----------------------------------------------------------------------------- a changed or corrupt copy
@pytest.fixture
def copy(tmp_path) -> Path:
    return checks.copy_sets(ROOT, tmp_path / "evalsets")


def test_an_intact_copy_loads_like_the_package(copy):
    assert load_benchmark("mt-bench", root=copy) == load_benchmark("mt-bench")


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing"])
def test_a_changed_file_is_refused_in_one_line(copy, damage):
    path = copy / "data" / "gsm8k.jsonl.gz"
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[:-100]))
    else:
        path.unlink()
    with pytest.raises(FormatError) as e:
        load_benchmark("gsm8k", root=copy)
    msg = one_line(e)
    assert str(path) in msg and ("sha256" in msg or "not found" in msg) and "evalsets.build" in msg, msg
    assert len(load_benchmark("mt-bench", root=copy)) == 80  # the other sets still load


def test_a_manifest_that_disagrees_with_its_file_is_refused(copy):
    """Fewer records under a manifest whose file hash was updated: the count and content hash catch it."""
    path = copy / "data" / "mt-bench.jsonl.gz"
    lines = gzip.decompress(path.read_bytes()).splitlines(keepends=True)
    path.write_bytes(deterministic_gzip(b"".join(lines[:-1])))
    manifest = json.loads((copy / "manifest.json").read_text())
    entry = next(e for e in manifest["sets"] if e["name"] == "mt-bench")
    entry["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FormatError) as e:
        load_benchmark("mt-bench", root=copy)
    assert "79 records" in one_line(e) and "says 80" in str(e.value)


# ----------------------------------------------------------------------------- rebuilding
def _jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


@pytest.fixture
def upstream(tmp_path) -> dict[str, Path]:
    """Tiny upstream files in the upstream layouts (HumanEval gzip-compressed, MBPP one JSON list)."""
    return checks.write_upstream(tmp_path / "upstream", {
        "gsm8k": ("test.jsonl", _jsonl([{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"}
                                        for i in range(3)])),
        "humaneval": ("HumanEval.jsonl.gz", gzip.compress(_jsonl(
            [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n    \"\"\"Return {{{i}}}.\"\"\"\n",
              "entry_point": f"f{i}"} for i in range(2)]))),
        "mt-bench": ("question.jsonl", _jsonl([{"question_id": 81 + i, "category": "writing",
                                                "turns": [f"Write {i}.", "Now shorter."]} for i in range(2)])),
        "mbpp": ("sanitized-mbpp.json", json.dumps([{"task_id": t, "prompt": f"Write task {t}.", "code": "pass"}
                                                    for t in (2, 11, 510, 511)]).encode()),
    })


def test_build_is_byte_reproducible_and_reads_back_in_format(upstream, tmp_path):
    manifest, root = checks.check_rebuild(build, upstream, tmp_path)
    assert load_benchmark("gsm8k", root=root)[2] == BenchPrompt("gsm8k", "2", ("What is 2 + 2?" + STEP,))
    assert load_benchmark("humaneval", root=root)[1].turns == (
        HUMANEVAL_HEAD + 'def f1():\n    """Return {1}."""\n\n```',)
    assert [(p.id, p.turns) for p in load_benchmark("mbpp", root=root)] == [
        ("11", ("Write task 11.",)), ("510", ("Write task 510.",))]
    assert load_benchmark("mt-bench", root=root)[0] == BenchPrompt("mt-bench", "81", ("Write 0.", "Now shorter."))
    checks.check_upstream_identity(manifest, upstream)
    checks.check_gzip_header(root / "data" / "gsm8k.jsonl.gz")


def test_build_cli_and_its_refusals(upstream, tmp_path, capsys):
    args = [a for name, p in upstream.items() for a in (f"--{name}", str(p))]
    assert main([*args, "--mbpp-commit", "0" * 40, "--out", str(tmp_path / "o")]) == 0
    assert "mbpp" in capsys.readouterr().out and describe("mbpp", root=tmp_path / "o")["source"]["commit"] == "0" * 40
    upstream["mt-bench"].write_bytes(_jsonl([{"question_id": 81, "turns": ["only one"]}]))
    assert main([*args, "--out", str(tmp_path / "o2")]) == 1
    assert "1 turns, expected 2" in capsys.readouterr().err and not (tmp_path / "o2").exists()
    upstream["gsm8k"].write_bytes(_jsonl([{"problem": "no question field"}]))
    checks.check_build_refusals(build, upstream, tmp_path, why="'question'", first="gsm8k",
                                missing="humaneval, mbpp, mt-bench")
