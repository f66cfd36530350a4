"""How often each token id occurs in a dataset: counted once per dataset, kept beside it.

Two counts (:class:`CountRule`), each its own pair of files: :data:`TARGET`, how often the loss
trains on each id (``pack --objective eagle3``'s draft vocabulary), and :data:`INPUT_IDS`, how
often each id occurs at all (the DFlash trainer's mask token must never occur,
:mod:`dflash_prep.train.objectives.dflash.mask`).

What :data:`TARGET` counts: the *target tokens*. Position ``t`` of a sample is trained to predict
``input_ids[t + 1]`` when ``loss_mask[t + 1] = 1`` (docs/train.md#labels), so the count of id
``v`` is the number of positions ``t >= 1`` of every sample with ``loss_mask[t] = 1`` and
``input_ids[t] = v``. Position 0 is never a label, whatever its mask says (it differs from
counting ``input_ids[loss_mask == 1]``, as vllm-project/speculators does, only for a sample
whose first token is masked in, which no chat template does). :data:`INPUT_IDS` counts
``input_ids[t]`` at every position of every sample, whatever its mask.

Algorithm: one pass over the shards' record batches, memory-mapped and digest-checked
(:meth:`dflash_prep.formats.dataset.Dataset.record_batches`); a numba kernel adds each
batch into ``P`` per-thread histograms (``P = min(threads, 8)``), summed at the end: memory
``P x V`` int64 plus one batch's views, whatever the dataset's size. An id outside
``[0, V)`` is an error naming its shard.

``DATA/token_counts.npy`` (int64, shape ``(V,)``, V the tokenizer's ``vocab_size``) and
``DATA/token_counts.json`` (format ``dflash-prep/token-counts`` v1: the dataset fingerprint,
V, the counting rule, the array's fingerprint, total, trained ids) hold the result, written
atomically (array first, then the JSON that vouches for it); :data:`INPUT_IDS` writes
``DATA/id_counts.npy`` and ``DATA/id_counts.json`` (format ``dflash-prep/id-counts`` v1, the
same fields). :func:`token_counts` (:func:`id_counts`) reuses them while the JSON is ours,
names this dataset's fingerprint and V and the array matches its fingerprint; otherwise it
counts again and replaces them. Files under those names that dflash-prep did not write (no
JSON of this format beside them) are never replaced: it refuses. A dataset folder it cannot
write to is counted in memory, on every call.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numba as nb
import numpy as np

from dflash_prep.errors import ConfigError, FormatError
from dflash_prep.formats.dataset import Dataset, open_dataset
from dflash_prep.formats.fileio import (atomic_save_npy, atomic_write_json, fingerprint_array, holds_marker, load_npy,
                                        read_json)

COUNTS_FORMAT = "dflash-prep/token-counts"
COUNTS_VERSION = 1
COUNTS_FILE = "token_counts.npy"
COUNTS_META = "token_counts.json"
#: What a count is, as the JSON records it.
COUNTED = "input_ids[t] for positions t >= 1 with loss_mask[t] = 1 (the tokens the loss trains on)"
_MAX_PARTS = 8


@dataclass(frozen=True)
class CountRule:
    """What one count counts and where it is kept (module docstring)."""

    file: str
    meta: str
    format: str
    counted: str
    """The rule in words, as the JSON records it."""
    labels_only: bool
    """Count labels only (positions ``t >= 1`` with ``loss_mask[t] = 1``), else every position."""
    writer: str
    """Who keeps these files, for the refusal to replace a user's file of that name."""


TARGET = CountRule(COUNTS_FILE, COUNTS_META, COUNTS_FORMAT, COUNTED, True, "pack --objective eagle3")
INPUT_IDS = CountRule("id_counts.npy", "id_counts.json", "dflash-prep/id-counts",
                      "input_ids[t] at every position t (every id the data holds)", False,
                      "the DFlash trainer's mask-token check")


