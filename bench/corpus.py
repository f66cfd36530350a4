"""The second length set: the demo chat corpus, tokenized with a BPE trained by ``tokenizers``.

No real chat corpus with realistic lengths can be had offline here: nothing is downloaded
at run time, and the one chat corpus a PyPI package ships (``chatterbot-corpus``: a few
thousand one- or two-line exchanges of 10-60 tokens) is too short to exercise buckets
between 65 and 8191 tokens. So, as issue 7 allows:

1. ``dflash_prep.synth`` writes ``n`` demo conversations (seedlike-shaped byte lengths);
2. a byte-level BPE (vocabulary 8192, ChatML special tokens) is trained with ``tokenizers``
   on the first ``train_on`` conversations' rendered text;
3. every conversation is rendered with the built-in ChatML layout and encoded through
   ``dflash_prep.tokenize.encoders.encode_chats`` (``--chat-template chatml``), exactly what
   ``tokenize`` does per sample, giving one int64 length per sample.

BPE compresses the demo text several-fold, so this set is shorter and differently shaped
than seedlike. The lengths are cached in ``WORK/lengths.npy`` beside ``WORK/lengths.json``
(format ``dflash-prep/bench-corpus`` v1 with the parameters and the array fingerprint);
a cache whose parameters or fingerprint differ is rebuilt.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dflash_prep.errors import FormatError
from dflash_prep.formats.fileio import atomic_save_npy, atomic_write_json, fingerprint_array, load_npy, read_json

CORPUS_FORMAT = "dflash-prep/bench-corpus"
CORPUS_VERSION = 1
VOCAB = 8192
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _conversations(path: Path):
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["messages"]


def train_bpe(corpus: Path, out: Path, *, train_on: int, vocab: int = VOCAB) -> Path:
    """Train a byte-level BPE (``vocab`` ids) on the first ``train_on`` conversations of a
    ``chat.jsonl``; write ``out/tokenizer.json`` and return ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from dflash_prep.formats.fileio import atomic_write_bytes
    from dflash_prep.tokenize.chat import chatml_render

    def texts():
        for i, msgs in enumerate(_conversations(corpus)):
            if i >= train_on:
                return
            yield chatml_render(msgs, False)[0]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(), trainer=trainer)
    atomic_write_bytes(out / "tokenizer.json", tok.to_str().encode())
    return out


def tokenize_lengths(corpus: Path, tokenizer_dir: Path, *, batch: int = 512) -> np.ndarray:
    """Token length of every conversation under the library's chat rendering and encoder."""
    from dflash_prep.tokenize.chat import CHATML_TEMPLATE
    from dflash_prep.tokenize.encoders import encode_chats, load_tokenizer

    tok = load_tokenizer(str(tokenizer_dir), chat_template=CHATML_TEMPLATE)
    out: list[int] = []
    buf = []
    for msgs in _conversations(corpus):
        buf.append(msgs)
        if len(buf) == batch:
            out.extend(len(ids) for ids, _ in encode_chats(tok, buf))
            buf = []
    if buf:
        out.extend(len(ids) for ids, _ in encode_chats(tok, buf))
    return np.asarray(out, np.int64)


def demo_bpe_lengths(n: int, *, seed: int, work: Path, train_on: int = 4000) -> tuple[np.ndarray, str]:
    """Lengths of ``n`` demo conversations under a BPE trained on them (cached in ``work``)."""
    from dflash_prep.synth.synth import SynthConfig, synth

    params = {"n": int(n), "seed": int(seed), "train_on": int(train_on), "vocab": VOCAB, "profile": "seedlike"}
    source = f"demo corpus (synth seedlike, n={n}, seed={seed}) + byte-level BPE vocab {VOCAB} trained by tokenizers"
    work = Path(work)
    meta_path, arr_path = work / "lengths.json", work / "lengths.npy"
    if meta_path.is_file() and arr_path.is_file():
        try:
            meta = read_json(meta_path, format=CORPUS_FORMAT, versions=(CORPUS_VERSION,))
            arr = np.asarray(load_npy(arr_path, dtype=np.int64, mmap=False))
            if meta.get("params") == params and meta.get("fingerprint") == fingerprint_array(arr):
                return arr, source
        except FormatError:
            pass  # stale or corrupt cache: rebuild below
    synth(SynthConfig(out=work / "corpus", profile="seedlike", n=n, seed=seed, overwrite=True))
    corpus = work / "corpus" / "chat.jsonl"
    train_bpe(corpus, work / "bpe", train_on=min(train_on, n))
    lengths = tokenize_lengths(corpus, work / "bpe")
    atomic_save_npy(arr_path, lengths)
    atomic_write_json(meta_path, {"params": params, "fingerprint": fingerprint_array(lengths), "source": source},
                      format=CORPUS_FORMAT, version=CORPUS_VERSION)
    return lengths, source
