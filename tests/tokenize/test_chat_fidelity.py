"""ids and loss mask token for token against transformers: 2 real tokenizers x 4 template families
x {plain, {% generation %}} x 100 generated conversations (adversarial ones included).

References, all from transformers on the same tokenizer folder:

- ids: ``apply_chat_template(messages, tokenize=True)``; where content spells a special
  token, ``apply_chat_template(..., sanitize_control_tokens=True)`` (with
  ``chat_control_tokens = []``: special tokens only), which encodes that spelling as text;
- mask: ``return_assistant_tokens_mask`` of the family's ``{% generation %}`` variant (the
  same text); the plain variant's prefix-derived mask must equal it. Where content spells a
  special token, transformers has no mask to compare with (it refuses both options at
  once), so the trained text is compared instead;
- rows of an expanded conversation (thinking templates): row k is ``messages[:i_k + 1]``
  and its mask is the reference mask of that row restricted to its last assistant turn.
"""

from __future__ import annotations

import pytest

from dflash_prep.tokenize.chat import MaskOptions, mark, plan_rows
from dflash_prep.tokenize.encoders import load_tokenizer

from dflash_prep.tests.assets.conversations import FAMILIES, bpe_folder, conversations, spm_folder, template

pytest.importorskip("mistral_common")
pytest.importorskip("sentencepiece")

CONVS = conversations(100)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    d = tmp_path_factory.mktemp("toks")
    return {"spm": spm_folder(d), "bpe": bpe_folder(d)}


def _last_run(mask: list[int]) -> list[int]:
    """Only the last maximal run of ones (the last assistant turn's block)."""
    if 1 not in mask:
        return mask
    end = len(mask) - mask[::-1].index(1)
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    return [int(start <= k < end) for k in range(len(mask))]


@pytest.mark.parametrize("generation", [False, True], ids=["plain", "generation"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("which", ["spm", "bpe"])
def test_ids_and_mask_equal_transformers(folders, which, family, generation):
    tpl, ref_tpl = template(family, generation), template(family, True)
    tok = load_tokenizer(str(folders[which]), chat_template=tpl)
    hf = tok.hf
    hf.chat_control_tokens = []
    assert tok.has_generation == generation
    expanded = escaped = checked = 0
    for n, msgs in enumerate(CONVS):
        marked_msgs, marked = mark(msgs, tok.control)
        rows, exp = plan_rows(marked_msgs, tok.render, MaskOptions(), has_generation=tok.has_generation,
                              control=tok.control, marked=marked)
        expanded += exp
        escaped += marked
        turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        subs = [msgs[: i + 1] for i in turns] if exp else [msgs]
        assert len(rows) == len(subs)
        for (ids, mask), sub in zip(tok.encode_rows(rows), subs):
            ref = hf.apply_chat_template(sub, chat_template=ref_tpl, return_assistant_tokens_mask=True)
            want_mask = _last_run(ref["assistant_masks"]) if exp else ref["assistant_masks"]
            where = f"{which}/{family}{'-gen' if generation else ''} conversation {n}"
            if marked:
                want = hf.apply_chat_template(sub, chat_template=tpl, sanitize_control_tokens=True)["input_ids"]
                assert ids.tolist() == want, where
                assert hf.decode(ids[mask == 1].tolist()) == \
                    hf.decode([t for t, k in zip(ref["input_ids"], want_mask) if k]), where
            else:
                assert hf.apply_chat_template(sub, chat_template=tpl, tokenize=False) == \
                    hf.apply_chat_template(sub, chat_template=ref_tpl, tokenize=False)
                assert ids.tolist() == ref["input_ids"], where
                assert mask.tolist() == want_mask, (where, hf.decode(ids[mask == 1].tolist()),
                                                    hf.decode([t for t, k in zip(ids.tolist(), want_mask) if k]))
            checked += 1
    assert escaped >= 5  # the adversarial spellings really occur
    if family == "qwen3":
        assert expanded > 20  # the thinking template rewrites history in every multi-turn chat
    else:
        assert expanded == 0


def test_expand_never_trains_the_last_turn(folders):
    tpl = template("qwen3", True)
    tok = load_tokenizer(str(folders["bpe"]), chat_template=tpl)
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>\nr1\n</think>\n\nA1"},
            {"role": "user", "content": "b"}, {"role": "assistant", "content": "<think>\nr2\n</think>\n\nA2"}]
    rows, exp = plan_rows(msgs, tok.render, MaskOptions(expand_turns="never"), has_generation=True, control=tok.control)
    assert not exp and len(rows) == 1
    (ids, mask), = tok.encode_rows(rows)
    assert ids.tolist() == tok.hf.apply_chat_template(msgs, chat_template=tpl)["input_ids"]
    assert tok.hf.decode(ids[mask == 1].tolist()) == "<think>\nr2\n</think>\n\nA2<|im_end|>"
    rows, exp = plan_rows(msgs, tok.render, MaskOptions(), has_generation=True, control=tok.control)
    assert exp and [tok.hf.decode(i[m == 1].tolist()) for i, m in tok.encode_rows(rows)] == \
        ["<think>\nr1\n</think>\n\nA1<|im_end|>", "<think>\nr2\n</think>\n\nA2<|im_end|>"]


def test_legacy_false_is_applied(folders):
    """The Llama-2 case of the issue: no `▁[` after `<s>` when the config says legacy: false."""
    tok = load_tokenizer(str(folders["spm"]), chat_template=template("llama2", True))
    (ids, _), = tok.encode_rows(plan_rows(CONVS[0], tok.render, MaskOptions(), has_generation=True,
                                          control=tok.control)[0])
    pieces = tok.hf.convert_ids_to_tokens(ids.tolist())
    assert pieces[:2] == ["<s>", "["], pieces[:4]
