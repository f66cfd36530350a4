"""No training prompt may come from, or quote, a shipped evaluation set.

A training prompt *overlaps* the evaluation sets when either holds:

- ``contains``: after whitespace normalisation (every run of whitespace becomes one space, ends
  stripped) the prompt equals or contains an evaluation turn (each user turn of every shipped set,
  MT-Bench's second turns included, as upstream wrote it, before any prompt format);
- ``ngram``: the prompt shares a run of :data:`NGRAM` consecutive words with an evaluation turn,
  words being the lower-cased ``\\w+`` runs (so punctuation, case and line breaks do not hide a
  copy). 13 words is the contamination window GPT-3's and later reports use; a shared 13-word run is
  a quotation, not a shared phrase ("how many ... does she have left").

:func:`build_index` hashes every evaluation turn's n-grams once; :meth:`EvalIndex.offence` then
costs one set look-up per n-gram of the prompt and a substring test only against the turns too short
for the n-gram test to see inside a prompt (a text that contains a turn has every n-gram of that
turn's interior words). The 7,923 shipped prompts are checked against the four evaluation sets in
about a second.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from dflash_prep.evalsets.sets import benchmark_names, describe, load_raw

#: Words in a shared run that counts as a quotation.
NGRAM = 13
_WORD = re.compile(r"\w+")
_SPACE = re.compile(r"\s+")


def normalise(text: str) -> str:
    """Whitespace runs become one space; leading and trailing whitespace goes."""
    return _SPACE.sub(" ", text).strip()


def ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    """The runs of ``n`` consecutive lower-cased words of ``text`` (none when it has fewer words)."""
    words = _WORD.findall(text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def _interior_words(turn: str) -> int:
    """Words of a normalised turn without its first and last space-separated token: what any text
    that contains the turn has in the same order (the end tokens may be glued to the text's words)."""
    return len(_WORD.findall(" ".join(turn.split(" ")[1:-1])))


@dataclass(frozen=True)
class EvalIndex:
    """The evaluation turns, normalised, and their n-grams, to test training prompts against."""

    short: tuple[str, ...]
    """The normalised turns with fewer than :data:`NGRAM` interior words, shortest first: a text that
    contains a longer turn shares one of its n-grams, so only these need a substring test."""
    grams: frozenset
    """Every :data:`NGRAM`-word run of every evaluation turn."""

    def offence(self, prompt: str) -> str | None:
        """``"contains"`` (a short turn is inside the normalised prompt), ``"ngram"`` (a shared run of
        :data:`NGRAM` words, which every prompt containing a longer turn has) or None."""
        text = normalise(prompt)
        for turn in self.short:
            if len(turn) > len(text):
                break
            if turn in text:
                return "contains"
        return "ngram" if not self.grams.isdisjoint(ngrams(prompt)) else None


def build_index(turns: list[str]) -> EvalIndex:
    """An index of these evaluation turns (empty turns are left out: every text contains one)."""
    norm = sorted({normalise(t) for t in turns} - {""}, key=lambda t: (len(t), t))
    grams: set = set()
    for t in norm:
        grams |= ngrams(t)
    return EvalIndex(short=tuple(t for t in norm if _interior_words(t) < NGRAM), grams=frozenset(grams))


def eval_turns(*, root: str | Path | None = None) -> tuple[list[str], dict[str, str]]:
    """Every user turn of every shipped evaluation set, unformatted, and each set's ``content_sha256``
    (recorded in the training manifest, so a changed evaluation set shows as a stale check)."""

    turns, hashes = [], {}
    for name in benchmark_names(root=root):
        turns += [t for rec in load_raw(name, root=root) for t in rec["turns"]]
        hashes[name] = describe(name, root=root)["content_sha256"]
    return turns, hashes


def offenders(prompts: list[tuple[str, str]], index: EvalIndex) -> dict[str, str]:
    """``{id: reason}`` for every ``(id, prompt)`` that overlaps the evaluation turns."""
    out = {}
    for id_, text in prompts:
        why = index.offence(text)
        if why:
            out[id_] = why
    return out
