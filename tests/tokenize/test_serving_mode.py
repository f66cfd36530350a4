"""tokenize's ``serving_mode`` block: the thinking mode read from regenerate's per-record
``--reasoning``, ``--thinking`` declaring or contradicting it, the template hash, and an old
``meta.json`` without the block."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from dflash_prep.errors import ConfigError
from dflash_prep.formats.dataset import read_meta
from dflash_prep.tokenize.encoders import ByteTokenizer
from dflash_prep.tokenize.identity import chat_template_sha256
from dflash_prep.tokenize.thinking import (SOURCE_FLAG, SOURCE_NONE, SOURCE_OLD, SOURCE_RECORDS, record_mode,
                                           serving_mode_of)
from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize

from dflash_prep.tests.assets.fixtures import CHATS, train_bpe, write_jsonl

THINKING_TEMPLATE = ("{% for m in messages %}<|{{m.role}}|>{{m.content}}{% endfor %}{% if add_generation_prompt %}"
                     "<|assistant|>{% if enable_thinking is defined and not enable_thinking %}<think></think>"
                     "{% endif %}{% endif %}")


def _regenerated(reasoning: str | None, chats=CHATS, *, thought: bool = True) -> list[dict]:
    """Records the way ``dflash-prep regenerate`` writes them (None: a record it did not write); under
    ``keep`` with ``thought``, the written turn opens with the target's ``<think>`` block."""
    out = []
    for i, c in enumerate(chats):
        if reasoning == "keep" and thought:
            c = [dict(m, content=f"<think>\nstep {i}\n</think>\n\n{m['content']}") if j == 1 else m
                 for j, m in enumerate(c)]
        r = {"messages": c}
        if reasoning is not None:
            r["regenerate"] = {"record": i, "source": {"path": "in.jsonl", "row": i}, "target": {"model": "t"},
                               "reasoning": reasoning, "turns_mode": "all", "keep_assistant": False,
                               "turns": [{"message": 1, "finish_reason": "stop", "truncated": False,
                                          "prompt_tokens": 5, "completion_tokens": 7, "seed": None,
                                          "reasoning_removed_chars": 0}]}
        out.append(r)
    return out


def _run(tmp_path, records, name="out", **kw):
    f = write_jsonl(tmp_path / f"{name}.jsonl", records)
    return tokenize(TokenizeConfig(inputs=(str(f),), out=tmp_path / name, tokenizer="byte", **kw))


def _byte_template_sha() -> str:
    return hashlib.sha256(ByteTokenizer().chat_template.encode()).hexdigest()


@pytest.mark.parametrize("reasoning, mode", [("keep", "on"), ("strip", "off"), ("disable", "off")])
def test_regenerate_reasoning_gives_the_mode(tmp_path, reasoning, mode):
    meta = _run(tmp_path, _regenerated(reasoning))
    sm = read_meta(tmp_path / "out")["serving_mode"]
    assert sm == meta["serving_mode"]
    n = len(CHATS)
    assert sm == {"thinking": mode, "source": SOURCE_RECORDS,
                  "counts": {"on": n if mode == "on" else 0, "off": n if mode == "off" else 0, "unknown": 0},
                  "chat_template_sha256": _byte_template_sha()}
    assert sm["chat_template_sha256"] == meta["tokenizer"]["chat_template"]["sha256"]


def test_keep_on_a_target_that_wrote_no_reasoning_is_off(tmp_path):
    """``keep`` is the default: answers without any ``<think>`` block were written without reasoning."""
    sm = _run(tmp_path, _regenerated("keep", thought=False))["serving_mode"]
    assert sm["thinking"] == "off" and sm["counts"] == {"on": 0, "off": len(CHATS), "unknown": 0}
    with pytest.raises(ConfigError, match="or keep on a target that wrote none"):
        _run(tmp_path, _regenerated("keep", thought=False), name="b", thinking="on")


def test_records_without_regenerate_are_unknown(tmp_path):
    sm = _run(tmp_path, _regenerated(None))["serving_mode"]
    assert sm["thinking"] == "unknown" and sm["source"] == SOURCE_NONE
    assert sm["counts"] == {"on": 0, "off": 0, "unknown": len(CHATS)}


def test_mixed_records_and_records_that_do_not_say(tmp_path):
    chats = CHATS * 2
    on, off, none = _regenerated("keep", chats)[:2], _regenerated("strip", chats)[2:3], _regenerated(None, chats)[3:]
    sm = _run(tmp_path, on + off + none)["serving_mode"]
    assert sm["thinking"] == "mixed" and sm["counts"] == {"on": 2, "off": 1, "unknown": len(none)}
    # records that do not say are counted, not decisive
    sm = _run(tmp_path, on + none, name="b")["serving_mode"]
    assert sm["thinking"] == "on" and sm["counts"] == {"on": 2, "off": 0, "unknown": len(none)}


def test_only_records_that_produced_samples_count(tmp_path):
    bad = {"messages": [{"role": "user"}], "regenerate": {"reasoning": "strip"}}  # no content: skipped
    meta = _run(tmp_path, _regenerated("keep") + [bad], on_error="skip")
    assert meta["counts"]["skipped"] == 1
    assert meta["serving_mode"]["thinking"] == "on" and meta["serving_mode"]["counts"]["off"] == 0


