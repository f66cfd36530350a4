"""Contamination check: which evaluation prompts share a long token span with the drafter's training data.

A drafter trained on a benchmark's own prompts (and the target's answers to them) has seen what it is
asked to draft: its tau on those prompts overstates what it does on unseen ones. ``dflash-prep
evaluate`` counts, per prompt set, the prompts that share at least one **n-gram of n tokens** (default
:data:`DEFAULT_N` = 13, the span GPT-3's decontamination used) with any training sample, prints one
``warning:`` line per set with a nonzero count, and records the counts in its report.

**What is compared.** A prompt's n-grams are taken from its **user text alone**: each user turn's
upstream text, encoded by the target's tokenizer without special tokens and without the chat
template; for a shipped set also without the benchmark's prompt format (GSM8K's "Please reason step
by step, and put your final answer within \\boxed{}." is 16+ tokens that many math training sets
append to every question; HumanEval's "Write a solution to the following problem ..." is 20). A
training sample's n-grams are taken over its whole ``input_ids`` (every turn, the template's tokens
too); no n-gram spans two samples or two user turns. So nothing a prompt shares with training only
through framing counts: not the template's own tokens (``<|im_start|>system\\nYou are a helpful
assistant.<|im_end|>``, a default system prompt in every sample and every rendered prompt), not the
benchmark's wording, and not a span of prompt text plus framing. The other rules considered: n-grams of
the rendered prompts minus those of the template around an empty conversation still count a span of
framing plus the benchmark's fixed wording (and the first word of any question), and n-grams inside
the loss-masked user turns only would miss a prompt copied into an assistant turn. Text encoded alone
is encoded as inside the template except, with some tokenizers, its first token (a SentencePiece
``▁`` prefix): a prompt shares its interior n-grams, so a copied prompt is found when its user text
is at least n + 1 tokens; a shorter one is not ``checked`` (the report counts those).

**How.** Every n-gram of the (small) prompt side is hashed (a polynomial hash over ``uint64``,
wrapping mod 2**64) into a sorted array, with its tokens; the training shards are streamed once, record
batch by record batch in slices of :data:`CHUNK_TOKENS`, every window's hash computed in ``n``
vectorized multiply-adds, passed through a bitmap of the table's top hash bits and only then looked up
with ``searchsorted`` (:meth:`PromptGrams.lookup`); each hash hit is confirmed token by token, so a
collision never counts. Memory: about 40 bytes per token of one slice, whatever the dataset's size.
Measured (docs/evaluation.md#contamination-check, ``python -m dflash_prep.bench.contamination_cost``):
5M training tokens against 1,000 prompts, 0.2 s to index the prompts and 0.3 s to scan (0.11 s of
CPU); 50M tokens, 2.3 s.

**Where the training data comes from.** ``evaluate --train-data DATA``, or else each export's
provenance: its ``config.json`` ``dflash_prep.dataset_fingerprint``, its ``export.json`` naming the
checkpoint it was exported from, and that run folder's ``log.jsonl`` header naming the ``--data``
folder (:func:`provenance_data`). The folder is used only while its ``meta.json`` fingerprint is the
one recorded; otherwise one ``note:`` line says why the check was skipped. Data tokenized with
another vocabulary than the target's is skipped too (its token ids mean other text).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from dflash_prep.engine.serving_mode import training_mode
from dflash_prep.errors import ConfigError, DflashError
from dflash_prep.evalsets import describe
from dflash_prep.formats.dataset import META_FILE, open_dataset, read_meta
from dflash_prep.tokenize.encoders import tokenizer_file_hashes
from dflash_prep.tokenize.identity import VOCAB_FILES

DEFAULT_N = 13
BASE = 0x9E3779B97F4A7C15
"""The hash's multiplier: odd (invertible mod 2**64) and with its bits spread, so every token moves
every bit of the hash."""
CHUNK_TOKENS = 1 << 20
"""Training tokens hashed at a time: bounds the scan's memory (about 40 MB) on any dataset."""
EXAMPLES = 10
"""Contaminated prompts listed by id per set (the count is always complete)."""
SIDECAR_FORMATS = ("dflash-prep/drafter-export", "dflash-prep/eagle3-export")
"""``export.json`` formats that name their checkpoint (``source.checkpoint``): every drafter objective's."""
LOG_FORMAT = "dflash-prep/train-log"
RULE = ("n-grams of each prompt's user text encoded alone (no chat template, no benchmark prompt format) "
        "against n-grams of every training sample's input_ids; hash hits confirmed token by token")


