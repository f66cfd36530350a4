"""The pure work unit of ``tokenize``: a list of records -> ids, loss masks, lengths.

:func:`process_records` touches no files and no global state, so every engine (the
in-process threads and the forked pool of :mod:`dflash_prep.tokenize`, or another
scheduler) calls it on a chunk and gets the same arrays. Chat records go through
:func:`dflash_prep.tokenize.chat.mark` and :func:`dflash_prep.tokenize.chat.plan_rows`, then one
``encode_rows`` batch; plain text through ``encode_plain``.
"""

from __future__ import annotations

import numpy as np

from dflash_prep.errors import InputError
from dflash_prep.tokenize import records as rec
from dflash_prep.tokenize.chat import mark, plan_rows
from dflash_prep.tokenize.thinking import record_mode, zero_counts

MAX_EXAMPLES = 5


class BadRecord(Exception):
    """A bad record under ``--on-error fail``: its index in the chunk and the reason."""

    def __init__(self, index: int, reason: str):
        super().__init__(index, reason)
        self.index, self.reason = index, reason


def process_records(tok, cfg, records: list[dict], *, schema: str, fields: tuple[str, ...],
                    first_record: int) -> dict:
    """Pure: validate, render, tokenize and cut a list of records (no files touched).

    ``tok``: a tokenizer of :mod:`dflash_prep.tokenize.encoders`; ``cfg``: the
    :class:`~dflash_prep.tokenize.tokenize.TokenizeConfig` (mask, role map, max_len, on_overflow,
    on_error); ``records``: dicts of the source's ``fields``; ``first_record``: the global
    index of ``records[0]``.

    Returns ``ids`` (sum L,) int32, ``mask`` (sum L,) uint8, ``lengths`` (n,) int32,
    ``records`` (n,) int64 global record index of each row, ``source_ids`` (n,) the
    record's own ``id`` or None, ``stats``, ``examples`` (``(index, reason)`` of the
    first bad records skipped under ``--on-error skip``) and ``thinking``: the records that
    produced a sample, counted by the mode their answers were written in
    (:func:`dflash_prep.tokenize.thinking.record_mode`). A bad record raises
    :class:`BadRecord` (its index in ``records``) under ``--on-error fail``. An expanded
    conversation yields several rows with the same ``records`` entry.
    """
    chat = schema != "text"
    bad = _Skips(cfg.on_error)
    owner, rows, texts = _render(tok, cfg, records, schema, fields, bad)
    try:
        encoded = (tok.encode_rows(rows) if chat else tok.encode_plain(texts)) if owner else []
    except ValueError:  # some record's content cannot be kept as text: find it, row by row
        encoded = []
        for k, row in zip(owner, rows):
            try:
                encoded.append(tok.encode_rows([row])[0])
            except ValueError as e:
                bad(k, str(e))
                encoded.append(None)
    ids_l, mask_l, lens, rec_l, sid_l = [], [], [], [], []
    kept_records: dict[int, None] = {}  # the records that produced a sample, in order, once each
    for k, enc in zip(owner, encoded):
        if enc is None or k in bad.skipped:
            continue
        kept = _cut(enc, cfg, bad.stats)
        if kept is None:
            continue
        if kept[0].shape[0] == 0:
            bad(k, "the record produced no tokens")
            continue
        ids_l.append(kept[0])
        mask_l.append(kept[1])
        lens.append(kept[0].shape[0])
        rec_l.append(first_record + k)
        sid_l.append(rec.record_id(records[k]))
        kept_records[k] = None
    thinking = zero_counts()
    for k in kept_records:
        thinking[record_mode(records[k])] += 1
    return {
        "ids": np.concatenate(ids_l) if ids_l else np.zeros(0, np.int32),   # (sum L,) int32
        "mask": np.concatenate(mask_l) if mask_l else np.zeros(0, np.uint8),  # (sum L,) uint8
        "lengths": np.asarray(lens, np.int32),                              # (n,)
        "records": np.asarray(rec_l, np.int64),                             # (n,)
        "source_ids": sid_l,                                                # (n,) str | None
        "rows": len(records), "stats": bad.stats, "examples": bad.examples,
        "thinking": thinking,                                               # records per mode
    }


class _Skips:
    """The chunk's bad records: raise under ``--on-error fail``, else count each record once
    (an expanded one too) and keep the first :data:`MAX_EXAMPLES` reasons. Holds the stats."""

    def __init__(self, on_error: str):
        self.on_error = on_error
        self.stats = {"truncated": 0, "dropped": 0, "skipped": 0, "no_loss": 0, "cut_tokens": 0, "dropped_tokens": 0,
                      "expanded": 0, "expanded_rows": 0, "escaped": 0}
        self.examples: list[tuple[int, str]] = []
        self.skipped: set[int] = set()

    def __call__(self, k: int, reason: str) -> None:
        if self.on_error == "fail":
            raise BadRecord(k, reason)
        if k not in self.skipped:
            self.skipped.add(k)
            self.stats["skipped"] += 1
            if len(self.examples) < MAX_EXAMPLES:
                self.examples.append((k, reason))


def _render(tok, cfg, records: list[dict], schema: str, fields: tuple[str, ...], bad: _Skips):
    """``(owner, rows, texts)``: the chat rows (or plain texts) of the records, and the record
    index each came from; a record that does not validate goes to ``bad``."""
    chat, role_map, stats = schema != "text", rec.parse_role_map(cfg.role_map), bad.stats
    owner, rows, texts = [], [], []
    for k, r in enumerate(records):
        try:
            if chat:
                msgs, marked = mark(rec.to_messages(r, schema, fields, role_map), tok.control)
                got, expanded = plan_rows(msgs, tok.render, cfg.mask, has_generation=tok.has_generation,
                                          control=tok.control, marked=marked, stable_template=tok.stable_template)
                stats["escaped"] += marked
                stats["expanded"] += expanded
                stats["expanded_rows"] += len(got) if expanded else 0
                rows += got
                owner += [k] * len(got)
            else:
                texts.append(rec.to_text(r.get(fields[0]), fields[0]))
                owner.append(k)
        except (ValueError, InputError) as e:
            bad(k, str(e))
    return owner, rows, texts


def _cut(enc, cfg, stats: dict):
    """One encoded row ``(ids, mask)`` under ``--max-len`` / ``--on-overflow`` (None: dropped),
    counted in ``stats``; an empty row is returned as is (the caller reports it)."""
    ids, mask = enc
    n = ids.shape[0]
    if n == 0:
        return ids, mask
    if n > cfg.max_len:
        if cfg.on_overflow == "drop":
            stats["dropped"] += 1
            stats["dropped_tokens"] += n
            return None
        stats["truncated"] += 1
        stats["cut_tokens"] += n - cfg.max_len
        ids, mask = ids[: cfg.max_len], mask[: cfg.max_len]
    if not mask.any():
        stats["no_loss"] += 1
    return ids, mask
