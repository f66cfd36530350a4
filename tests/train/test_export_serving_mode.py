"""The serving mode travels with the drafter: a tiny run of each drafter objective records its
dataset's ``serving_mode`` (log header, checkpoint) and its export's ``config.json`` carries the
``dflash_prep`` block, which our own readers (the method, the strict loaders, the evaluator's
reader) accept; and ``render_messages`` passes ``enable_thinking`` to the chat template."""

from __future__ import annotations

import json

import pytest

from dflash_prep.engine.method import export_method
from dflash_prep.engine.serving_mode import BLOCK_VERSION, mode_warnings, resolve_thinking, training_mode
from dflash_prep.train import checkpoint as ckpt
from dflash_prep.train.export import RECIPE_OPTIONS, export
from dflash_prep.train.loop import train

from dflash_prep.tests.train.dflash_fixtures import dflash_cfg, tiny_target
from dflash_prep.tests.train.eagle3_fixtures import eagle3_cfg, eagle3_source
from dflash_prep.tests.train.train_fakes import FakeSource

SERVING = {"thinking": "off", "source": "records (regenerate --reasoning)",
           "counts": {"on": 0, "off": 48, "unknown": 0}, "chat_template_sha256": "ab" * 32}
D2 = dict(objective="dflash2", conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4,
          selector_init="normal")


def _run(tmp_path, kind: str, serving: dict | None):
    """One step of a ``kind`` drafter on the fakes (their dataset given ``serving``'s meta), exported."""
    target = tiny_target()
    if kind == "eagle3":
        src, cfg = eagle3_source(), eagle3_cfg(tmp_path / "run", target, max_steps=1)
    else:
        src = FakeSource(n=48, layout="varlen")
        cfg = dflash_cfg(tmp_path / "run", target, max_steps=1, **(D2 if kind == "dflash2" else {}))
    if serving is not None:   # a meta.json of the target's tokenizer (the trainer checks it) and its serving mode
        from transformers import AutoTokenizer

        from dflash_prep.tokenize.encoders import tokenizer_file_hashes
        from dflash_prep.tokenize.identity import tokenizer_template_sha256

        tok = {"files": tokenizer_file_hashes(target),
               "chat_template": {"sha256": tokenizer_template_sha256(AutoTokenizer.from_pretrained(target))}}
        src.dataset.meta = {"tokenizer": tok, "serving_mode": serving}
    train(cfg, source=src)
    export(tmp_path / "run", tmp_path / "x")
    return json.loads((tmp_path / "x" / "config.json").read_text())


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "eagle3"])
def test_a_runs_export_carries_the_block_and_our_readers_accept_it(tmp_path, kind):
    c = _run(tmp_path, kind, SERVING)
    block = c["dflash_prep"]
    assert list(c)[-1] == "dflash_prep"          # ours, after the engine's fields
    assert block["version"] == BLOCK_VERSION and block["thinking"] == "off"
    assert block["thinking_source"] == SERVING["source"] and block["chat_template_sha256"] == "ab" * 32
    assert block["dataset_fingerprint"] == "fake-data-48-4-40-0"
    recipe = block["recipe"]
    assert recipe["objective"] == kind and recipe["optimizer"] == "adamw" and recipe["steps"] == 1
    assert recipe["lr"] == 3e-3 and set(RECIPE_OPTIONS) <= set(recipe)
    assert not {"target_fingerprint", "tokenizer_hash", "chat_template_hash"} & set(recipe)
    if kind != "eagle3":
        assert recipe["block_size"] == 4 and recipe["loss"] == "ce"
    # the run recorded it where it records its dataset and contract
    header = json.loads((tmp_path / "run" / "log.jsonl").read_text().splitlines()[0])
    assert header["serving_mode"] == SERVING
    assert ckpt.load(tmp_path / "run" / ckpt.CKPT_FILE)["extra"]["serving_mode"] == SERVING
    # our readers: the method vLLM is asked for, the strict loader, the evaluator's reader
    assert export_method(tmp_path / "x").kind == kind
    if kind == "dflash":
        from dflash_prep.train.objectives.dflash.export import load_export
    elif kind == "dflash2":
        from dflash_prep.train.objectives.dflash2.export import load_export
    else:
        from dflash_prep.train.objectives.eagle3.export import load_export
    load_export(tmp_path / "x")
    assert training_mode(tmp_path / "x") == block
    assert resolve_thinking("auto", [tmp_path / "x"])[0] is False
    assert mode_warnings(export_dir=tmp_path / "x", requested="off", template_sha="ab" * 32) == []
    assert len(mode_warnings(export_dir=tmp_path / "x", requested="on", template_sha="ab" * 32)) == 1


def test_a_run_on_a_dataset_without_the_block_exports_mode_unknown(tmp_path):
    block = _run(tmp_path, "dflash", None)["dflash_prep"]
    assert block["thinking"] == "unknown" and block["chat_template_sha256"] is None
    assert block["thinking_source"] == "the run recorded no serving mode"
    assert resolve_thinking("auto", [tmp_path / "x"])[0] is None


def test_the_block_is_the_same_bytes_for_the_same_run(tmp_path):
    """Nothing machine- or path-dependent in it (the golden test pins config.json's bytes)."""
    a = _run(tmp_path / "a", "dflash", SERVING)
    b = _run(tmp_path / "b", "dflash", SERVING)
    assert a["dflash_prep"] == b["dflash_prep"]
    assert str(tmp_path) not in json.dumps(a["dflash_prep"])


THINKING_TEMPLATE = ("{% for m in messages %}<|{{m.role}}|>{{m.content}}{% endfor %}{% if add_generation_prompt %}"
                     "<|assistant|>{% if enable_thinking is defined and not enable_thinking %}<think></think>"
                     "{% endif %}{% endif %}")


def test_render_messages_sends_enable_thinking_only_when_given(tmp_path):
    from transformers import AutoTokenizer

    from dflash_prep.errors import FormatError
    from dflash_prep.train.prompts import load_prompts, render_messages

    from dflash_prep.tests.assets.fixtures import train_bpe

    tok = AutoTokenizer.from_pretrained(train_bpe(tmp_path / "bpe"))
    tok.chat_template = THINKING_TEMPLATE
    msgs = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]
    on, off, default = (render_messages(tok, msgs[:1], enable_thinking=v) for v in (True, False, None))
    assert off != on and default == on             # the template thinks unless told not to
    assert tok.decode(off).endswith("<|assistant|><think></think>")
    assert tok.decode(on).endswith("<|assistant|>") and tok.decode(on) == "<|user|>What is 2 + 2?<|assistant|>"
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"messages": msgs}) + "\n" + json.dumps({"prompt": "raw"}) + "\n")
    assert load_prompts(f, tok, enable_thinking=False)[0] == off and load_prompts(f, tok)[0] == default
    assert load_prompts(f, tok, enable_thinking=True)[1] == load_prompts(f, tok, enable_thinking=False)[1]
    f.write_text(json.dumps({"messages": msgs[1:]}) + "\n")
    with pytest.raises(FormatError, match=r"p\.jsonl:1: the conversation opens with an assistant turn"):
        load_prompts(f, tok)
