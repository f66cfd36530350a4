"""Tokenize scaling: local ``--num-proc 1`` and ``2`` vs ``--engine ray`` with 2 workers, one run.

    python -m dflash_prep.bench.tokenize_scaling                  # 20k synth conversations, byte + BPE
    python -m dflash_prep.bench.tokenize_scaling --n 5000 --tokenizers byte

What is timed (wall clock of the whole ``tokenize`` call on the same JSONL file: load,
validation, rendering, encoding, masks, shards, ``meta.json``): rows/s = samples written /
seconds, tokens/s = tokens written / seconds. The Ray row runs on a local Ray started with
``ray.init(num_cpus=2)`` before the timing (its start-up is printed separately, not in the
row; one untimed pass per engine over the first 2,048 conversations warms imports, tokenizer
loads and the Ray workers): 2 workers, as a 2-node cluster of one CPU each would give. Every Ray output folder is
checked byte for byte against the ``--num-proc 1`` folder (the benchmark stops if they
differ). Tokenizers: the built-in byte-level one, and a byte-level BPE (vocab 8192) trained
here on the first 5,000 conversations (``bench.tokenize_speed.train_bpe``), loaded through
transformers with ``--chat-template chatml``. The 1-minute load average at the start of each
row is printed: on a shared machine compare rows with similar load.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

from dflash_prep.synth.synth import SynthConfig, synth
from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize

from .tokenize_speed import rendered_texts, train_bpe


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def timed(corpus: Path, spec: str, out: Path, **kw) -> tuple[dict, float]:
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    meta = tokenize(TokenizeConfig(inputs=(str(corpus),), out=out, tokenizer=spec,
                                   chat_template=None if spec == "byte" else "chatml", **kw))
    return meta, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20_000, help="synth conversations")
    ap.add_argument("--tokenizers", default="byte,bpe", help="comma-separated: byte, bpe")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp dir, removed)")
    args = ap.parse_args()
    import ray

    work = args.work or Path(tempfile.mkdtemp(prefix="dflash-bench-scale-"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    rows = []
    try:
        synth(SynthConfig(out=work / "corpus", n=args.n, seed=0, overwrite=True))
        corpus = work / "corpus" / "chat.jsonl"
        specs = []
        for name in args.tokenizers.split(","):
            if name == "byte":
                specs.append(("byte", "byte"))
            elif name == "bpe":
                specs.append(("BPE 8192", str(train_bpe(rendered_texts(corpus)[:5000], work / "bpe"))))
            else:
                raise SystemExit(f"--tokenizers: unknown {name!r} (byte, bpe)")
        t0 = time.perf_counter()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        print(f"ray.init(num_cpus=2): {time.perf_counter() - t0:.1f} s (not in the rows)", flush=True)
        try:
            warm = work / "warm.jsonl"  # first-call costs (imports, tokenizer load, Ray workers) out of the rows
            with open(corpus) as f, open(warm, "w") as g:
                g.writelines(line for _, line in zip(range(2048), f))
            for name, spec in specs:
                for kw in ({"num_proc": 1}, {"engine": "ray"}):
                    timed(warm, spec, work / "warm", **kw)
                ref = None
                for label, kw in (("local --num-proc 1", {"num_proc": 1}), ("local --num-proc 2", {"num_proc": 2}),
                                  ("ray, 2 workers", {"engine": "ray"})):
                    load = os.getloadavg()[0]
                    out = work / label.replace(" ", "_").replace(",", "")
                    meta, sec = timed(corpus, spec, out, **kw)
                    got = files(out)
                    if ref is None:
                        ref = got
                    elif got != ref:
                        raise SystemExit(f"{name} {label}: output differs from --num-proc 1")
                    shutil.rmtree(out, ignore_errors=True)
                    n, tok = meta["counts"]["samples"], meta["tokens"]["total"]
                    rows.append((name, label, n, tok, sec, load))
                    print(f"{name:9s} {label:20s} {n / sec:9,.0f} rows/s {tok / sec / 1e6:6.2f} M tok/s "
                          f"({sec:.1f} s, load {load:.1f})", flush=True)
        finally:
            ray.shutdown()
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{dt.date.today()} · {platform.machine()} · {cores} CPU cores · "
          f"python -m dflash_prep.bench.tokenize_scaling --n {args.n} --tokenizers {args.tokenizers}\n")
    print("| tokenizer | engine | rows | tokens | seconds | rows/s | M tokens/s | vs --num-proc 1 | load avg at start |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    base = {}
    for name, label, n, tok, sec, load in rows:
        base.setdefault(name, sec)
        print(f"| {name} | {label} | {n:,} | {tok:,} | {sec:.1f} | {n / sec:,.0f} | {tok / sec / 1e6:.2f} | "
              f"{base[name] / sec:.2f}x | {load:.1f} |")


if __name__ == "__main__":
    main()
