"""What ``evaluate``'s contamination check costs on a large training set.

``python -m dflash_prep.bench.contamination_cost --tokens 5000000 --prompts 1000`` writes a tokenized
dataset (``dflash-prep/dataset`` v2, through the format's own writer) of that many random token ids
(a 151,936-id vocabulary, Qwen3's; samples of 200-2,000 tokens) under a temporary folder, draws that
many prompts of 40-300 tokens (GSM8K's user texts are 30-200 of Qwen3's), copies ``--planted`` of them
into random samples, then times, median of ``--repeats`` (wall, and the scan's CPU seconds): indexing the prompts' n-grams
(:class:`~dflash_prep.engine.contamination.PromptGrams`) and streaming the dataset once
(:func:`~dflash_prep.engine.contamination.scan`, the shards in the page cache: just written). It
checks that exactly the planted prompts are found, then prints one JSON object (and writes it to
``--out``). Tokenizing the prompts' text is left out (the target's fast tokenizer: milliseconds for
a thousand prompts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from dflash_prep.engine.contamination import DEFAULT_N, PromptGrams, scan
from dflash_prep.formats import dataset as ds_mod
from dflash_prep.formats.fileio import atomic_save_npy, fingerprint_array, fingerprint_json

VOCAB = 151_936


def random_samples(tokens: int, rng: np.random.Generator) -> list[np.ndarray]:
    """About ``tokens`` random int32 ids in samples of 200-2,000."""
    lens, total = [], 0
    while total < tokens:
        lens.append(int(rng.integers(200, 2001)))
        total += lens[-1]
    return [rng.integers(0, VOCAB, size=n).astype(np.int32) for n in lens]


def save(folder: Path, samples: list[np.ndarray]) -> None:
    """``samples`` as a dataset folder, through the format's own writer (ShardWriter + write_meta)."""
    folder.mkdir(parents=True)
    lens = np.array([len(s) for s in samples], np.int32)
    key = "bench-contamination"
    w = ds_mod.ShardWriter(folder, 256 << 20, key)
    for i in range(0, len(samples), 512):                  # tokenize's default chunk_rows
        chunk = samples[i:i + 512]
        ids = np.concatenate(chunk)
        w.add(ids, np.ones(len(ids), np.uint8), lens[i:i + 512], np.arange(i, i + len(chunk), dtype=np.int64))
    shards = w.finish()
    atomic_save_npy(folder / ds_mod.LENGTHS_FILE, lens)
    lfp = fingerprint_array(lens)
    ds_mod.write_meta(folder, {
        "fingerprint": fingerprint_json({"inputs": key, "lengths": lfp}), "inputs_fingerprint": key,
        "tokenizer": {"vocab_size": VOCAB, "pad_id": 0, "eos_id": 1, "bos_id": None, "name": "random",
                      "fingerprint": "random"},
        "counts": {"samples": len(samples)}, "tokens": {"total": int(lens.sum())},
        "lengths": {"file": ds_mod.LENGTHS_FILE, "dtype": "int32", "fingerprint": lfp}, "shards": shards})


def run(*, tokens: int, prompts: int, planted: int, n: int, repeats: int, seed: int, work: Path) -> dict:
    rng = np.random.default_rng(seed)
    samples = random_samples(tokens, rng)
    ps = [rng.integers(0, VOCAB, size=int(rng.integers(40, 301))).tolist() for _ in range(prompts)]
    where = {}
    for u in rng.choice(prompts, size=planted, replace=False).tolist():
        s = int(rng.integers(0, len(samples)))
        samples[s] = np.r_[samples[s][:50], ps[u], samples[s][50:]].astype(np.int32)
        where.setdefault(u, s)
    save(work / "data", samples)
    ds = ds_mod.open_dataset(work / "data")
    index_s, scan_s, scan_cpu = [], [], []
    for _ in range(repeats):
        t = time.perf_counter()
        grams = PromptGrams([[p] for p in ps], n)
        index_s.append(time.perf_counter() - t)
        t, c = time.perf_counter(), time.process_time()
        found = scan(ds, grams)
        scan_s.append(time.perf_counter() - t)
        scan_cpu.append(time.process_time() - c)
    if sorted(found) != sorted(where):
        raise SystemExit(f"found {sorted(found)}, planted {sorted(where)}")
    total = int(ds.lengths.sum(dtype=np.int64))
    return {"bench": "contamination_cost", "n": n, "training_tokens": total, "samples": len(ds),
            "prompts": prompts, "prompt_ngrams": int(len(grams.hashes)), "planted": planted,
            "found": len(found), "index_s": round(statistics.median(index_s), 3),
            "scan_s": round(statistics.median(scan_s), 3), "scan_cpu_s": round(statistics.median(scan_cpu), 3),
            "scan_tokens_per_s": round(total / statistics.median(scan_s))}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m dflash_prep.bench.contamination_cost", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=5_000_000, help="training tokens")
    ap.add_argument("--prompts", type=int, default=1000, help="evaluation prompts")
    ap.add_argument("--planted", type=int, default=10, help="prompts copied into the training data")
    ap.add_argument("--n", type=int, default=DEFAULT_N, help="n-gram length")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="contam-bench-") as tmp:
        res = run(tokens=a.tokens, prompts=a.prompts, planted=a.planted, n=a.n, repeats=a.repeats, seed=a.seed,
                  work=Path(tmp))
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    return res


if __name__ == "__main__":
    main()
