"""EAGLE-3's draft vocabulary: which target ids the drafter's LM head predicts.

Given the target-token counts (:mod:`dflash_prep.formats.token_counts`, ``c[v]`` per id of the
target vocabulary of ``V`` ids) and ``V_d = draft_vocab_size``:

- the draft vocabulary is the ``V_d`` ids of largest count; a tie goes to the lower id
  (count descending, then id ascending: the order vllm-project/speculators sorts by). When
  fewer than ``V_d`` ids were ever trained on (count > 0), the rest are the lowest
  never-trained ids (count 0: the same rule), and ``trained_ids`` records how many were;
- draft id ``i`` is the ``i``-th of those ids in ascending order, so
  ``d2t[i] = target id - i`` (int64, ``(V_d,)``, non-decreasing and >= 0) and
  ``target id = i + d2t[i]``;
- ``t2d[t]`` (bool, ``(V,)``) says whether target id ``t`` is in the draft vocabulary; the
  draft id of such a ``t`` is ``cumsum(t2d)[t] - 1``.

Sorting V counts is O(V log V) for V ~ 10^5: microseconds, done per pack call. ``V_d > V``
is an error naming both. A manifest stores ``d2t.npy`` and ``t2d.npy`` in every epoch folder
and their :meth:`VocabMap.fingerprint` in its ``eagle3`` header section; :func:`load` reads
them back for the trainer, checked.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash_prep.errors import ConfigError, FormatError
from dflash_prep.formats.fileio import fingerprint_array, fingerprint_bytes

#: The selection rule, as manifests record it.
TIE_RULE = "count descending, then token id ascending (a tie goes to the lower id); never-trained ids fill the rest"
MAP_VERSION = 1


@dataclass(frozen=True)
class VocabMap:
    """The draft vocabulary (module docstring).

    Attributes:
        d2t: int64 ``(V_d,)``: target id of draft id ``i`` is ``i + d2t[i]``.
        t2d: bool ``(V,)``: target id ``t`` is in the draft vocabulary.
        trained_ids: ids of the whole target vocabulary with a count > 0.
        coverage: share of the trained-on tokens (counted with multiplicity) whose id is in
            the draft vocabulary: the labels the drafter can predict at all (1.0 with no counts).
    """

    d2t: np.ndarray
    t2d: np.ndarray
    trained_ids: int
    coverage: float

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.shape[0])

    @property
    def vocab_size(self) -> int:
        return int(self.t2d.shape[0])

    @property
    def target_ids(self) -> np.ndarray:
        """int64 ``(V_d,)``: the target id of each draft id, ascending."""
        return np.arange(self.draft_vocab_size, dtype=np.int64) + self.d2t

    @property
    def fingerprint(self) -> str:
        """Of both arrays (dtype, shape, bytes): what the manifest header records."""
        return fingerprint_bytes(fingerprint_array(self.d2t), fingerprint_array(self.t2d))


def build(counts: np.ndarray, draft_vocab_size: int) -> VocabMap:
    """The map of the module docstring from ``counts`` (one per target id)."""
    counts = np.asarray(counts)
    vocab, dv = int(counts.shape[0]), int(draft_vocab_size)
    if counts.ndim != 1 or counts.dtype.kind not in "iu" or (len(counts) and int(counts.min()) < 0):
        raise ConfigError(f"token counts must be a 1-D array of non-negative integers, got {counts.dtype} "
                          f"{counts.shape}")
    if dv < 1:
        raise ConfigError(f"--draft-vocab-size must be >= 1, got {dv}")
    if dv > vocab:
        raise ConfigError(f"--draft-vocab-size {dv} exceeds the target vocabulary of {vocab} ids (the dataset's "
                          f"tokenizer); pass at most {vocab}")
    c = counts.astype(np.int64)
    order = np.argsort(-c, kind="stable")             # stable: equal counts keep ascending ids
    chosen = np.sort(order[:dv])                       # (V_d,) int64 target ids, ascending
    t2d = np.zeros(vocab, np.bool_)
    t2d[chosen] = True
    total = int(c.sum())
    coverage = float(c[chosen].sum()) / total if total else 1.0
    return VocabMap(d2t=chosen - np.arange(dv, dtype=np.int64), t2d=t2d, trained_ids=int(np.count_nonzero(c)),
                    coverage=coverage)


def load(m) -> VocabMap:
    """The map of a ``pack --objective eagle3`` epoch (a :class:`dflash_prep.formats.manifest.Manifest`):
    its ``d2t.npy``/``t2d.npy`` (memory-mapped), checked against its ``eagle3`` header section."""
    d = m.header.get("eagle3")
    if d is None or "d2t" not in m.arrays or "t2d" not in m.arrays:
        raise ConfigError(f"{m.path}: not packed with --objective eagle3 (no eagle3 section, d2t.npy or t2d.npy); "
                          "re-pack with --objective eagle3")
    d2t, t2d = m.arrays["d2t"], m.arrays["t2d"]
    vm = VocabMap(d2t=d2t, t2d=t2d, trained_ids=int(d["trained_ids"]), coverage=float(d["vocab_coverage"]))
    if (vm.draft_vocab_size, vm.vocab_size) != (int(d["draft_vocab_size"]), int(d["vocab_size"])) or \
            vm.fingerprint != d["map_fingerprint"]:
        raise FormatError(f"{m.path}: d2t.npy/t2d.npy do not match the map the manifest header records; re-pack "
                          "the epoch (`dflash-prep pack ... --overwrite`)")
    return vm