# ----------------------------------------------------------------------------- hashing and the scan
def hash_windows(tokens: np.ndarray, n: int, base: int = BASE) -> np.ndarray:
    """``(len(tokens) - n + 1,)`` uint64: element i is the hash of ``tokens[i:i + n]``,
    ``sum_j tokens[i + j] * base**(n - 1 - j)`` mod 2**64 (numpy's uint64 arithmetic wraps)."""
    t = np.asarray(tokens).astype(np.uint64)               # (L,)
    m = len(t) - n + 1
    if m <= 0:
        return np.zeros(0, np.uint64)
    b = np.uint64(base)
    h = t[:m].copy()
    for j in range(1, n):
        h *= b
        h += t[j:j + m]
    return h


class PromptGrams:
    """Every distinct n-gram of each prompt's token lists, sorted by hash, and which prompt holds it.

    ``prompts[u]`` is prompt u's token-id lists (one per user turn: no n-gram spans two); an n-gram
    held by several prompts is one row per prompt."""

    def __init__(self, prompts: list[list[list[int]]], n: int, *, base: int = BASE):
        if n < 1:
            raise ConfigError(f"the contamination n-gram length must be >= 1, got {n}")
        self.n, self.base, self.units = n, base, len(prompts)
        grams, owner = [], []
        for u, turns in enumerate(prompts):
            for t in turns:
                if len(t) >= n:
                    grams.append(sliding_window_view(np.asarray(t, np.int64), n))    # (len - n + 1, n)
                    owner.append(np.full(len(t) - n + 1, u, np.int64))
        g = np.concatenate(grams) if grams else np.zeros((0, n), np.int64)            # (G, n) every window
        o = np.concatenate(owner) if owner else np.zeros(0, np.int64)
        h = _hash_rows(g, base)                                   # (G,) uint64
        order = np.lexsort((o, h))                                # by hash, then prompt
        h, g, o = h[order], g[order], o[order]
        # one row per distinct (prompt, n-gram): a repeat sorts next to its twin (unless a colliding n-gram of
        # the same prompt sorts between them: then it stays, which only costs a row)
        again = np.r_[False, (h[1:] == h[:-1]) & (o[1:] == o[:-1]) & (g[1:] == g[:-1]).all(axis=1)][:len(h)]
        self.hashes, self.grams, self.owner = h[~again], g[~again], o[~again]     # (G,) uint64, (G, n), (G,)
        self.checked = np.unique(o)
        """Prompts with at least one n-gram (user text of >= n tokens)."""
        edges = np.flatnonzero(np.r_[True, self.hashes[1:] != self.hashes[:-1], True])
        self.max_run = int(np.diff(edges).max()) if len(self.hashes) else 0
        """The most rows sharing one hash (the same n-gram in several prompts, or a collision)."""
        bits = min(max(len(self.hashes).bit_length() + 5, 16), 26)
        self._shift = np.uint64(64 - bits)
        self._seen = np.zeros(1 << bits, bool)                  # (2**bits,): a hash's top bits occur here
        self._seen[(self.hashes >> self._shift).astype(np.int64)] = True
        """A prefilter: with 2**bits >= 32 x the rows, about 3 % of training windows pass it to the
        binary search (a gather costs ~8 ms per million windows, the search ~130 ms)."""

    def lookup(self, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(i, row)``: every window i of ``h`` whose hash equals that of ``row`` (candidates only)."""
        size = len(self.hashes)
        if size == 0 or len(h) == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        pos = np.flatnonzero(self._seen[h >> self._shift])         # windows whose top bits some row has
        first = np.searchsorted(self.hashes, h[pos])               # the first row with hash >= h[pos]
        hit = self.hashes[np.minimum(first, size - 1)] == h[pos]
        pos, first = pos[hit], first[hit]
        out_i, out_row = [], []
        for k in range(self.max_run):                            # equal hashes are contiguous from `first`
            row = first + k
            ok = row < size
            ok[ok] = self.hashes[row[ok]] == h[pos[ok]]
            if not ok.any():
                break
            out_i.append(pos[ok])
            out_row.append(row[ok])
        if not out_i:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(out_i), np.concatenate(out_row)


def _hash_rows(g: np.ndarray, base: int) -> np.ndarray:
    """(G,) uint64: :func:`hash_windows` of each row of ``g`` (G, n)."""
    b = np.uint64(base)
    h = np.zeros(len(g), np.uint64)
    for j in range(g.shape[1]):
        h *= b
        h += g[:, j].astype(np.uint64)
    return h


def scan(dataset, grams: PromptGrams, *, chunk: int = CHUNK_TOKENS) -> dict[int, int]:
    """``{prompt: the first training sample id sharing an n-gram with it}`` over every sample of
    ``dataset`` (an open :class:`~dflash_prep.formats.dataset.Dataset`), streamed once (module docstring)."""
    n, found = grams.n, {}
    if len(grams.hashes) == 0:
        return found
    span = np.arange(n)
    for first_id, ids, _mask, off in dataset.record_batches():
        for a in range(0, max(len(ids) - n + 1, 0), chunk):
            t = ids[a:a + chunk + n - 1]                          # windows starting at a .. a + chunk - 1
            i, row = grams.lookup(hash_windows(t, n, grams.base))
            if len(i) == 0:
                continue
            start = a + i                                         # in the batch's flat ids
            sample = np.searchsorted(off, start, side="right") - 1
            inside = start + n <= off[sample + 1]                 # the window does not run into the next sample
            same = inside & (t[i[:, None] + span] == grams.grams[row]).all(axis=1)
            for u, s in zip(grams.owner[row[same]].tolist(), sample[same].tolist()):
                found.setdefault(u, first_id + s)
            if len(found) == len(grams.checked):
                return found
    return found


# ----------------------------------------------------------------------------- the prompts' user text
def _unformat(text: str, pre: str, post: str) -> str:
    """``text`` without the prompt format's fixed wording around its placeholder (when it has it)."""
    if len(text) >= len(pre) + len(post) and text.startswith(pre) and text.endswith(post):
        return text[len(pre):len(text) - len(post)]
    return text


def _file_texts(path: Path, limit: int) -> list[list[str]]:
    """The user turns of each prompt of a ``--prompts`` file, as :func:`~dflash_prep.train.prompts.load_prompts`
    reads it (the first ``limit``; 0: all): a chat's user messages before its first assistant turn, or a
    raw ``prompt``. A system message is framing, not the prompt: left out."""
    out = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            if isinstance(rec.get("messages"), list):
                msgs = rec["messages"]
                cut = next((i for i, m in enumerate(msgs) if isinstance(m, dict) and m.get("role") == "assistant"),
                           len(msgs))
                out.append([m["content"] for m in msgs[:cut] if isinstance(m, dict) and m.get("role") == "user"
                            and isinstance(m.get("content"), str)])
            else:
                out.append([rec["prompt"]])
            if limit and len(out) >= limit:
                break
    return out


def user_texts(ps) -> tuple[list[str], list[list[str]]]:
    """``(ids, texts)`` of a :class:`~dflash_prep.engine.prompt_sets.PromptSet`: per prompt (a
    conversation, for a multi-turn set) its id (the upstream id of a shipped set, the 0-based index in a
    file) and its user turns' text, a shipped set's without its prompt format."""
    if ps.source.get("kind") == "shipped":
        fmt = describe(ps.name).get("prompt_format") or {}
        template, ph = fmt.get("template") or "", fmt.get("placeholder") or ""
        pre, post = template.split(ph, 1) if ph and ph in template else ("", "")
        return ([str(x) for x in ps.source["ids"]],
                [[_unformat(t, pre, post) for t in turns] for turns in ps.turns])
    texts = _file_texts(Path(ps.source["path"]), int(ps.source.get("max_prompts") or 0))
    return [str(i) for i in range(len(texts))], texts


# ----------------------------------------------------------------------------- one training data folder
def vocabulary_mismatch(meta: dict, target: Path) -> str | None:
    """Why a dataset's token ids cannot be compared with the target tokenizer's (None: they can):
    the vocabulary files ``tokenize`` recorded (``meta.json`` ``tokenizer.files``) and the target's
    must share at least one, all equal (:func:`dflash_prep.tokenize.identity.check_tokenizer`'s rule;
    the chat template does not matter here)."""
    theirs = {k: v for k, v in ((meta.get("tokenizer") or {}).get("files") or {}).items() if k in VOCAB_FILES}
    ours = {k: v for k, v in tokenizer_file_hashes(Path(target)).items() if k in VOCAB_FILES}
    common = theirs.keys() & ours.keys()
    if common and all(theirs[k] == ours[k] for k in common):
        return None
    if common:
        return "it was tokenized with another vocabulary than the target's (its token ids spell other text)"
    return "it records no tokenizer file the target has (the byte tokenizer, or another model's)"


def check_data(data: Path, sets: list, tokenizer, *, n: int = DEFAULT_N) -> dict:
    """Every set's prompts against one tokenized training folder ``data``: the folder's facts, the
    cost, and per set ``prompts``, ``checked`` (user text of >= n tokens), ``contaminated`` and up to
    :data:`EXAMPLES` ``examples`` (prompt id, the first training sample id sharing an n-gram)."""
    t0 = time.monotonic()
    ds = open_dataset(data)
    owners, units = [], []                               # per prompt: (set name, id); its user turns
    for ps in sets:
        ids, texts = user_texts(ps)
        owners += [(ps.name, i) for i in ids]
        units += texts
    flat = [t for turns in units for t in turns]
    enc = tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else []
    prompts, at = [], 0
    for turns in units:
        prompts.append(enc[at:at + len(turns)])
        at += len(turns)
    grams = PromptGrams(prompts, n)
    found = scan(ds, grams)
    checked = set(grams.checked.tolist())
    per_set = {}
    for ps in sets:
        mine = [u for u, (name, _) in enumerate(owners) if name == ps.name]
        hit = [u for u in mine if u in found]
        per_set[ps.name] = {"prompts": len(mine), "checked": sum(u in checked for u in mine),
                            "contaminated": len(hit),
                            "examples": [{"id": owners[u][1], "sample": found[u]} for u in hit[:EXAMPLES]]}
    return {"data": str(data), "fingerprint": ds.fingerprint, "samples": len(ds),
            "tokens": int(ds.lengths.sum(dtype=np.int64)), "prompt_ngrams": int(len(grams.hashes)),
            "seconds": round(time.monotonic() - t0, 3), "sets": per_set}


def warning_line(name: str, s: dict, n: int, data: str | Path) -> str:
    """The one line a set with contaminated prompts gets."""
    return (f"warning: {name}: {s['contaminated']} of {s['prompts']} prompts share a {n}-token span with the "
            f"training data ({data}); their tau overstates unseen prompts")


# ----------------------------------------------------------------------------- where the data is
def _log_header(path: Path) -> dict | None:
    try:
        with open(path) as f:
            head = json.loads(f.readline())
    except (OSError, ValueError):
        return None
    return head if isinstance(head, dict) and head.get("format") == LOG_FORMAT else None


def provenance_data(export: Path) -> tuple[Path | None, str]:
    """``(folder, "")``: the training data an export was trained on, found through its provenance
    (module docstring) and still holding the fingerprint its ``config.json`` records; or ``(None,
    why)``. A relative ``--data`` is tried from the run folder (relative to the run's ``--out``, both
    given from the training command's folder) and from here."""
    want = (training_mode(export) or {}).get("dataset_fingerprint")
    if not want:
        return None, "it records no training data (exported before dflash-prep recorded it, or by another tool)"
    side = Path(export) / "export.json"
    try:
        sidecar = json.loads(side.read_text())
    except (OSError, ValueError):
        return None, f"{side} is missing or unreadable, so its run is unknown"
    ckpt = (sidecar.get("source") or {}).get("checkpoint") if sidecar.get("format") in SIDECAR_FORMATS else None
    if not ckpt:
        return None, f"{side} names no checkpoint, so its run is unknown"
    run = Path(ckpt).parent
    cfg = (_log_header(run / "log.jsonl") or {}).get("config") or {}
    if not cfg.get("data"):
        return None, f"{run / 'log.jsonl'} is gone or names no --data (not a training run's folder, or moved)"
    data, out = Path(cfg["data"]), cfg.get("out")
    tries = [data] if data.is_absolute() else \
        ([run / os.path.relpath(data, out)] if out and not Path(out).is_absolute() else []) + [data]
    why = f"its training data {data} is gone"
    for folder in tries:
        if not (folder / META_FILE).is_file():
            continue
        try:
            have = str(read_meta(folder)["fingerprint"])
        except DflashError as e:
            why = f"its training data {folder} does not open ({e})"
            continue
        if have == want:
            return folder, ""
        why = f"{folder} now holds other data (fingerprint {have[:12]}; the drafter trained on {want[:12]})"
    return None, why


# ----------------------------------------------------------------------------- one evaluate run
def check_run(*, exports: list[Path], sets: list, tokenizer, target: Path, train_data: str | Path | None = None,
              n: int = DEFAULT_N, say: Callable[[str], None] = lambda _m: None) -> dict:
    """The report's ``contamination`` section for one ``evaluate`` run: each distinct training data
    folder (``train_data`` for every export, else each export's :func:`provenance_data`) checked once
    against every set (:func:`check_data`), a ``warning:`` line per set with contaminated prompts
    and a ``note:`` line per export not checked (``say``). ``n`` 0: no check. A ``train_data`` that
    does not open is an error (the user named it); a recorded folder that fails is a note."""
    if n < 0:
        raise ConfigError(f"--contamination-n must be >= 0 (0: no check), got {n}")
    res = {"n": n, "rule": RULE, "checks": [], "skipped": []}
    if n == 0:
        res["skipped"] = [{"export": str(e), "why": "--contamination-n 0"} for e in exports]
        return res
    groups: dict[Path, list[Path]] = {}
    if train_data:
        data = Path(train_data)
        have = str(open_dataset(data).fingerprint)
        for e in exports:
            want = (training_mode(e) or {}).get("dataset_fingerprint")
            if want and want != have:
                say(f"note: --train-data {data} is not the data {e} trained on (fingerprint {have[:12]}, the "
                    f"drafter records {want[:12]}); checked against it as asked")
        groups[data] = list(exports)
    else:
        for e in exports:
            data, why = provenance_data(e)
            if data is None:
                res["skipped"].append({"export": str(e), "why": why})
                say(f"note: contamination check skipped for {e}: {why}; pass --train-data DATA to check")
            else:
                groups.setdefault(data.resolve(), []).append(e)
    for data, es in groups.items():
        why = vocabulary_mismatch(read_meta(data), target)
        if why is not None:
            for e in es:
                res["skipped"].append({"export": str(e), "why": f"{data}: {why}"})
            say(f"note: contamination check skipped for {data}: {why}")
            continue
        chk = {**check_data(data, sets, tokenizer, n=n), "exports": [str(e) for e in es],
               "from": "--train-data" if train_data else "the export's provenance"}
        res["checks"].append(chk)
        for name, s in chk["sets"].items():
            if s["contaminated"]:
                say(warning_line(name, s, n, data))
    return res


def attach(report: dict, section: dict) -> None:
    """Put ``section`` (:func:`check_run`) into an ``evaluate`` report: as its ``contamination`` and,
    in every ``exports[i].sets[<set>]``, that export's data's counts for the set (or why it was skipped)."""
    report["contamination"] = section
    for e in report["exports"]:
        chk = next((c for c in section["checks"] if e["path"] in c["exports"]), None)
        why = next((s["why"] for s in section["skipped"] if s["export"] == e["path"]), "not checked")
        for name, c in e["sets"].items():
            c["contamination"] = ({"data": chk["data"], "n": section["n"], **chk["sets"][name]} if chk
                                  else {"skipped": why})


def markdown_lines(report: dict) -> list[str]:
    """The report's contamination section as markdown lines (none when the report has none)."""
    sec = report.get("contamination")
    if not sec or not (sec["checks"] or sec["skipped"]):
        return []
    lines = ["", f"Contamination: prompts whose user text shares a {sec['n']}-token span with the training data "
                 "(the chat template and the benchmark's prompt format left out).", ""]
    if sec["checks"]:
        lines += ["| training data | set | prompts | checked | contaminated | examples (prompt id: sample id) |",
                  "|---|---|---:|---:|---:|---|"]
        for c in sec["checks"]:
            for name, s in c["sets"].items():
                ex = ", ".join(f"{x['id']}: {x['sample']}" for x in s["examples"]) or "-"
                more = f" (+{s['contaminated'] - len(s['examples'])})" if s["contaminated"] > len(s["examples"]) else ""
                lines.append(f"| {c['data']} | {name} | {s['prompts']} | {s['checked']} | {s['contaminated']} | "
                             f"{ex}{more} |")
    if sec["skipped"]:
        lines += [""] + [f"- not checked for {s['export']}: {s['why']}" for s in sec["skipped"]]
    return lines


def check_plan(plan, say: Callable[[str], None]) -> dict:
    """:func:`check_run` for an ``evaluate`` plan (:class:`~dflash_prep.engine.evaluate.Plan`): its
    exports, sets, tokenizer and target, ``--train-data`` and ``--contamination-n``."""
    return check_run(exports=plan.exports, sets=plan.sets, tokenizer=plan.tokenizer, target=plan.target,
                     train_data=plan.cfg.train_data or None, n=plan.cfg.contamination_n, say=say)
