"""tokenize: every input format and schema, masks, overflow, bad input, atomicity, idempotence."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_prep.errors import ConfigError, InputError
from dflash_prep.formats.dataset import open_dataset
from dflash_prep.formats.lengths import read_dataset_lengths
from dflash_prep.tokenize.encoders import ByteTokenizer, encode_chats, load_tokenizer
from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize

from dflash_prep.tests.assets.fixtures import CHATS, train_bpe, write_jsonl

SHAREGPT = [{"conversations": [{"from": "human" if m["role"] == "user" else
                                {"assistant": "gpt"}.get(m["role"], m["role"]), "value": m["content"]}
                               for m in c]} for c in CHATS]
TEXTS = ["plain text one.", "Second text, a bit longer: café.", "x"]


def run(tmp_path: Path, inputs, name="out", **kw) -> dict:
    kw.setdefault("tokenizer", "byte")
    return tokenize(TokenizeConfig(inputs=tuple(str(i) for i in inputs), out=tmp_path / name, **kw))


def byte_chat(messages):
    return encode_chats(ByteTokenizer(), [messages])[0]


def samples(folder):
    ds = open_dataset(folder)
    return [ds.sample(i) for i in range(len(ds))]


def assert_no_leftovers(tmp_path: Path, keep=()):
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))
    assert left == [], f"temp files left behind: {left}"
    assert not (tmp_path / "out").exists() or "out" in keep


# ----------------------------------------------------------------------------- formats
def test_messages_jsonl_ids_and_masks(tmp_path):
    f = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS])
    meta = run(tmp_path, [f])
    assert meta["source"]["schemas"] == ["messages"] and meta["counts"]["samples"] == len(CHATS)
    for c, (ids, mask) in zip(CHATS, samples(tmp_path / "out")):
        want_ids, want_mask = byte_chat(c)
        assert np.array_equal(ids, want_ids) and np.array_equal(mask, want_mask)
        # alignment: the trained positions hold exactly the assistant bytes and turn ends
        want = [b for m in c if m["role"] == "assistant" for b in list(m["content"].encode()) + [258]]
        assert ids[mask == 1].tolist() == want
    assert meta["tokens"]["loss"] == sum(int(m.sum()) for _, m in samples(tmp_path / "out"))


def test_sharegpt_json_array_equals_messages(tmp_path):
    (tmp_path / "sg.json").write_text(json.dumps(SHAREGPT))
    write_jsonl(tmp_path / "m.jsonl", [{"messages": c} for c in CHATS])
    a = run(tmp_path, [tmp_path / "sg.json"], name="a")
    b = run(tmp_path, [tmp_path / "m.jsonl"], name="b")
    assert a["source"]["schemas"] == ["sharegpt"]
    assert np.array_equal(np.load(tmp_path / "a/lengths.npy"), np.load(tmp_path / "b/lengths.npy"))
    for (i1, m1), (i2, m2) in zip(samples(tmp_path / "a"), samples(tmp_path / "b")):
        assert np.array_equal(i1, i2) and np.array_equal(m1, m2)


def test_text_parquet_arrow_and_save_to_disk(tmp_path):
    import datasets

    table = pa.table({"body": TEXTS, "other": [1, 2, 3]})
    pq.write_table(table, tmp_path / "t.parquet")
    with pa.OSFile(str(tmp_path / "t.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    datasets.Dataset.from_dict({"body": TEXTS}).save_to_disk(str(tmp_path / "disk"))
    want = [list(t.encode()) + [256] for t in TEXTS]
    for name, src in (("p", "t.parquet"), ("a", "t.arrow"), ("d", "disk")):
        meta = run(tmp_path, [tmp_path / src], name=name, text_field="body")
        assert meta["source"]["schemas"] == ["text"]
        got = samples(tmp_path / name)
        assert [ids.tolist() for ids, _ in got] == want, name
        assert all(m.all() for _, m in got), "plain text is trained on in full"
    with pytest.raises(InputError, match="found fields body, other"):
        run(tmp_path, [tmp_path / "t.parquet"], name="x", format="messages")


def test_globs_folders_and_global_record_ids(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    write_jsonl(d / "a.jsonl", [{"messages": c} for c in CHATS[:2]])
    write_jsonl(d / "b.jsonl", [{"messages": c} for c in CHATS[2:]])
    run(tmp_path, [d / "*.jsonl"], name="g")
    run(tmp_path, [d], name="f")
    for name in ("g", "f"):
        ds = open_dataset(tmp_path / name)
        assert len(ds) == 3 and [ds.sample(i)[0].tolist() for i in range(3)] == [byte_chat(c)[0].tolist() for c in CHATS]


def test_hf_tokenizer_through_the_stage(tmp_path):
    bpe = train_bpe(tmp_path / "bpe")
    f = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS])
    meta = run(tmp_path, [f], tokenizer=str(bpe))
    tok = load_tokenizer(str(bpe))
    assert meta["tokenizer"]["fingerprint"] == tok.info.fingerprint and meta["tokenizer"]["eos_id"] == tok.info.eos_id
    for c, (ids, mask) in zip(CHATS, samples(tmp_path / "out")):
        assert tok.hf.decode(ids[mask == 1].tolist(), skip_special_tokens=False) == \
            "".join(m["content"] + "<|im_end|>" for m in c if m["role"] == "assistant")


def test_num_proc_gives_identical_output(tmp_path):
    rows = [{"messages": CHATS[i % 3]} for i in range(40)]
    f = write_jsonl(tmp_path / "c.jsonl", rows)
    run(tmp_path, [f], name="one", chunk_rows=7, shard_mb=0.001)
    run(tmp_path, [f], name="two", chunk_rows=7, shard_mb=0.001, num_proc=2)
    one = json.loads((tmp_path / "one/meta.json").read_text())
    assert len(one["shards"]) > 1  # bounded shards: a few hundred bytes each here
    assert all(s["bytes"] <= 0.001 * 2**20 for s in one["shards"])
    for s in one["shards"]:
        assert (tmp_path / "one" / s["file"]).read_bytes() == (tmp_path / "two" / s["file"]).read_bytes()
    assert (tmp_path / "one/lengths.npy").read_bytes() == (tmp_path / "two/lengths.npy").read_bytes()


# ----------------------------------------------------------------------------- overflow
@pytest.mark.parametrize("mode", ["truncate", "drop"])
def test_overflow(tmp_path, mode):
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CHATS])
    full = [len(byte_chat(c)[0]) for c in CHATS]
    max_len = sorted(full)[1]  # exactly one sample is longer
    meta = run(tmp_path, [f], max_len=max_len, on_overflow=mode)
    lengths = read_dataset_lengths(tmp_path / "out").lengths
    long_i = int(np.argmax(full))
    if mode == "truncate":
        assert meta["counts"]["truncated"] == 1 and meta["counts"]["dropped"] == 0
        assert lengths.tolist() == [min(n, max_len) for n in full]
        assert meta["tokens"]["cut_by_truncation"] == full[long_i] - max_len
        ids, mask = open_dataset(tmp_path / "out").sample(long_i)
        want_ids, want_mask = byte_chat(CHATS[long_i])
        assert np.array_equal(ids, want_ids[:max_len]) and np.array_equal(mask, want_mask[:max_len])
    else:
        assert meta["counts"]["dropped"] == 1 and meta["counts"]["truncated"] == 0
        assert lengths.tolist() == [n for n in full if n <= max_len]
        assert meta["tokens"]["in_dropped"] == full[long_i]
        assert open_dataset(tmp_path / "out").sample(0)[0].shape[0] == lengths[0]


# ----------------------------------------------------------------------------- bad input
GOOD = json.dumps({"messages": CHATS[2]})
BAD_CASES = {
    "malformed": ([GOOD, GOOD, '{"messages": [oops'], r"bad\.jsonl:3: malformed JSON"),
    "missing field": ([GOOD, {"messages": [{"role": "user", "text": "hi"}, {"role": "assistant", "text": "x"}]}],
                      r"bad\.jsonl:2: message 0 has no 'content' field \(found fields: role, text\)"),
    "empty conversation": ([GOOD, {"messages": []}], r"bad\.jsonl:2: empty conversation"),
    "non-string content": ([{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "a"}]}, GOOD],
                           r"bad\.jsonl:1: message 0: 'content' is a int, not a string"),
    "unknown role": ([GOOD, GOOD, {"messages": [{"role": "robot", "content": "a"}]}],
                     r"bad\.jsonl:3: message 0: unknown role 'robot'"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_record_fails_with_location_and_leaves_nothing(tmp_path, case):
    rows, pattern = BAD_CASES[case]
    f = write_jsonl(tmp_path / "bad.jsonl", [""] + rows if case == "unknown role" else rows)  # a blank line too
    if case == "unknown role":
        pattern = pattern.replace("jsonl:3", "jsonl:4")
    with pytest.raises(InputError, match=pattern):
        run(tmp_path, [f])
    assert_no_leftovers(tmp_path)
    meta = run(tmp_path, [f], on_error="skip")
    assert meta["counts"]["skipped"] == 1 and meta["counts"]["samples"] == len(rows) - 1
    assert len(meta["skipped_examples"]) == 1


def test_missing_schema_field_lists_found_fields(tmp_path):
    f = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "a", "answer": "b"}])
    with pytest.raises(InputError, match="found fields answer, prompt"):
        run(tmp_path, [f])


def test_corrupt_parquet(tmp_path):
    pq.write_table(pa.table({"text": TEXTS}), tmp_path / "ok.parquet")
    data = (tmp_path / "ok.parquet").read_bytes()
    (tmp_path / "bad.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match=r"bad\.parquet: cannot read this parquet input"):
        run(tmp_path, [tmp_path / "bad.parquet"])
    assert_no_leftovers(tmp_path)


def test_failure_midway_leaves_no_output(tmp_path):
    rows = [GOOD] * 30 + ['{"messages": [{"role": "user", "content": ["not", "text"]}]}']
    f = write_jsonl(tmp_path / "late.jsonl", rows)
    with pytest.raises(InputError, match=r"late\.jsonl:31"):
        run(tmp_path, [f], chunk_rows=4, num_proc=2)  # several chunks are written before the failure
    assert_no_leftovers(tmp_path)


def test_bad_options():
    for kw, pat in (({"max_len": 0}, "--max-len"), ({"on_overflow": "cut"}, "--on-overflow"),
                    ({"on_error": "ignore"}, "--on-error"), ({"num_proc": 0}, "--num-proc"),
                    ({"format": "csv"}, "--format"), ({"tokenizer": ""}, "--tokenizer is required"),
                    ({"role_map": "human"}, "--role-map"),
                    ({"mask": None}, "--train-on-eos")):
        with pytest.raises(ConfigError, match=pat):
            if kw.get("mask", 0) is None:
                from dflash_prep.tokenize.chat import MaskOptions

                MaskOptions(train_on_eos="always")
            TokenizeConfig(inputs=("x",), out=Path("y"), **{"tokenizer": "byte", **kw})


def test_missing_input(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        run(tmp_path, [tmp_path / "nope.jsonl"])


# ----------------------------------------------------------------------------- idempotence
def test_up_to_date_then_overwrite(tmp_path):
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CHATS])
    first = run(tmp_path, [f])
    stamp = (tmp_path / "out/meta.json").stat().st_mtime_ns
    again = run(tmp_path, [f])
    assert again["up_to_date"] and again["fingerprint"] == first["fingerprint"]
    assert (tmp_path / "out/meta.json").stat().st_mtime_ns == stamp  # nothing rewritten
    with pytest.raises(ConfigError, match="--overwrite"):
        run(tmp_path, [f], max_len=50)
    redo = run(tmp_path, [f], max_len=50, overwrite=True)
    assert not redo["up_to_date"] and redo["counts"]["truncated"] == 3
    assert open_dataset(tmp_path / "out").lengths.max() == 50
    assert_no_leftovers(tmp_path, keep=("out",))


# ----------------------------------------------------------------------------- CLI
def test_cli_synth_tokenize_up_to_date_and_clean_errors(tmp_path):
    from typer.testing import CliRunner

    from dflash_prep.cli import app

    r = CliRunner()
    res = r.invoke(app, ["synth", "--out", str(tmp_path / "c"), "--n", "30", "--seed", "2"])
    assert res.exit_code == 0, res.output
    args = ["tokenize", str(tmp_path / "c"), "--tokenizer", "byte", "--out", str(tmp_path / "d"), "--max-len", "1000"]
    res = r.invoke(app, args)
    assert res.exit_code == 0 and "truncated" in res.output, res.output
    assert "up to date" in r.invoke(app, args).output
    # `make demo && make demo`: the corpus is rebuilt (new mtimes, same bytes), so still up to date
    assert r.invoke(app, ["synth", "--out", str(tmp_path / "c"), "--n", "30", "--seed", "2", "--overwrite"]).exit_code == 0
    assert "up to date" in r.invoke(app, args).output
    res = r.invoke(app, args[:2] + args[4:])  # no --tokenizer: required, never a silent default
    assert res.exit_code != 0 and "--tokenizer" in res.output
    bad = write_jsonl(tmp_path / "bad.jsonl", [GOOD, "{nope"])
    res = r.invoke(app, ["tokenize", str(bad), "--tokenizer", "byte", "--out", str(tmp_path / "e")])
    assert res.exit_code == 1 and "bad.jsonl:2: malformed JSON" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "e").exists()


# ----------------------------------------------------------------------------- chat inputs and options
def _shard_column(folder: Path, name: str) -> list:
    import datasets

    return datasets.load_from_disk(str(folder))[name]


def test_other_input_schemas_equal_their_messages(tmp_path):
    """alpaca, prompt/completion (text and conversational), OpenAI content parts and
    --messages-field + --role-map give the ids of the equivalent messages records; ids kept."""
    want = [
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Do it\n\nwith this"},
         {"role": "assistant", "content": "done"}],
        [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}],
    ]
    cases = {
        "alpaca": [{"instruction": "Do it", "input": "with this", "output": "done", "system": "S", "id": "a1"},
                   {"instruction": "Q?", "input": "", "output": "A.", "system": "", "id": "a2"}],
        "prompt_completion": [{"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "Do it\n\nwith this"}],
                               "completion": [{"role": "assistant", "content": "done"}], "id": "a1"},
                              {"prompt": "Q?", "completion": "A.", "id": "a2"}],
        "parts": [{"messages": [{"role": m["role"], "content": [{"type": "text", "text": m["content"][:1]},
                                                               {"type": "text", "text": m["content"][1:]}]}
                                for m in c], "id": f"a{k + 1}"} for k, c in enumerate(want)],
    }
    cases["field"] = [{"dialog": [{"role": {"system": "narrator", "user": "asker", "assistant": "helper"}[m["role"]],
                                   "content": m["content"]} for m in c], "id": f"a{k + 1}"} for k, c in enumerate(want)]
    for name, rows in cases.items():
        f = write_jsonl(tmp_path / f"{name}.jsonl", rows)
        kw = {"messages_field": "dialog", "role_map": "narrator=system,asker=user,helper=assistant"} if name == "field" else {}
        meta = run(tmp_path, [f], name=name, **kw)
        got = samples(tmp_path / name)
        assert [i.tolist() for i, _ in got] == [byte_chat(c)[0].tolist() for c in want], name
        assert [m.tolist() for _, m in got] == [byte_chat(c)[1].tolist() for c in want], name
        assert _shard_column(tmp_path / name, "source_id") == ["a1", "a2"], name
        assert meta["counts"]["samples"] == 2
    bad = write_jsonl(tmp_path / "img.jsonl", [{"messages": [{"role": "user", "content": [{"type": "image_url"}]},
                                                             {"role": "assistant", "content": "x"}]}])
    with pytest.raises(InputError, match=r"img\.jsonl:1: message 0: content part 0 is 'image_url'"):
        run(tmp_path, [bad], name="img")
    with pytest.raises(InputError, match=r"field\.jsonl:1: message 0: unknown role 'narrator'.*--role-map"):
        run(tmp_path, [tmp_path / "field.jsonl"], name="nomap", messages_field="dialog")


def test_chat_data_without_a_template_is_an_error(tmp_path):
    bpe = train_bpe(tmp_path / "bpe", template=False)
    f = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS])
    for spec in (bpe, bpe / "tokenizer.json"):
        with pytest.raises(ConfigError, match=r"chat\.jsonl: chat records.*no chat template.*--chat-template FILE\|chatml"):
            run(tmp_path, [f], tokenizer=str(spec))
        assert_no_leftovers(tmp_path)
    meta = run(tmp_path, [f], tokenizer=str(bpe), chat_template="chatml")
    assert meta["tokenizer"]["chat_template"]["source"] == "--chat-template"
    tok = load_tokenizer(str(bpe))
    for c, (ids, mask) in zip(CHATS, samples(tmp_path / "out")):
        # <|im_end|> is one trained token per answer, never seven pieces of text
        assert tok.hf.decode(ids[mask == 1].tolist()) == "".join(m["content"] + "<|im_end|>" for m in c
                                                                 if m["role"] == "assistant")
    tpl = tmp_path / "t.jinja"
    tpl.write_text((Path(__file__).parents[1] / "assets/templates/chatml.jinja").read_text())
    run(tmp_path, [f], name="file", tokenizer=str(bpe), chat_template=str(tpl))
    assert [i.tolist() for i, _ in samples(tmp_path / "file")] == [i.tolist() for i, _ in samples(tmp_path / "out")]


def test_provenance_expansion_counts_and_mask_options_in_meta(tmp_path):
    from dflash_prep.tokenize.chat import MaskOptions

    bpe = train_bpe(tmp_path / "bpe", extra_tokens=["<think>", "</think>"])
    qwen = Path(__file__).parents[1] / "assets/templates/qwen3-gen.jinja"
    rows = [{"messages": c} for c in CHATS]  # CHATS[1] has two assistant turns
    f = write_jsonl(tmp_path / "chat.jsonl", rows)
    meta = run(tmp_path, [f], tokenizer=str(bpe), chat_template=str(qwen))
    assert meta["counts"]["expanded_conversations"] == 1 and meta["counts"]["rows_from_expansion"] == 2
    assert meta["counts"]["samples"] == 4 and _shard_column(tmp_path / "out", "record") == [0, 1, 1, 2]
    t = meta["tokenizer"]
    assert set(t["files"]) == {"tokenizer.json", "tokenizer_config.json"} and t["chat_template"]["generation_blocks"]
    import hashlib

    assert t["chat_template"]["sha256"] == hashlib.sha256(qwen.read_bytes()).hexdigest()
    assert meta["mask"] == MaskOptions().to_dict()
    never = run(tmp_path, [f], name="never", tokenizer=str(bpe), chat_template=str(qwen),
                mask=MaskOptions(expand_turns="never", train_on_eos="none"))
    assert never["counts"]["samples"] == 3 and never["mask"]["expand_turns"] == "never"
    assert never["inputs_fingerprint"] != meta["inputs_fingerprint"]


def test_up_to_date_keys_on_contents_not_paths(tmp_path):
    import shutil

    d = tmp_path / "corpus"
    d.mkdir()
    write_jsonl(d / "c.jsonl", [{"messages": c} for c in CHATS])
    first = run(tmp_path, [d])
    moved = tmp_path / "moved"
    shutil.copytree(d, moved)
    (moved / "c.jsonl").touch()
    again = run(tmp_path, [moved])  # a copied corpus with new mtimes: same contents, same key
    assert again["up_to_date"] and again["fingerprint"] == first["fingerprint"]
    write_jsonl(moved / "c.jsonl", [{"messages": c} for c in CHATS[:2]])
    with pytest.raises(ConfigError, match="other inputs"):
        run(tmp_path, [moved])


def test_message_keys_reach_the_template_as_they_are():
    from dflash_prep.tokenize import records as rec

    msgs = rec.to_messages({"messages": [
        {"role": "user", "content": "hi", "name": None},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}],
         "reasoning_content": "r"}]}, "messages", ("messages",))
    assert msgs == [{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "", "reasoning_content": "r",
                     "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]
