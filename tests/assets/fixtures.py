"""Tiny fixtures generated on the fly: a BPE tokenizer trained offline and small corpora."""

from __future__ import annotations

import json
from pathlib import Path

ASSETS = Path(__file__).parent
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATS = [
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "What is 2 + 2?"},
     {"role": "assistant", "content": "It is 4."}],
    [{"role": "user", "content": "Write a loop in Python."},
     {"role": "assistant", "content": "```python\nfor i in range(3):\n    print(i)\n```"},
     {"role": "user", "content": "Now in words, with accents: café, naïve."},
     {"role": "assistant", "content": " Loop three times, print each number. Café ✓"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there! How can I help?"}],
]


def train_bpe(folder: Path, *, template: bool = True, vocab_size: int = 400, extra_specials=(), extra_tokens=()) -> Path:
    """Train a byte-level BPE on synth text (seconds, no network) and save an HF-style folder.

    ``extra_specials`` become special added tokens, ``extra_tokens`` plain (non-special) ones.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    from dflash_prep.synth.synth import _pool

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = _pool(1)[:100_000]
    tok.train_from_iterator([text[i:i + 1000] for i in range(0, len(text), 1000)], trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra_specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra_tokens])
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}
    if template:
        config["chat_template"] = (ASSETS / "templates" / "chatml.jinja").read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path
