"""What a states cache's integrity checks cost: the finite check on every shard write, and the
trainer's re-hash of every shard on its first read.

``python -m dflash_prep.bench.states_checks`` writes a cache of random states with the project's
own writer (:func:`dflash_prep.formats.states.write_shard`) and prints one JSON object (also to
``--out``):

- ``write``: ``--write-mb`` MiB of rows written as one shard ``--repeats`` times (the fastest); the finite check
  (:func:`~dflash_prep.formats.states.nonfinite_row`, which ``write_shard`` runs) timed alone on
  the same rows; the ratio is the check against the write without it (``write - check``).
- ``read``: the demo's cache size by default (2,000 samples, 298,248 tokens, one tap of H = 64 in
  bf16: 38.2 MB, one shard at ``--shard-mb`` 1024), read the way the trainer's prefetch thread
  reads it (:meth:`dflash_prep.train.cached_taps.CachedTaps._read` over micro-batches of about
  ``--batch-tokens`` tokens of shuffled samples, decoded to float32 and cast to bf16): every
  sample once with the shard re-hash on first read (``verify``) and without it. Each twice: with
  the shard's pages dropped from the page cache first (``cold``, ``posix_fadvise(DONTNEED)``: a
  first epoch's reads), and again from the page cache (``warm``).

Wall seconds over ``--repeats`` runs (the two reads interleaved), min and median: on a shared
machine the minimum is the figure least disturbed by other load. ``hash_over_unchecked`` is the
re-hash time measured inside the verified reads (``CachedTaps.verify_s``) over the unchecked read;
``ratio_of_mins`` compares the two whole reads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dflash_prep.formats import states as fmt
from dflash_prep.formats.fileio import atomic_write_json


def _key(slots: int, hidden: int, dtype: str) -> fmt.StatesKey:
    return fmt.StatesKey(dataset_fingerprint="bench", target_fingerprint="bench", taps=tuple(range(slots)),
                         final=False, dtype=dtype, hidden=hidden)


def _rows(tokens: int, key: fmt.StatesKey, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return fmt.encode_torch(torch.randn(tokens, key.slots, key.hidden, generator=g), key.dtype)


def bench_write(folder: Path, mb: float, key: fmt.StatesKey, repeats: int) -> dict:
    tokens = max(1, int(mb * 2 ** 20 // key.bytes_per_token()))
    rows, scales = _rows(tokens, key)
    off = np.array([0, tokens], np.int64)
    write, check = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fmt.write_shard(folder / "w.states", cache_fingerprint="bench", index=0, samples=(0, 1), key=key, rows=rows,
                        scales=scales, offsets=off)
        write.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        assert fmt.nonfinite_row(rows, scales, key.dtype) is None
        check.append(time.perf_counter() - t0)
        (folder / "w.states").unlink()
    w, c = min(write), min(check)
    return {"mb": round(rows.nbytes / 2 ** 20, 1), "write_s": round(w, 4), "check_s": round(c, 4),
            "check_gb_s": round(rows.nbytes / c / 1e9, 2), "check_over_write_without": round(c / (w - c), 4)}


def write_cache(folder: Path, lens: np.ndarray, key: fmt.StatesKey, shard_mb: float) -> fmt.StatesCache:
    """A complete cache of random states for ``lens`` (the shape of one ``extract`` writes)."""
    plan = fmt.plan_shards(lens, key.bytes_per_token(), shard_mb * 2 ** 20)
    entries = []
    for k, (a, b) in enumerate(plan):
        rows, scales = _rows(int(lens[a:b].sum()), key, seed=k)
        off = np.concatenate([[0], np.cumsum(lens[a:b])]).astype(np.int64)
        entries.append(fmt.write_shard(folder / fmt.shard_name(k), cache_fingerprint=key.fingerprint(), index=k,
                                       samples=(a, b), key=key, rows=rows, scales=scales, offsets=off))
    atomic_write_json(folder / fmt.HEADER_FILE, {"complete": True, "fingerprint": key.fingerprint(),
                                                 "key": key.to_dict(), "plan": [list(p) for p in plan],
                                                 "shards": entries, "command": "dflash-prep extract (bench)"},
                      format=fmt.FORMAT, version=fmt.VERSION)
    return fmt.open_states(folder)


def _drop(cache: fmt.StatesCache) -> None:
    for sh in cache.shards:
        fd = os.open(sh.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _read_all(folder: Path, batches: list[np.ndarray], lens: np.ndarray, verify: bool, cold: bool):
    """``(seconds to read every micro-batch through the trainer's reader, seconds of it spent
    re-hashing)``, as a fresh run (nothing verified yet)."""
    from dflash_prep.train.cached_taps import CachedTaps

    cache = fmt.open_states(folder)
    if cold:
        _drop(cache)
    embed = torch.nn.Embedding(1, cache.key.hidden).to(torch.bfloat16)      # only its dtype is read
    taps = CachedTaps(cache, list(cache.key.taps), final=False, embed_tokens=embed, lm_head=None,
                      num_layers=max(cache.key.taps) + 1, device=torch.device("cpu"), verify=verify)
    cols = taps.read_cols
    t0 = time.perf_counter()
    for sids in batches:
        taps._read(sids, lens[sids], cols).to(taps.dtype)
    return time.perf_counter() - t0, taps.verify_s


def bench_read(folder: Path, samples: int, tokens: int, key: fmt.StatesKey, shard_mb: float, batch_tokens: int,
               repeats: int) -> dict:
    rng = np.random.default_rng(0)
    lens = rng.multinomial(tokens - samples, np.ones(samples) / samples).astype(np.int64) + 1   # (N,), sum = tokens
    cache = write_cache(folder, lens, key, shard_mb)
    order = rng.permutation(samples)
    cuts = np.searchsorted(np.cumsum(lens[order]), np.arange(batch_tokens, tokens, batch_tokens))
    batches = np.split(order, cuts)
    out = {"samples": samples, "tokens": int(lens.sum()), "shards": len(cache.shards), "micro_batches": len(batches),
           "bytes": int(sum(sh.path.stat().st_size for sh in cache.shards))}
    for cold in (True, False):
        name = "cold" if cold else "warm"
        runs = [(_read_all(folder, batches, lens, False, cold), _read_all(folder, batches, lens, True, cold))
                for _ in range(repeats)]                # interleaved: a load change hits both alike
        plain = [r[0][0] for r in runs]
        checked = [r[1][0] for r in runs]
        hashing = [r[1][1] for r in runs]
        out[name] = {"unchecked_s": {"min": round(min(plain), 4), "median": round(statistics.median(plain), 4)},
                     "verified_s": {"min": round(min(checked), 4), "median": round(statistics.median(checked), 4)},
                     "hash_in_verified_s": {"min": round(min(hashing), 4),
                                            "median": round(statistics.median(hashing), 4)},
                     "ratio_of_mins": round(min(checked) / min(plain), 3),
                     "hash_over_unchecked": round(min(hashing) / min(plain), 3)}
    t0 = time.perf_counter()
    for sh in cache.shards:
        fmt.verify_shard(sh, cache.command)
    out["hash_alone_gb_s"] = round(out["bytes"] / (time.perf_counter() - t0) / 1e9, 2)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m dflash_prep.bench.states_checks", description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=298_248)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--slots", type=int, default=1)
    ap.add_argument("--dtype", default="bf16", choices=fmt.DTYPES)
    ap.add_argument("--shard-mb", type=float, default=1024.0)
    ap.add_argument("--batch-tokens", type=int, default=2048, help="tokens per micro-batch read")
    ap.add_argument("--write-mb", type=float, default=256.0, help="MiB of rows per timed shard write")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", default=None, help="folder for the caches (default: a temp folder, removed)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    key = _key(a.slots, a.hidden, a.dtype)
    with tempfile.TemporaryDirectory(dir=a.work, prefix="states-checks.") as tmp:
        tmp = Path(tmp)
        (tmp / "read").mkdir()
        res = {"command": "python -m dflash_prep.bench.states_checks " + " ".join(argv or []),
               "load_average_1m_before": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(),
               "key": {"slots": a.slots, "hidden": a.hidden, "dtype": a.dtype},
               "write": bench_write(tmp, a.write_mb, key, a.repeats),
               "read": bench_read(tmp / "read", a.samples, a.tokens, key, a.shard_mb, a.batch_tokens, a.repeats)}
    res["load_average_1m_after"] = round(os.getloadavg()[0], 2)
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
