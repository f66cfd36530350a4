"""The states-cache check is shared by a run's ranks (train/cached_taps.py, ``ShardChecks``): W ranks
that read every shard of a cache, each in its own shuffled order, re-hash each shard once in all,
through markers in the run folder; a corrupt shard still stops every rank that reads it, and a
marker whose shard file changed since is not trusted. The ranks are threads, each with its own
provider and its own opening of the cache, as W processes on one node would have; the hashes are
counted by wrapping the hash function ``verify_shard`` calls."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import torch

from dflash_prep.errors import FormatError
from dflash_prep.formats import states as fmt
from dflash_prep.formats.fileio import atomic_write_json
from dflash_prep.train.cached_taps import CHECKS_DIR, CachedTaps, ShardChecks

W = 4
KEY = fmt.StatesKey(dataset_fingerprint="d" * 32, target_fingerprint="t" * 32, taps=(1, 2), final=False,
                    dtype="bf16", hidden=16)


def _cache(folder: Path, n: int = 60, settled: bool = True) -> np.ndarray:
    """A complete bf16 cache of ``n`` samples of random states in 8 or more shards, its shards last
    modified an hour ago when ``settled`` (a file of the last seconds is hashed but never marked);
    their lengths."""
    rng = np.random.default_rng(0)
    lens = rng.integers(3, 25, n).astype(np.int64)
    bpt = KEY.bytes_per_token()
    plan = fmt.plan_shards(lens, bpt, 100 * bpt)
    folder.mkdir(parents=True)
    entries = []
    for k, (a, b) in enumerate(plan):
        x = torch.from_numpy(rng.standard_normal((int(lens[a:b].sum()), KEY.slots, KEY.hidden)).astype(np.float32))
        rows, scales = fmt.encode_torch(x, KEY.dtype)
        off = np.concatenate([[0], np.cumsum(lens[a:b])]).astype(np.int64)
        entries.append(fmt.write_shard(folder / fmt.shard_name(k), cache_fingerprint=KEY.fingerprint(), index=k,
                                       samples=(a, b), key=KEY, rows=rows, scales=scales, offsets=off))
    assert len(plan) >= 8, len(plan)
    atomic_write_json(folder / fmt.HEADER_FILE, {
        "complete": True, "fingerprint": KEY.fingerprint(), "key": KEY.to_dict(), "plan": [list(p) for p in plan],
        "shards": entries, "command": "dflash-prep extract (test cache)"}, format=fmt.FORMAT, version=fmt.VERSION)
    if settled:
        old = time.time() - 3600
        for e in entries:
            os.utime(folder / e["file"], (old, old))
    return lens


class _Batch:
    def __init__(self, sids, lens):
        self.sample_ids = np.asarray(sids)
        self.cu_seqlens = torch.tensor(np.concatenate([[0], np.cumsum(lens[self.sample_ids])]), dtype=torch.int32)
        self.input_ids = torch.zeros(int(self.cu_seqlens[-1]), dtype=torch.long)


def _array_sizes(cache: Path, shards) -> list[int]:
    """The bytes of every array of ``shards``: what re-hashing each of them once reads."""
    c = fmt.open_states(cache)
    return sorted(int(np.prod(a["shape"])) * np.dtype(a["dtype"]).itemsize
                  for k in shards for a in c.shards[k].head["arrays"].values())


def _job(cache: Path, run: Path, lens, monkeypatch) -> tuple[list, list, list[int]]:
    """W ranks reading every sample of ``cache`` at once, each in its own shuffled order, micro-batches
    of 3; ``(providers, what each rank raised or None, the sizes of the arrays hashed)``."""
    ranks = [CachedTaps(fmt.open_states(cache), [2, 1], final=False, embed_tokens=None, lm_head=None, num_layers=3,
                        device=torch.device("cpu"), verify=True, dtype=torch.float32, checks=run / CHECKS_DIR)
             for _ in range(W)]
    hashed: list[int] = []
    real = fmt.fingerprint_bytes

    def counting(*parts):                      # opened above: from here on only verify_shard hashes
        hashed.append(sum(memoryview(p).nbytes for p in parts))
        return real(*parts)

    monkeypatch.setattr(fmt, "fingerprint_bytes", counting)
    raised: list = [None] * W
    start = threading.Barrier(W)

    def rank(r: int) -> None:
        order = np.random.default_rng(100 + r).permutation(len(lens))
        start.wait()
        try:
            for i in range(0, len(order), 3):
                ranks[r].read_ahead(_Batch(order[i:i + 3], lens))
        except FormatError as e:
            raised[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(W)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    monkeypatch.setattr(fmt, "fingerprint_bytes", real)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return ranks, raised, sorted(hashed)


def test_w_ranks_hash_each_shard_once_in_all(tmp_path, monkeypatch):
    lens = _cache(tmp_path / "cache")
    n = len(fmt.open_states(tmp_path / "cache").shards)
    ranks, raised, hashed = _job(tmp_path / "cache", tmp_path / "run", lens, monkeypatch)
    assert raised == [None] * W, raised
    assert hashed == _array_sizes(tmp_path / "cache", range(n)), \
        f"{len(hashed)} arrays hashed, {2 * n} once each: the {W} ranks re-read the cache"
    checks = [p.summary()["states_check"] for p in ranks]
    assert all(c["shards"] == c["of"] == n for c in checks), checks         # every rank checked every shard ...
    assert sum(c["hashed"] for c in checks) == n, checks                     # ... and hashed its own share of them
    markers = sorted((tmp_path / "run" / CHECKS_DIR).glob("shard-*.json"))
    assert [m.name for m in markers] == [f"shard-{k:05d}.json" for k in range(n)]
    m = json.loads(markers[0].read_text())
    assert m["cache_fingerprint"] == KEY.fingerprint() and m["bytes"] == (tmp_path / "cache" / fmt.shard_name(0)) \
        .stat().st_size and m["checked_by"].startswith("pid "), m


def test_a_corrupt_shard_stops_every_rank_that_reads_it(tmp_path, monkeypatch):
    lens = _cache(tmp_path / "cache")
    bad = tmp_path / "cache" / fmt.shard_name(2)
    head, _ = fmt.read_shard_header(bad)
    with open(bad, "r+b") as f:                 # issue 40's case: finite bytes over a shard's rows
        f.seek(int(head["arrays"]["rows"]["offset"]) + 64)
        f.write(b"\x7f" * 64)
    _, raised, _ = _job(tmp_path / "cache", tmp_path / "run", lens, monkeypatch)
    for e in raised:                             # every rank reads every sample, so every rank reaches it
        assert e is not None and "\n" not in str(e), raised
        assert str(e).startswith(f"{bad}: array rows does not match its SHA-256 (corrupt); delete the shard and rerun "
                                 "dflash-prep extract (test cache)"), str(e)
    assert not (tmp_path / "run" / CHECKS_DIR / "shard-00002.json").exists(), "a corrupt shard was marked checked"


def test_a_marker_of_a_changed_shard_is_not_trusted(tmp_path, monkeypatch):
    lens = _cache(tmp_path / "cache")
    cache, run = tmp_path / "cache", tmp_path / "run"
    _, raised, _ = _job(cache, run, lens, monkeypatch)
    assert raised == [None] * W
    _, raised, hashed = _job(cache, run, lens, monkeypatch)             # a resumed run: every marker holds
    assert raised == [None] * W and hashed == [], hashed
    same = cache / fmt.shard_name(3)                                     # the same bytes, another file
    shutil.copy2(same, tmp_path / "copy")
    (tmp_path / "copy").replace(same)
    forged = run / CHECKS_DIR / "shard-00006.json"                       # a marker recording another digest
    m = json.loads(forged.read_text())
    forged.write_text(json.dumps({**m, "sha256": "0" * 32}))
    _, raised, hashed = _job(cache, run, lens, monkeypatch)
    assert raised == [None] * W and hashed == sorted(_array_sizes(cache, [3]) + _array_sizes(cache, [6])), hashed
    bad = cache / fmt.shard_name(5)
    head, _ = fmt.read_shard_header(bad)
    with open(bad, "r+b") as f:                 # written in place after its marker
        f.seek(int(head["arrays"]["rows"]["offset"]) + 8)
        f.write(b"\x7f" * 8)
    _, raised, _ = _job(cache, run, lens, monkeypatch)
    assert all(e is not None and str(e).startswith(f"{bad}: array rows does not match its SHA-256") for e in raised), \
        raised


def test_a_shard_written_in_the_last_seconds_is_hashed_but_not_marked(tmp_path):
    _cache(tmp_path / "cache", settled=False)
    folder = tmp_path / "run" / CHECKS_DIR
    for _ in range(2):
        c = ShardChecks(fmt.open_states(tmp_path / "cache"), folder)
        c.check(0)
        assert c.hashed == 1 and not (folder / "shard-00000.json").exists()
    old = time.time() - 3600
    os.utime(tmp_path / "cache" / fmt.shard_name(0), (old, old))
    c = ShardChecks(fmt.open_states(tmp_path / "cache"), folder)
    c.check(0)
    assert c.hashed == 1 and (folder / "shard-00000.json").exists()
    c = ShardChecks(fmt.open_states(tmp_path / "cache"), folder)
    c.check(0)
    assert c.hashed == 0
