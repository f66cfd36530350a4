"""Tokenize throughput vs a bare ``tokenizers.encode_batch`` call, same texts, same run.

    python -m dflash_prep.bench.tokenize_speed                 # 200k-sample synth corpus (docs/benchmarks.md#tokenize-throughput)
    python -m dflash_prep.bench.tokenize_speed --n 20000       # quicker

What is timed (wall clock, tokens/s = tokens produced / seconds):

- ``direct``: ``Tokenizer.encode_batch`` on the rendered texts (ChatML, the exact strings
  ``tokenize`` encodes), already in memory, in batches of 1024 (one call on
  200k texts would hold ~20 GB of ``Encoding`` objects). Rust, all cores via rayon. Nothing
  else: no reading, no rendering, no id extraction, no writing.
- ``tokenize --num-proc P``: the whole stage on the JSONL file: ``datasets`` load, record
  validation, rendering, encoding, loss masks, Arrow shards, ``lengths.npy``, ``meta.json``.

Two tokenizers: the built-in byte-level one (its ``direct`` reference is the equivalent
``tokenizers`` object from ``ByteTokenizer.to_tokenizers()``, which gives the same ids),
and a byte-level BPE (vocab 8192) trained here, offline, with ``tokenizers`` on the first
5,000 conversations, loaded by ``tokenize`` through transformers (``--chat-template
chatml``, a ``{% generation %}`` template); its ``direct`` reference is the backend
``tokenizers`` object transformers configured, the one ``tokenize`` encodes with. Target: ``tokenize`` >= 0.8x ``direct`` at the same core count. The 1-minute load average
at the start of each measurement is printed too: on a shared machine a phase that ran under
heavier load than its reference skews the ratio, so compare rows with similar load.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

from dflash_prep.synth.synth import SynthConfig, synth
from dflash_prep.tokenize.chat import CHATML_TEMPLATE, chatml_render
from dflash_prep.tokenize.encoders import ByteTokenizer, load_tokenizer
from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize

SPECIALS = ByteTokenizer.SPECIALS


def rendered_texts(corpus: Path) -> list[str]:
    """ChatML renderings (the byte tokenizer's layout, and ``--chat-template chatml`` for the BPE)."""
    with open(corpus) as f:
        return [chatml_render(json.loads(line)["messages"], False)[0] for line in f]


def train_bpe(texts: list[str], folder: Path, vocab: int = 8192) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def direct(hf_tok, texts: list[str], batch: int = 1024) -> tuple[int, float]:
    t0 = time.perf_counter()
    n = 0
    for i in range(0, len(texts), batch):
        n += sum(len(e) for e in hf_tok.encode_batch(texts[i:i + batch], add_special_tokens=False))
    return n, time.perf_counter() - t0


def ours(corpus: Path, tokenizer: str, out: Path, num_proc: int) -> tuple[int, float]:
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    meta = tokenize(TokenizeConfig(inputs=(str(corpus),), out=out, tokenizer=tokenizer, num_proc=num_proc,
                                   chat_template=None if tokenizer == "byte" else "chatml"))
    dt_ = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    return meta["tokens"]["total"], dt_


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200_000, help="synth conversations")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp dir, removed)")
    ap.add_argument("--procs", default="1,2", help="comma-separated --num-proc values to time")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="dflash-bench-tok-"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    procs = [int(p) for p in args.procs.split(",")]
    try:
        t0 = time.perf_counter()
        synth(SynthConfig(out=work / "corpus", n=args.n, seed=0, overwrite=True))
        corpus = work / "corpus" / "chat.jsonl"
        texts = rendered_texts(corpus)
        chars = sum(len(t) for t in texts)
        print(f"corpus: {args.n:,} conversations, {chars:,} characters ({time.perf_counter() - t0:.1f} s to synth+render)")
        t0 = time.perf_counter()
        bpe = train_bpe(texts[:5000], work / "bpe")
        print(f"BPE (vocab 8192) trained on 5,000 conversations in {time.perf_counter() - t0:.1f} s")
        rows = []
        for name, spec, hf_tok in (("byte", "byte", ByteTokenizer().to_tokenizers()),
                                   ("BPE 8192", str(bpe), load_tokenizer(str(bpe), chat_template=CHATML_TEMPLATE).backend)):
            load = os.getloadavg()[0]
            n_d, t_d = direct(hf_tok, texts)
            rows.append((name, "tokenizers encode_batch (direct)", n_d, t_d, 1.0, load))
            print(f"{name:9s} direct            {n_d / t_d / 1e6:7.2f} M tok/s ({t_d:.1f} s)", flush=True)
            for p in procs:
                load = os.getloadavg()[0]
                n_o, t_o = ours(corpus, spec, work / "out", p)
                if n_o != n_d:
                    raise SystemExit(f"token counts differ: tokenize {n_o} vs direct {n_d}")
                rows.append((name, f"dflash-prep tokenize --num-proc {p}", n_o, t_o, (n_o / t_o) / (n_d / t_d), load))
                print(f"{name:9s} tokenize -p {p}     {n_o / t_o / 1e6:7.2f} M tok/s ({t_o:.1f} s), "
                      f"{(n_o / t_o) / (n_d / t_d):.2f}x direct", flush=True)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{dt.date.today()} · {platform.machine()} · {cores} CPU cores · python -m dflash_prep.bench.tokenize_speed --n {args.n}\n")
    print("| tokenizer | path | tokens | seconds | M tokens/s | vs direct | load avg at start |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, path, n, t, r, load in rows:
        print(f"| {name} | {path} | {n:,} | {t:.1f} | {n / t / 1e6:.2f} | {r:.2f}x | {load:.1f} |")


if __name__ == "__main__":
    main()
