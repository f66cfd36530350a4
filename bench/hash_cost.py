"""What integrity on read costs: re-hashing a manifest on open against packing it.

``python -m dflash_prep.bench.hash_cost --n 100000000`` packs one padded epoch of N seedlike lengths
(T = 65536, W = 8, K = 6, the setting of docs/benchmarks.md#pack, via ``bench.pack_speed``'s
inputs), then opens it with and without the array re-hash (``manifest.open``'s
``check_hashes``) and reports the difference against the pack's wall time; then epoch 1
(whose pack opens epoch 0 from disk for the repeat-pair rate, hash included). It also
times the per-record-batch digest the dataset reader checks on first touch, in GB/s.
Prints one JSON object (and writes it to ``--out`` when given).
"""

from __future__ import annotations

import argparse
import json
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000_000)
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp folder)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.work) as tmp:
        res = run(a.n, Path(tmp))
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
