"""The third taps provider: a drafter's target hidden states read from a states cache.

``--target-engine vllm --states CACHE`` (:mod:`dflash_prep.train.engines.vllm`): the target ran
once, in vLLM, over every sample (``dflash-prep extract``, :mod:`dflash_prep.engine.extract`), and
:class:`CachedTaps` serves its states through the same ``taps(b, *, epoch, final)`` seam as
:class:`~.split.taps.LocalTaps` (the target in this process) and :class:`~.split.taps.RemoteTaps`
(a split job's target rank): the concatenated taps ``[T, k*H]`` of a micro-batch's documents, in
its manifest order and in the run's tap order, and with ``final`` the final-normed last hidden
states ``[T, H]``. The target's
``embed_tokens`` and ``lm_head`` are loaded from its folder without building it
(:func:`~.split.taps.load_heads`); its layers are never loaded.

A micro-batch's states are a pure function of its sample ids, so everything the trainer keeps
(exactly-once, exact resume, a new world size, any split of a step over ranks and accumulation)
holds unchanged: nothing here has a state.

**Read ahead.** The trainer's prefetch thread, which builds ``--prefetch`` optimizer steps ahead of
the step loop, calls :meth:`CachedTaps.read_ahead` on each micro-batch it builds: the batch's
states are read from the map, decoded (fp8 scales applied) and cast to the target's dtype there,
in pinned memory on a GPU, and ride on the batch (``b.states``) to its step, which only copies them
to the device. The values are those the step would have computed (the same decode, the same
cast), so a run is bit for bit the same with or without it. The host memory it holds is at most
``(prefetch + 2) x accumulation`` micro-batches of ``T x slots x H x`` the dtype's bytes (Qwen3-8B,
5 taps, bf16, T = 16,384: 0.67 GB a micro-batch): lower ``--prefetch`` where that is too much.
``summary.json`` reports how many micro-batches were read ahead and how long the step loop spent
reading the others (``states_read``).

**Verified on first read, once for all ranks.** Opening a cache checks every shard's header
against ``states.json`` (cheap); the rows themselves are re-hashed
(:func:`dflash_prep.formats.states.verify_shard`, the SHA-256 ``dflash-prep verify`` checks) the
first time the run reads a shard, on the prefetch thread before the batch that needs it is handed
over, several shards in parallel: a shard whose bytes changed after ``extract`` stops the run in
one line naming it and the command that rebuilds it, before any step trains on it.

Samples are shuffled, so every rank reads nearly every shard: were each rank to re-hash what it
reads, W ranks would read the whole cache W extra times before their first steps. Instead the
ranks share the check through the run folder (:class:`ShardChecks`, ``RUN/states-check/``): the
first rank to need shard k takes the shard's ``flock`` (``.shard-k.json.lock``), re-hashes it and
writes ``shard-k.json`` atomically, a marker holding the cache's fingerprint, the shard's digest
(that of its header, which holds every array's SHA-256) and its file's path, size, inode, mtime and
ctime as they were before the hash; a rank that needs it next waits for the lock and trusts the
marker while the file still matches it. A shard whose file changed since (rewritten, written into,
replaced, touched: writes move the ctime, which no one can set back) is re-hashed, and a shard that
fails writes no marker, so every rank that reads it stops on it. As for the target's digests
(:mod:`dflash_prep.formats.target`), a file modified less than ``RACY_S`` before its hash, or whose
stamp changed while it was read, is hashed but not marked (its bytes may still be moving). The
device number is left out of the stamp, so ranks on several machines that mount one shared folder
trust one another's markers. So the check reads the cache once per run, whatever W, and a resumed
run re-hashes only the shards that changed (delete ``RUN/states-check/`` to re-hash all). Ranks
that do not share a run folder share nothing and each checks as one; where the file system refuses
``flock`` (Lustre mounted without ``-o flock``), the markers still serve, and ranks that race for
the same unmarked shard may both hash it. Its cost is one extra read of the cache per run
(measured in docs/states.md); ``--no-check-states`` skips it, and the log header and
``summary.json`` (``states_check``) record that.

Checked when the run starts, each refused in one line naming the ``dflash-prep extract`` command
that builds the right cache: the cache was built for this ``--data`` (dataset fingerprint) and
this ``--target`` (config and weights fingerprint), and holds every tap the run reads (the
objective's rule or ``--target-layer-ids``) and the final hidden state when the run needs it
(``--loss kl``, EAGLE-3). A cache that holds more (a superset of taps, a final state a CE run does
not read) serves. The cache's dtype goes into the run contract (``states_dtype``), so a
checkpoint resumes only on a cache of the same dtype.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from dflash_prep.engine import backends
from dflash_prep.errors import FingerprintMismatch, FormatError
from dflash_prep.formats.fileio import atomic_write_json
from dflash_prep.formats.outputs import lock_path
from dflash_prep.formats.states import decode_torch, open_states, verify_shard
from dflash_prep.formats.target import RACY_S
from dflash_prep.objectives.target_taps import extract_command


VERIFY_THREADS = max(1, min(4, os.cpu_count() or 1))
"""Shards re-hashed at once when a micro-batch first reads several (hashlib releases the GIL)."""
CHECKS_DIR = "states-check"
"""The run folder's subfolder of shard markers, shared by the run's ranks (module docstring)."""
MARKER_FORMAT, MARKER_VERSION = "dflash-prep/states-check", 1


def shard_stamp(cache, k: int) -> dict:
    """What a marker of shard ``k`` of ``cache`` must hold to be trusted: the cache, the shard's
    digest, and its file as it is now (module docstring)."""
    sh = cache.shards[k]
    st = os.stat(sh.path)
    return {"cache_fingerprint": cache.fingerprint, "shard": int(k), "sha256": cache.header["shards"][k]["sha256"],
            "file": str(Path(sh.path).resolve()), "bytes": st.st_size, "inode": st.st_ino,
            "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def _marked(path: Path, stamp: dict) -> bool:
    """Whether the marker ``path`` exists and records ``stamp`` (an unreadable one is not trusted)."""
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(m, dict) and (m.get("format"), m.get("version")) == (MARKER_FORMAT, MARKER_VERSION)
            and all(m.get(k) == v for k, v in stamp.items()))


class ShardChecks:
    """Each shard of ``cache`` re-hashed once for every rank that shares ``folder`` (the run's
    ``states-check``; None: this process alone), module docstring. Thread-safe for distinct shards."""

    def __init__(self, cache, folder: Path | None):
        self.cache, self.folder = cache, None if folder is None else Path(folder)
        self.hashed = 0                         # shards this process re-hashed (the rest: another rank's marker)
        self._count = threading.Lock()          # the checking threads each add theirs
        self._no_flock = False

    def check(self, k: int) -> None:
        """Shard ``k`` re-hashed here, or its marker trusted; :class:`FormatError` when it is corrupt."""
        if self.folder is None:
            self._hash(k)
            return
        marker = self.folder / f"shard-{k:05d}.json"
        if _marked(marker, shard_stamp(self.cache, k)):
            return
        with self._lock(lock_path(marker)):
            stamp = shard_stamp(self.cache, k)
            if _marked(marker, stamp):           # written by the rank that held the lock before us
                return
            t0, start = time.perf_counter(), time.time_ns()
            self._hash(k)
            if stamp["mtime_ns"] >= start - int(RACY_S * 1e9) or shard_stamp(self.cache, k) != stamp:
                return                           # the file may still be moving: hashed, not marked
            atomic_write_json(marker, {**stamp, "checked_by": f"pid {os.getpid()} on {socket.gethostname()}",
                                       "rank": int(os.environ.get("RANK", "0")),
                                       "seconds": round(time.perf_counter() - t0, 3)},
                              format=MARKER_FORMAT, version=MARKER_VERSION)

    def _hash(self, k: int) -> None:
        verify_shard(self.cache.shards[k], self.cache.command)
        with self._count:
            self.hashed += 1

    @contextlib.contextmanager
    def _lock(self, path: Path):
        """Hold ``path``'s ``flock`` (waiting for the rank that holds it); without one where the
        file system refuses ``flock`` (module docstring)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as e:
                if not self._no_flock:
                    self._no_flock = True
                    print(f"{path.parent}: the file system refuses flock ({e.strerror}): ranks may re-hash a "
                          "shard twice; its markers still serve", flush=True)
            yield
        finally:
            os.close(fd)                         # releases the lock