@nb.njit(cache=True, parallel=True)
def _count_batch(ids, mask, off, vocab, hist, labels_only=True):
    # hist: (P, vocab) int64; part p adds the rows [n p / P, n (p+1) / P). Returns per part the
    # first flat position holding an id outside [0, vocab), or -1.
    n_parts, n = hist.shape[0], off.shape[0] - 1
    first = 1 if labels_only else 0
    bad = np.full(n_parts, -1, np.int64)
    for p in nb.prange(n_parts):
        for r in range(n * p // n_parts, n * (p + 1) // n_parts):
            for t in range(off[r] + first, off[r + 1]):   # position 0 of a sample is never a label
                if mask[t] or not labels_only:
                    v = ids[t]
                    if 0 <= v < vocab:
                        hist[p, v] += 1
                    elif bad[p] < 0:
                        bad[p] = t
    return bad


def count_target_tokens(ds: Dataset) -> np.ndarray:
    """The count of every id of the tokenizer's vocabulary (int64, ``(V,)``) over ``ds``
    (module docstring: the target tokens), from one pass over its shards."""
    return _count(ds, TARGET)


def count_ids(ds: Dataset) -> np.ndarray:
    """Like :func:`count_target_tokens`, every position counted (:data:`INPUT_IDS`)."""
    return _count(ds, INPUT_IDS)


def _count(ds: Dataset, rule: CountRule) -> np.ndarray:
    vocab = int(ds.tokenizer_info["vocab_size"])
    hist = np.zeros((max(1, min(nb.get_num_threads(), _MAX_PARTS)), vocab), np.int64)
    for first, ids, mask, off in ds.record_batches(check=True):
        bad = _count_batch(ids, mask, off, np.int64(vocab), hist, rule.labels_only)
        if (bad >= 0).any():
            t = int(bad[bad >= 0].min())
            sid = first + int(np.searchsorted(off, t, side="right")) - 1
            raise FormatError(f"{ds.shard_of(sid)}: sample {sid} holds token id {int(ids[t])}, outside the "
                              f"tokenizer's vocabulary of {vocab}; re-run `dflash-prep tokenize --overwrite`")
    return hist.sum(axis=0)


@dataclass(frozen=True)
class TokenCounts:
    """A dataset's target-token counts (module docstring).

    Attributes:
        counts: int64 ``(V,)``, indexed by token id.
        fingerprint: :func:`fingerprint_array` of ``counts`` (what manifests record).
        dataset_fingerprint: the dataset they count.
        reused: read from ``token_counts.npy`` (``id_counts.npy``) (True) or counted by this call (False).
        cached: that file now holds them (False: the folder is not writable).
    """

    counts: np.ndarray
    fingerprint: str
    dataset_fingerprint: str
    reused: bool
    cached: bool

    @property
    def vocab_size(self) -> int:
        return int(self.counts.shape[0])

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def of(self, token_id: int) -> int:
        """The count of ``token_id`` (0 past the tokenizer's vocabulary: no sample holds such an id)."""
        return int(self.counts[token_id]) if 0 <= token_id < self.vocab_size else 0


def _ours(folder: Path, rule: CountRule = TARGET) -> bool:
    """Whether the counts' files under ``folder`` are dflash-prep's (or absent: free to write)."""
    if holds_marker(folder, rule.meta, rule.format):
        return True
    return not (folder / rule.meta).exists() and not (folder / rule.file).exists()


def _recorded(meta: dict):
    c = meta.get("counts")
    return c.get("fingerprint") if isinstance(c, dict) else None


def read_cached(folder: str | Path, dataset_fingerprint: str, vocab: int,
                rule: CountRule = TARGET) -> np.ndarray | None:
    """``token_counts.npy`` (``rule.file``) when its JSON vouches for it for this dataset and
    vocabulary, else None (absent, stale or edited)."""
    folder = Path(folder)
    if not holds_marker(folder, rule.meta, rule.format):
        return None
    try:
        meta = read_json(folder / rule.meta, format=rule.format, versions=(COUNTS_VERSION,))
        if meta.get("dataset_fingerprint") != dataset_fingerprint or meta.get("vocab_size") != vocab:
            return None
        arr = load_npy(folder / rule.file, dtype=np.int64, mmap=False)
    except FormatError:
        return None
    return arr if arr.shape == (vocab,) and fingerprint_array(arr) == _recorded(meta) else None


def write_counts(folder: str | Path, counts: np.ndarray, dataset_fingerprint: str, rule: CountRule = TARGET) -> None:
    """Write ``token_counts.npy`` then ``token_counts.json`` (``rule``'s files) atomically
    (refusing files that are not ours)."""
    folder = Path(folder)
    if not _ours(folder, rule):
        raise ConfigError(f"{folder / rule.file} or {rule.meta} exists but was not written by dflash-prep (no "
                          f"{rule.format} JSON); it was left untouched. Move it away to let {rule.writer} "
                          "keep its token counts there")
    counts = np.ascontiguousarray(counts, np.int64)
    atomic_save_npy(folder / rule.file, counts)
    atomic_write_json(folder / rule.meta, {
        "dataset_fingerprint": dataset_fingerprint, "vocab_size": int(counts.shape[0]), "counted": rule.counted,
        "counts": {"file": rule.file, "dtype": "int64", "shape": list(counts.shape),
                   "fingerprint": fingerprint_array(counts)},
        "total": int(counts.sum()), "trained_ids": int(np.count_nonzero(counts))},
        format=rule.format, version=COUNTS_VERSION)


def token_counts(folder: str | Path) -> TokenCounts:
    """The dataset's target-token counts: the cached ones when they still hold, else counted
    and cached (module docstring)."""
    return _cached_counts(Path(folder), TARGET, lambda ds: count_target_tokens(ds))


def id_counts(folder: str | Path) -> TokenCounts:
    """How often each id occurs anywhere in the dataset (:data:`INPUT_IDS`), cached as
    :func:`token_counts` caches its counts."""
    return _cached_counts(Path(folder), INPUT_IDS, lambda ds: count_ids(ds))


def _cached_counts(folder: Path, rule: CountRule, count) -> TokenCounts:
    ds = open_dataset(folder)
    vocab = int(ds.tokenizer_info["vocab_size"])
    cached = read_cached(folder, ds.fingerprint, vocab, rule)
    if cached is not None:
        return TokenCounts(cached, fingerprint_array(cached), ds.fingerprint, reused=True, cached=True)
    counts = count(ds)
    try:
        write_counts(folder, counts, ds.fingerprint, rule)
        stored = True
    except OSError:
        stored = False                          # a read-only dataset: counted again next time
    return TokenCounts(counts, fingerprint_array(counts), ds.fingerprint, reused=False, cached=stored)


# verify recounts from the shards; a root's epochs share one recount per process
_RECOUNTED: dict[tuple[str, str], np.ndarray] = {}


def recount(ds: Dataset) -> np.ndarray:
    """:func:`count_target_tokens` of ``ds``, once per process per dataset (``verify``)."""
    key = (str(Path(ds.folder).resolve()), ds.fingerprint)
    if key not in _RECOUNTED:
        _RECOUNTED.clear()
        _RECOUNTED[key] = count_target_tokens(ds)
    return _RECOUNTED[key]


def file_problems(folder: str | Path, recounted: np.ndarray, dataset_fingerprint: str) -> list[str]:
    """What is wrong with the cached counts against a recount from the shards (none when the
    files are absent: they are a cache, the shards are the truth)."""
    folder = Path(folder)
    if not (folder / COUNTS_FILE).exists() and not (folder / COUNTS_META).exists():
        return []
    if not holds_marker(folder, COUNTS_META, COUNTS_FORMAT):
        return [f"{folder / COUNTS_META}: missing or not a {COUNTS_FORMAT} file; delete {COUNTS_FILE} and the JSON "
                "and re-run pack --objective eagle3"]
    try:
        meta = read_json(folder / COUNTS_META, format=COUNTS_FORMAT, versions=(COUNTS_VERSION,))
        arr = load_npy(folder / COUNTS_FILE, dtype=np.int64, mmap=False)
    except FormatError as e:
        return [str(e)]
    if meta.get("dataset_fingerprint") != dataset_fingerprint:
        return []                                   # counts of another dataset version: pack recounts them
    if arr.shape != recounted.shape or not np.array_equal(arr, recounted):
        n = int((arr != recounted).sum()) if arr.shape == recounted.shape else arr.size
        return [f"{folder / COUNTS_FILE}: differs from the counts of the shards in {n} ids (edited or corrupt); "
                "delete it and its JSON, pack recounts them"]
    if fingerprint_array(arr) != _recorded(meta):
        return [f"{folder / COUNTS_META}: the counts' fingerprint does not match {COUNTS_FILE}; delete both, pack "
                "recounts them"]
    return []
