"""``dflash-prep synth``: a reproducible multi-turn chat corpus with profile-shaped lengths.

Algorithm: draw target lengths with :func:`dflash_prep.synth.profiles.make_lengths` (profile, n,
seed). Each target L is the sample's length in tokens of the built-in byte-level tokenizer
once ``tokenize`` renders it with the built-in ChatML layout (one token per special marker,
one per byte). A conversation gets an optional system prompt and 1-8 user/assistant pairs
(more for longer samples); the L minus the layout's own tokens is split over the messages,
assistants taking most of it. Every message's text is a slice, at a keyed random offset, of
a text pool generated once per seed: English-like prose with punctuation, markdown lists
and Python/shell code lines. The pool is ASCII, so each character is exactly one byte-level
token and the realized lengths equal the targets exactly (``tokenize --tokenizer byte``
reproduces ``make_lengths`` bit for bit; the tests check it). Slicing makes the generator
O(1) per message: 20k samples take ~1 s and 200k (278 M characters) ~10-15 s on the 2-core
dev VM, dominated by ``json.dumps``.

Output: ``OUT/chat.jsonl`` (``{"messages": [{"role", "content"}, ...]}`` per line) and
``OUT/synth.json`` (format ``dflash-prep/synth`` v1: profile, n, seed, the target lengths'
fingerprint and totals), written together through an atomic folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_prep.errors import ConfigError
from dflash_prep.formats.fileio import atomic_dir, atomic_write_json, fingerprint_array
from dflash_prep.formats.outputs import check_out, lock
from dflash_prep.synth.profiles import PROFILES, make_lengths

SYNTH_FORMAT = "dflash-prep/synth"
SYNTH_VERSION = 1
CORPUS_FILE = "chat.jsonl"
META_FILE = "synth.json"
POOL_CHARS = 1 << 20  # 1 MiB of distinct text per seed; slices of it make every message

_WORDS = (
    "the of and to in is that it for on with as was be by this are from at or an have not which "
    "but they their one all can more has been when will would there what about if into so its some "
    "model data batch token length sample training step gradient loss learning rate epoch shuffle "
    "bucket budget padding attention layer kernel memory cache tensor shape value function return "
    "file folder path error result output input query answer question example simple fast slow "
    "small large first last every each other same different better worse because however also then "
    "use make find read write check compute measure compare split merge sort count build run test "
    "python numpy array list dict string integer float index range loop while class method module "
    "user assistant system message reply explain describe show think note remember consider"
).split()
_CODE = (
    "def {w}(x, y=None):", "    return {w}(x) + {n}", "for i in range({n}):", "    total += values[i] * {n}",
    "if {w} is None:", "    raise ValueError(\"bad {w}\")", "import numpy as np", "x = np.arange({n}).reshape(-1, {m})",
    "$ dflash-prep {w} --n {n}", "with open(\"{w}.txt\") as f:", "    lines = [l.strip() for l in f]",
    "print(f\"{w}: {{len(lines)}}\")", "class {W}:", "    def __init__(self, {w}):", "        self.{w} = {w}",
)


def _pool(seed: int) -> str:
    """Plausible ASCII text: prose paragraphs, lists and fenced code, keyed by ``seed``.

    Word choices are drawn in one vectorized call (Zipf weights) and consumed in order, so
    building the ~1 MiB pool takes a fraction of a second.
    """
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x7E47]))
    zipf = 1.0 / np.arange(1, len(_WORDS) + 1)
    stream = iter(rng.choice(len(_WORDS), size=POOL_CHARS // 2, p=zipf / zipf.sum()).tolist())

    def words(k: int) -> list[str]:
        return [_WORDS[next(stream)] for _ in range(k)]

    out: list[str] = []
    size = 0
    while size < POOL_CHARS:
        kind = rng.random()
        if kind < 0.7:  # a prose paragraph
            sents = []
            for _ in range(int(rng.integers(2, 7))):
                ws = words(int(rng.integers(5, 18)))
                if rng.random() < 0.3:
                    ws.insert(int(rng.integers(1, len(ws))), str(int(rng.integers(2, 9000))))
                if rng.random() < 0.25:
                    ws[int(rng.integers(0, len(ws) - 1))] += ","
                s = " ".join(ws)
                sents.append(s[0].upper() + s[1:] + ".?!:."[int(rng.integers(0, 5))])
            block = " ".join(sents)
        elif kind < 0.85:  # a markdown list
            items = [" ".join(words(int(rng.integers(3, 9)))) for _ in range(int(rng.integers(2, 6)))]
            block = "\n".join(f"{j + 1}. {it}" if rng.random() < 0.5 else f"- {it}" for j, it in enumerate(items))
        else:  # fenced code
            lines = []
            for _ in range(int(rng.integers(2, 9))):
                w = words(1)[0]
                n, m = int(rng.integers(1, 1000)), int(rng.integers(2, 17))
                lines.append(_CODE[int(rng.integers(len(_CODE)))].format(w=w, W=w.capitalize(), n=n, m=m))
            block = "```python\n" + "\n".join(lines) + "\n```"
        out.append(block)
        size += len(block) + 2
    return "\n\n".join(out)


def _overhead(role: str) -> int:
    """Byte-level tokens the built-in ChatML layout adds around one message."""
    return 1 + len(role) + 1 + 1 + 1  # <|im_start|> role \n ... <|im_end|> \n


@dataclass(frozen=True)
class SynthConfig:
    """What ``synth`` writes.

    Attributes:
        out: output folder (``chat.jsonl`` + ``synth.json``).
        profile: a length profile from :mod:`dflash_prep.synth.profiles` (default ``seedlike``).
        n: number of conversations.
        seed: keys the lengths, the text pool and every slice.
        overwrite: replace an existing folder.
    """

    out: Path
    profile: str = "seedlike"
    n: int = 10_000
    seed: int = 0
    overwrite: bool = False

    def __post_init__(self):
        if self.profile not in PROFILES:
            raise ConfigError(f"unknown --profile {self.profile!r}; choose one of {', '.join(PROFILES)}")
        if self.n < 1:
            raise ConfigError(f"--n must be at least 1, got {self.n}")
        if self.seed < 0:  # numpy's SeedSequence keys on the whole non-negative value, any size
            raise ConfigError(f"--seed must be >= 0, got {self.seed}")


MIN_TARGET = 2 * 1 + _overhead("user") + _overhead("assistant")  # one pair, one char each


def conversation(length: int, rng: np.random.Generator, pool: str) -> list[dict]:
    """One conversation whose byte-level ChatML rendering is exactly ``length`` tokens."""
    if length < MIN_TARGET:
        raise ConfigError(f"a {length}-token conversation is shorter than the smallest chat ({MIN_TARGET} tokens)")
    pairs = int(np.clip(1 + rng.poisson(length / 900.0), 1, 8))
    while pairs > 1 and length < pairs * (2 + _overhead("user") + _overhead("assistant")) + 60:
        pairs -= 1
    roles = ["user", "assistant"] * pairs
    if length > 400 and rng.random() < 0.3:
        roles.insert(0, "system")
    chars = length - sum(_overhead(r) for r in roles)
    weights = np.array([{"system": 0.5, "user": 1.0, "assistant": 2.5}[r] for r in roles]) * rng.uniform(0.5, 1.5, len(roles))
    share = np.floor(weights / weights.sum() * (chars - len(roles))).astype(np.int64) + 1
    share[-1] += chars - int(share.sum())  # exact total; every message keeps >= 1 char
    msgs = []
    for role, k in zip(roles, share.tolist()):
        start = int(rng.integers(0, len(pool) - k))
        sp = pool.find(" ", start, start + 40)  # begin on a word where one is near
        start = sp + 1 if 0 <= sp < len(pool) - k else start
        msgs.append({"role": role, "content": pool[start:start + k]})
    return msgs


def synth(cfg: SynthConfig, *, progress=None) -> dict:
    """Write the corpus; return the summary that ``synth.json`` records."""
    lengths = make_lengths(cfg.profile, cfg.n, cfg.seed)
    pool = _pool(cfg.seed)
    if len(pool) < int(lengths.max()) + 64:
        raise ConfigError("the text pool is shorter than the longest sample; raise POOL_CHARS")
    rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, 0xC4A7]))
    turns = 0

    check_out(cfg.out)
    with lock(cfg.out), atomic_dir(cfg.out, overwrite=cfg.overwrite, marker=(META_FILE, SYNTH_FORMAT)) as tmp:
        with open(tmp / CORPUS_FILE, "w", encoding="utf-8") as f:
            for i, L in enumerate(lengths.tolist()):
                msgs = conversation(max(L, MIN_TARGET), rng, pool)
                turns += len(msgs)
                f.write(json.dumps({"messages": msgs}, ensure_ascii=True))
                f.write("\n")
                if progress is not None and (i + 1) % 4096 == 0:
                    progress(4096)
            if progress is not None:
                progress(len(lengths) % 4096)
        summary = {
            "profile": cfg.profile, "n": cfg.n, "seed": cfg.seed, "file": CORPUS_FILE,
            "lengths_fingerprint": fingerprint_array(np.maximum(lengths, MIN_TARGET).astype(np.int32)),
            "target_tokens": int(np.maximum(lengths, MIN_TARGET).sum(dtype=np.int64)),
            "messages": turns, "tokenizer": "byte", "template": "built-in ChatML",
        }
        atomic_write_json(tmp / META_FILE, summary, format=SYNTH_FORMAT, version=SYNTH_VERSION)
    return summary