class CachedTaps:
    """Taps read from a :class:`dflash_prep.formats.states.StatesCache` (module docstring);
    ``verify``: re-hash each shard on its first read (True), not (False), or None for a provider
    that reads no cache (:class:`~.engine_taps.EngineTaps`); ``checks``: the folder whose markers
    the run's ranks share (:class:`ShardChecks`; None: this process re-hashes what it reads)."""

    remote = False

    def __init__(self, cache, taps, *, final: bool, embed_tokens, lm_head, num_layers: int, device: torch.device,
                 verify: bool | None = None, engine: str = backends.DEFAULT, dtype: torch.dtype | None = None,
                 checks: Path | None = None):
        self.cache, self.device, self.verify, self.engine = cache, device, verify, engine
        self._verified: set[int] = set()        # shards checked by this process: re-hashed, or another rank's marker
        self.checks = ShardChecks(cache, checks) if verify else None
        self._verify_lock = threading.Lock()    # the prefetch thread, and the step for a batch not read ahead
        self.verify_s = 0.0
        self.embed_tokens, self.lm_head, self.num_layers = embed_tokens, lm_head, int(num_layers)
        self.tap_ids = [int(t) for t in taps]
        self.cols = np.array([cache.slot_of(t) for t in self.tap_ids], np.int64)   # cache slot of each run tap
        self.final_col = cache.final_slot if final else None
        self.read_cols = self.cols if self.final_col is None else np.append(self.cols, self.final_col)  # one read
        # the taps' dtype: the heads' (a drafter rank), or ``dtype`` for a provider without heads (a split
        # job's target rank, which only sends the taps: the same dtype load_heads gives the drafters)
        self.dtype = dtype if dtype is not None else embed_tokens.weight.dtype
        self.pin = device.type == "cuda"
        self.ahead = self.on_step = 0      # micro-batches read on the prefetch thread / in the step
        self.on_step_s = 0.0

    def _check_shards(self, sids) -> None:
        """Check the shards holding ``sids`` that this process has not read yet (module docstring)."""
        with self._verify_lock:
            todo = sorted({self.cache.shard_of(int(s)) for s in sids} - self._verified)
            if not todo:
                return
            t0 = time.perf_counter()
            with ThreadPoolExecutor(min(len(todo), VERIFY_THREADS)) as ex:
                list(ex.map(self.checks.check, todo))
            self._verified.update(todo)
            self.verify_s += time.perf_counter() - t0

    def _read(self, sids, lens, cols) -> torch.Tensor:
        """``[T, len(cols), H]`` float32 of the given slots of the documents, concatenated."""
        if self.verify:
            self._check_shards(sids)
        out = []
        for sid, n in zip(sids, lens):
            rows, scales = self.cache.sample(int(sid))
            if rows.shape[0] != n:
                raise FormatError(f"{self.cache.folder}: sample {int(sid)} has {rows.shape[0]} rows of states, the "
                                  f"dataset {n} tokens; the cache belongs to other data: rebuild it with "
                                  f"{self.cache.command}")
            out.append(_decode(rows, scales, cols, self.cache.key.dtype))
        return torch.cat(out)

    def _host(self, b) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Micro-batch ``b``'s taps ``[T, k*H]`` and (when the run reads it) final states ``[T, H]``,
        decoded on the host in the target's dtype."""
        lens = torch.diff(b.cu_seqlens.to("cpu", torch.int64)).tolist()
        T, k = int(b.input_ids.shape[0]), len(self.cols)
        x = self._read(b.sample_ids, lens, self.read_cols).to(self.dtype)         # (T, k [+ 1], H), one pass
        feats = x[:, :k].reshape(T, -1)                                           # (T, k*H)
        last = x[:, k].contiguous() if self.final_col is not None else None       # (T, H)
        if self.pin:
            feats, last = feats.pin_memory(), (None if last is None else last.pin_memory())
        return feats, last

    def read_ahead(self, b) -> None:
        """On the prefetch thread: ``b``'s states, decoded, attached to it (module docstring)."""
        b.states = self._host(b)
        self.ahead += 1

    def taps(self, b, *, epoch: int, final: bool = False):
        """``[T, k*H]`` taps of micro-batch ``b`` (documents in ``b.sample_ids`` order); with ``final``
        also the final-normed last hidden states ``[T, H]``. Read ahead when ``b.states`` holds them,
        else read here."""
        if final and self.final_col is None:
            raise FormatError(f"{self.cache.folder}: the run needs the final hidden state, the cache holds none")
        got = getattr(b, "states", None)
        if got is None:
            t0 = time.perf_counter()
            got = self._host(b)
            self.on_step += 1
            self.on_step_s += time.perf_counter() - t0
        feats = got[0].to(self.device, non_blocking=True)
        return (feats, got[1].to(self.device, non_blocking=True)) if final else feats

    def summary(self) -> dict:
        """``summary.json``'s ``states_read``: micro-batches read ahead, and those read in the step loop;
        for a cache, ``states_check``: the shards this rank checked, those it re-hashed itself (the rest
        trusted from another rank's marker), the seconds it took, or that it was off."""
        out = {"states_read": {"ahead": self.ahead, "on_step": self.on_step, "on_step_s": round(self.on_step_s, 3)}}
        if self.verify is not None:
            out["states_check"] = ({"shards": len(self._verified), "hashed": self.checks.hashed,
                                     "of": len(self.cache.shards),
                                     "seconds": round(self.verify_s, 3)} if self.verify
                                    else "off (--no-check-states): shards were not re-hashed")
        return out

    def contract(self) -> dict:
        """What this provider adds to the run contract: the engine and the cache's dtype."""
        return {"target_engine": self.engine, "states_dtype": self.cache.key.dtype}