def test_thinking_flag_declares_the_mode_and_is_fingerprinted(tmp_path):
    auto = _run(tmp_path, _regenerated(None), name="a")
    sm = _run(tmp_path, _regenerated(None), name="b", thinking="off")["serving_mode"]
    assert sm["thinking"] == "off" and sm["source"] == SOURCE_FLAG
    assert _run(tmp_path, _regenerated("keep"), name="c", thinking="on")["serving_mode"]["thinking"] == "on"
    # the same inputs under a declared mode are another dataset (the up-to-date check must not return auto's)
    again = tokenize(TokenizeConfig(inputs=(str(tmp_path / "a.jsonl"),), out=tmp_path / "a", tokenizer="byte",
                                    thinking="on", overwrite=True))
    assert not again["up_to_date"] and again["serving_mode"]["thinking"] == "on"
    assert again["inputs_fingerprint"] != auto["inputs_fingerprint"]
    # auto keeps the fingerprint datasets had before the option existed: no "thinking" in the options
    assert "thinking" not in auto["options"]
    # the shards' ids are the same whatever the declared mode
    a, b = (np.load(tmp_path / n / "lengths.npy") for n in ("a", "b"))
    assert np.array_equal(a, b)


@pytest.mark.parametrize("declared, reasoning", [("on", "strip"), ("on", "disable"), ("off", "keep")])
def test_a_declared_mode_that_records_contradict_is_refused(tmp_path, declared, reasoning):
    with pytest.raises(ConfigError, match=f"--thinking {declared} contradicts the data") as e:
        _run(tmp_path, _regenerated(reasoning), thinking=declared)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()   # nothing written


def test_bad_thinking_value_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="--thinking must be one of auto, on, off"):
        TokenizeConfig(inputs=("x",), out=tmp_path / "o", tokenizer="byte", thinking="yes")


def test_chat_template_is_hashed_with_the_one_function(tmp_path):
    from transformers import AutoTokenizer

    from dflash_prep.tokenize.identity import tokenizer_template_sha256

    bpe = train_bpe(tmp_path / "bpe")
    records = _regenerated("keep")
    f = write_jsonl(tmp_path / "in.jsonl", records)
    # the tokenizer's own template: the hash the evaluator computes on the target's tokenizer
    meta = tokenize(TokenizeConfig(inputs=(str(f),), out=tmp_path / "a", tokenizer=str(bpe)))
    want = tokenizer_template_sha256(AutoTokenizer.from_pretrained(bpe))
    assert want == hashlib.sha256(json.loads((bpe / "tokenizer_config.json").read_text())["chat_template"]
                                  .encode()).hexdigest()
    assert meta["serving_mode"]["chat_template_sha256"] == want == meta["tokenizer"]["chat_template"]["sha256"]
    # --chat-template: the override's text
    (tmp_path / "t.jinja").write_text(THINKING_TEMPLATE)
    meta = tokenize(TokenizeConfig(inputs=(str(f),), out=tmp_path / "b", tokenizer=str(bpe),
                                   chat_template=str(tmp_path / "t.jinja")))
    want = chat_template_sha256(THINKING_TEMPLATE)
    assert want == hashlib.sha256(THINKING_TEMPLATE.encode()).hexdigest()
    assert meta["serving_mode"]["chat_template_sha256"] == want == meta["tokenizer"]["chat_template"]["sha256"]
    assert chat_template_sha256(None) is None


def test_record_mode_of_odd_records():
    thought = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>\nplan\n</think>\n\nA."}]
    plain = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "A."}]
    keep = {"reasoning": "keep", "turns": [{"message": 1}]}
    assert record_mode({"messages": thought, "regenerate": keep}) == "on"
    assert record_mode({"messages": plain, "regenerate": keep}) == "off"
    # the template opened the block in the prompt; --max-tokens cut one: either mark is reasoning
    for text in ("plan\n</think>\n\nA.", "<think>\nplan that was cu"):
        msgs = [plain[0], {"role": "assistant", "content": text}]
        assert record_mode({"messages": msgs, "regenerate": keep}) == "on"
    # only the turns the target wrote count; a record that does not say which: every assistant turn
    kept = [*thought, {"role": "user", "content": "q2"}, {"role": "assistant", "content": "B."}]
    assert record_mode({"messages": kept, "regenerate": {"reasoning": "keep", "turns": [{"message": 3}]}}) == "off"
    assert record_mode({"messages": kept, "regenerate": {"reasoning": "keep"}}) == "on"
    assert record_mode({"messages": kept, "regenerate": {"reasoning": "keep", "turns": [{"message": 9}]}}) == "on"
    assert record_mode({"regenerate": {"reasoning": "keep"}}) == "off"        # no messages: nothing thought
    assert record_mode({"messages": "x", "regenerate": keep}) == "off"
    assert record_mode({"messages": plain, "regenerate": {"reasoning": "strip", "turns": [{"message": 1}]}}) == "off"
    assert record_mode({"regenerate": {"reasoning": "later-version"}}) == "unknown"
    assert record_mode({"regenerate": None}) == "unknown"
    assert record_mode({"regenerate": "keep"}) == "unknown"
    assert record_mode({}) == "unknown"


def test_an_old_meta_without_the_block_reads_as_unknown(tmp_path):
    meta = _run(tmp_path, _regenerated("keep"))
    old = {k: v for k, v in meta.items() if k != "serving_mode"}
    sm = serving_mode_of(old)
    assert sm["thinking"] == "unknown" and sm["source"] == SOURCE_OLD
    assert sm["chat_template_sha256"] == meta["tokenizer"]["chat_template"]["sha256"]
    assert json.dumps(sm)  # plain JSON, as the trainer records it
