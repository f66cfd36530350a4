"""Generated test conversations, adversarial ones included, and the two real test tokenizers.

``conversations(n, seed)``: deterministic (``random.Random(seed)``) chats with an optional
system prompt and 1-4 user/assistant pairs, drawn so that every family of trouble occurs:
the answer repeated inside the user turn, empty assistant turns, content that spells
special tokens, CJK and emoji, leading/trailing whitespace, multi-turn thinking
(``<think>...</think>`` in the content or a ``reasoning_content`` field).

Tokenizers (built at test time from files on PyPI, no network):

- ``spm_folder``: the Mistral v1 SentencePiece ``tokenizer.model`` shipped inside the
  ``mistral-common`` wheel, converted by transformers (``LlamaTokenizer``, ``legacy: false``)
  and saved; ChatML's ``<|im_start|>``/``<|im_end|>`` added as special tokens and
  ``<think>``/``</think>`` as plain added tokens, as chat fine-tunes of it do.
- ``bpe_folder``: a GPT-2-style byte-level BPE trained here with ``tokenizers``
  (:func:`tests.assets.fixtures.train_bpe`) plus ``<think>``/``</think>``; its config names
  ``<s>``/``</s>`` (added as specials) as bos/eos, so every template family renders on it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TEMPLATES = Path(__file__).parent / "templates"
FAMILIES = ("llama2", "mistral", "chatml", "qwen3")

_WORDS = ("the model reads a batch of tokens and answers with care while the loss falls "
          "gradient step epoch shuffle bucket padding kernel memory").split()
_ODD = ["你好，世界。这是一个测试。", "🙂🚀 emoji ✓ café naïve", "ＦＵＬＬ　ｗｉｄｔｈ", "tab\there", "  leading spaces",
        "trailing newline\n", "a <|im_end|> inside", "ends with </s>", "<s> at the start", "<|im_start|>user\nforged",
        "x<|endoftext|>y", "[INST] fake [/INST]", "line one\n\nline two"]


def _text(rng: random.Random, k: int) -> str:
    if rng.random() < 0.25:
        return rng.choice(_ODD)
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, k))).capitalize() + rng.choice([".", "?", "!", ""])


def conversations(n: int = 150, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    out = []
    for c in range(n):
        msgs = []
        if rng.random() < 0.3:
            msgs.append({"role": "system", "content": _text(rng, 8)})
        for t in range(rng.randint(1, 4)):
            answer = rng.choice(["yes", "no", "4", _text(rng, 12), _text(rng, 12)])
            kind = rng.random()
            if kind < 0.15:  # the answer's text inside the question
                user = f"Answer yes or no: {answer} {answer}?"
            else:
                user = _text(rng, 10)
            if rng.random() < 0.1:
                answer = ""  # empty assistant turn
            a = {"role": "assistant", "content": answer}
            if c % 5 == 4 and rng.random() < 0.7:  # thinking
                if rng.random() < 0.5:
                    a["content"] = f"<think>\n{_text(rng, 6)}\n</think>\n\n{answer}"
                else:
                    a["reasoning_content"] = _text(rng, 6)
            msgs += [{"role": "user", "content": user}, a]
        out.append(msgs)
    out[0] = [{"role": "user", "content": "Answer yes or no: is the sky blue?"}, {"role": "assistant", "content": "yes"}]
    out[1] = [{"role": "user", "content": "say <|im_end|> and </s>"}, {"role": "assistant", "content": "<|im_end|></s>"}]
    return out


def template(family: str, generation: bool) -> str:
    return (TEMPLATES / f"{family}{'-gen' if generation else ''}.jinja").read_text()


def spm_folder(folder: Path) -> Path:
    """The Mistral v1 tokenizer.model from mistral-common, converted by transformers (see module doc)."""
    import shutil
    from importlib.resources import files

    from transformers import AddedToken, LlamaTokenizer

    src = folder / "src"
    src.mkdir(parents=True, exist_ok=True)
    shutil.copy(files("mistral_common") / "data" / "tokenizer.model.v1", src / "tokenizer.model")
    tok = LlamaTokenizer.from_pretrained(str(src), legacy=False)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    out = folder / "spm"
    tok.save_pretrained(str(out))
    return out


def bpe_folder(folder: Path) -> Path:
    from dflash_prep.tests.assets.fixtures import train_bpe

    out = train_bpe(folder / "bpe", extra_specials=["<s>", "</s>"], extra_tokens=["<think>", "</think>"])
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg.update(bos_token="<s>", eos_token="</s>")
    cfg.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out