def _decode(rows: np.ndarray, scales, cols: np.ndarray, dtype: str) -> torch.Tensor:
    """float32 ``[L, len(cols), H]`` of the stored ``rows [L, S, H]`` (a copy out of the map)."""
    return decode_torch(rows[:, cols], None if scales is None else scales[:, cols], dtype)


def cached_taps(cfg, ds, layer_ids, *, final: bool, identity: dict, device: torch.device) -> CachedTaps:
    """The provider of ``--states``: the cache checked against this run (module docstring)."""
    from transformers import AutoConfig

    from dflash_prep.train.split.taps import load_heads

    o = cfg.options
    cache = open_states(cfg.states)
    key = cache.key
    hc = AutoConfig.from_pretrained(o.target)
    hidden = int(hc.hidden_size)
    missing = sorted(set(int(t) for t in layer_ids) - set(key.taps))
    problems = [why for why, bad in (
        (f"was built for dataset {key.dataset_fingerprint[:12]}, --data {cfg.data} is {ds.fingerprint[:12]}",
         key.dataset_fingerprint != ds.fingerprint),
        (f"was built from target {key.target_fingerprint[:12]}, --target {o.target} is "
         f"{identity['target_fingerprint'][:12]}", key.target_fingerprint != identity["target_fingerprint"]),
        (f"holds hidden size {key.hidden}, the target's is {hidden}", key.hidden != hidden),
        (f"holds taps {list(key.taps)}, the run reads {list(layer_ids)} (missing {missing})", bool(missing)),
        ("holds no final hidden state, which the run needs (--loss kl, EAGLE-3)", final and not key.final))
        if bad]
    if problems:
        loss = getattr(o, "loss", "ce")
        draft = getattr(o, "draft_layers", None)
        cmd = extract_command(data=cfg.data, target=o.target, out=f"{Path(cfg.states)}.{cfg.objective}",
                              objective=cfg.objective, draft_layers=draft, target_layer_ids=tuple(o.target_layer_ids),
                              loss=loss, dtype=key.dtype)
        raise FingerprintMismatch(f"--states {cfg.states}: the cache {'; '.join(problems)}; build the right one with "
                                  f"`{cmd}`")
    embed, head = load_heads(o.target, device=device)
    if not cfg.check_states and os.environ.get("RANK", "0") == "0":
        print(f"--no-check-states: the shards of {cfg.states} are read without re-hashing them", flush=True)
    return CachedTaps(cache, layer_ids, final=final, embed_tokens=embed, lm_head=head,
                      num_layers=int(hc.num_hidden_layers), device=device, verify=bool(cfg.check_states),
                      engine=cfg.target_engine, checks=Path(cfg.out) / CHECKS_DIR)
