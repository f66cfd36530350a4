"""Tokenizers and chat rendering: byte-level equivalence, mask alignment, local-only loading."""

from __future__ import annotations

import json

import numpy as np
import pytest

from .assets.fixtures import CHATS, train_bpe
from dflash_prep.errors import ConfigError, InputError
from dflash_prep.encoders import ByteTokenizer, load_tokenizer, render_chat


def expected_trained(messages, end="<|im_end|>") -> str:
    return "".join(m["content"] + end for m in messages if m["role"] == "assistant")


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    return train_bpe(tmp_path_factory.mktemp("bpe"))


def test_byte_ids_equal_tokenizers_equivalent():
    tok = ByteTokenizer()
    hf = tok.to_tokenizers()
    for msgs in CHATS:
        segs = render_chat(tok, msgs)
        ids, mask = tok.encode_segments_batch([segs], chat=True)[0]
        assert ids.dtype == np.int32 and mask.dtype == np.uint8 and ids.shape == mask.shape
        assert ids.tolist() == hf.encode("".join(t for t, _ in segs)).ids
        assert int(ids.max()) < tok.info.vocab_size


def test_byte_mask_covers_assistant_tokens_only():
    tok = ByteTokenizer()
    for msgs in CHATS:
        ids, mask = tok.encode_segments_batch([render_chat(tok, msgs)], chat=True)[0]
        trained = ids[mask == 1]
        # the trained tokens are exactly the assistant contents' bytes, each followed by <|im_end|> (258)
        want = []
        for m in msgs:
            if m["role"] == "assistant":
                want += list(m["content"].encode()) + [258]
        assert trained.tolist() == want
        # nothing of the user/system side or the role headers is trained on
        assert ids[mask == 0].tolist().count(257) == len(msgs)


def test_byte_plain_text_masked_in_full_with_eos():
    tok = ByteTokenizer()
    ids, mask = tok.encode_segments_batch([[("héllo", True)]], chat=False)[0]
    assert ids.tolist() == list("héllo".encode()) + [tok.info.eos_id]
    assert mask.tolist() == [1] * len(ids)


def test_content_cannot_inject_special_tokens():
    tok = ByteTokenizer()
    msgs = [{"role": "user", "content": "x<|im_end|>y"}, {"role": "assistant", "content": "ok"}]
    ids, _ = tok.encode_segments_batch([render_chat(tok, msgs)], chat=True)[0]
    assert ids.tolist().count(258) == 2  # the two real turn ends only


@pytest.mark.parametrize("which", ["folder with template", "bare tokenizer.json"])
def test_hf_mask_alignment(bpe_dir, which):
    tok = load_tokenizer(str(bpe_dir if which.startswith("folder") else bpe_dir / "tokenizer.json"))
    assert (tok.chat_template is not None) == which.startswith("folder")
    batch = [render_chat(tok, m) for m in CHATS]
    for msgs, segs, (ids, mask) in zip(CHATS, batch, tok.encode_segments_batch(batch, chat=True)):
        text = "".join(t for t, _ in segs)
        enc = tok.tok.encode(text, add_special_tokens=False)
        assert ids.tolist() == enc.ids  # whole-text encoding, as at inference
        assert tok.tok.decode(ids[mask == 1].tolist(), skip_special_tokens=False) == expected_trained(msgs)
        # position by position: a token is trained iff its characters lie in an assistant span
        spans, pos = [], 0
        for t, trainable in segs:
            if trainable:
                spans.append((pos, pos + len(t)))
            pos += len(t)
        for k, (a, b) in enumerate(enc.offsets):
            inside = any(a < hi and b > lo for lo, hi in spans)
            assert mask[k] == inside, f"token {k} {text[a:b]!r}: mask {mask[k]} but inside={inside}"


def test_hf_template_and_builtin_chatml_agree(bpe_dir, tmp_path):
    """The shipped ChatML Jinja template renders exactly what the built-in layout renders."""
    with_tpl = load_tokenizer(str(bpe_dir))
    bare = load_tokenizer(str(bpe_dir / "tokenizer.json"))  # a bare tokenizer.json: no template
    assert bare.chat_template is None and bare.info.fingerprint != with_tpl.info.fingerprint
    for msgs in CHATS:
        a = with_tpl.encode_segments_batch([render_chat(with_tpl, msgs)], chat=True)[0]
        b = bare.encode_segments_batch([render_chat(bare, msgs)], chat=True)[0]
        assert a[0].tolist() == b[0].tolist() and a[1].tolist() == b[1].tolist()


def test_hf_plain_text_gets_eos(bpe_dir):
    tok = load_tokenizer(str(bpe_dir))
    assert tok.info.eos_id == tok.tok.token_to_id("<|im_end|>")  # from tokenizer_config.json
    ids, mask = tok.encode_segments_batch([[("the model", True)]], chat=False)[0]
    assert ids[-1] == tok.info.eos_id and mask.all()


def test_template_that_rewrites_content_is_an_error(bpe_dir, tmp_path):
    folder = tmp_path / "upper"
    folder.mkdir()
    (folder / "tokenizer.json").write_text((bpe_dir / "tokenizer.json").read_text())
    tpl = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}\n{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": tpl}))
    tok = load_tokenizer(str(folder))
    with pytest.raises(InputError, match="rewrites assistant content"):
        render_chat(tok, CHATS[0])


def test_missing_tokenizer_path_never_downloads(tmp_path):
    with pytest.raises(ConfigError, match="never downloads"):
        load_tokenizer("Qwen/Qwen2.5-0.5B")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path / "empty"))


def test_corrupt_tokenizer_json(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(InputError, match="not a valid tokenizer.json"):
        load_tokenizer(str(bad))
