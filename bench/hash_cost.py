"""What integrity on read costs: re-hashing a manifest on open against packing it.

``python -m dflash_prep.bench.hash_cost --n 100000000`` packs one padded epoch of N seedlike lengths
(T = 65536, W = 8, K = 6, the setting of docs/benchmarks.md#pack, via ``bench.pack_speed``'s
inputs), then opens it with and without the array re-hash (``manifest.open``'s
``check_hashes``) and reports the difference against the pack's wall time; then epoch 1
(whose pack opens epoch 0 from disk for the repeat-pair rate, hash included). It also
times the per-record-batch digest the dataset reader checks on first touch, in GB/s.
Prints one JSON object (and writes it to ``--out`` when given).

``python -m dflash_prep.bench.hash_cost --target-gb 4`` instead times a target's identity
(``formats.target.target_identity``) on a folder of one config.json and a weight file of that many
GB of random bytes, written under ``--work`` and removed after: the first hash (the file's pages
dropped from the page cache first, so it reads the disk), the digest-cache lookup every later start
does, and an uncached re-hash from the page cache (the cost each rank paid at every start before
the cache). The file's mtime is set an hour back, as a downloaded target's is (a file modified
within ``RACY_S`` is never cached).
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

from dflash_prep.formats import manifest
from dflash_prep.formats.dataset import batch_digest
from dflash_prep.pack.pack import pack_epochs

from dflash_prep.bench.pack_speed import make_inputs


def _timed(fn, repeats: int = 3) -> tuple[float, float]:
    """Median (wall, CPU) seconds of ``repeats`` calls."""
    wall, cpu = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return statistics.median(wall), statistics.median(cpu)


def run(n: int, work: Path) -> dict:
    plan = make_inputs(work / f"seedlike-{n}", n)
    root = work / "manifests"
    t0, c0 = time.perf_counter(), time.process_time()
    [d0] = pack_epochs(plan=plan, epochs=[0], out=root, world_size=8, overwrite=True)
    pack0, cpu0 = time.perf_counter() - t0, time.process_time() - c0
    t1, c1 = time.perf_counter(), time.process_time()
    pack_epochs(plan=plan, epochs=[1], out=root, world_size=8, overwrite=True)
    pack1, cpu1 = time.perf_counter() - t1, time.process_time() - c1
    nbytes = sum(p.stat().st_size for p in d0.glob("*.npy"))
    plain = _timed(lambda: manifest.open(d0, check_hashes=False))
    hashed = _timed(lambda: manifest.open(d0))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 150_000, size=64 << 20, dtype=np.int32)   # 256 MiB of token ids
    mask = (ids & 1).astype(np.uint8)
    lens = np.full(len(ids) // 1024, 1024, np.int32)
    dig = _timed(lambda: batch_digest(ids, mask, lens))[1]
    hash_wall, hash_cpu = hashed[0] - plain[0], hashed[1] - plain[1]
    return {"n": n, "manifest_npy_bytes": nbytes, "pack_epoch0_wall_s": pack0, "pack_epoch0_cpu_s": cpu0,
            "pack_epoch1_wall_s": pack1, "pack_epoch1_cpu_s": cpu1,
            "open_without_hash_wall_s": plain[0], "open_with_hash_wall_s": hashed[0],
            "hash_wall_s": hash_wall, "hash_cpu_s": hash_cpu,
            "hash_share_of_pack_wall": hash_wall / pack0, "hash_share_of_pack_cpu": hash_cpu / cpu0,
            "hash_gb_per_cpu_s": nbytes / max(hash_cpu, 1e-9) / 1e9,
            "batch_digest_gb_per_cpu_s": (ids.nbytes + mask.nbytes + lens.nbytes) / dig / 1e9}


class _NoTemplate:
    chat_template = None


def target_digest(gb: float, work: Path) -> dict:
    """The target identity's cost on ``gb`` GB of weights: first hash, cached lookup, warm re-hash."""
    from dflash_prep.formats import target as tgt

    d = work / "target"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    w = d / "model.safetensors"
    nbytes, chunk = int(gb * 1e9), 64 << 20
    t = time.perf_counter()
    with open(w, "wb") as f:
        for off in range(0, nbytes, chunk):
            f.write(os.urandom(min(chunk, nbytes - off)))
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t
    old = time.time() - 3600
    for f in (w, d / "config.json"):
        os.utime(f, (old, old))
    with open(w, "rb") as f:                        # the first read comes from the disk, not the page cache
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    t = time.perf_counter()
    first = tgt.target_identity(d, _NoTemplate())["target_fingerprint"]
    first_s = time.perf_counter() - t
    if not (d / tgt.DIGEST_CACHE).is_file():
        raise RuntimeError(f"{d}: the first hash wrote no digest cache")
    cached = _timed(lambda: tgt.target_identity(d, _NoTemplate()), repeats=5)[0]
    warm = _timed(lambda: tgt.target_identity(d, _NoTemplate(), cache=False), repeats=1)[0]
    if tgt.target_identity(d, _NoTemplate(), cache=False)["target_fingerprint"] != first:
        raise RuntimeError(f"{d}: the cached fingerprint differs from the uncached one")
    return {"weight_bytes": nbytes, "write_s": write_s, "first_hash_s": first_s, "cached_lookup_s": cached,
            "uncached_rehash_page_cache_s": warm, "first_hash_gb_per_s": nbytes / first_s / 1e9,
            "rehash_gb_per_s": nbytes / warm / 1e9, "speedup_vs_rehash": warm / cached}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000_000)
    ap.add_argument("--target-gb", type=float, default=None,
                    help="time the target identity on a weight file of this many GB instead")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp folder)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.work) as tmp:
        res = run(a.n, Path(tmp)) if a.target_gb is None else target_digest(a.target_gb, Path(tmp))
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
