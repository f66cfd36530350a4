"""The prompt sets of one ``dflash-prep evaluate`` run, as the token ids every engine and our
evaluator are sent.

A set is a shipped benchmark (:mod:`dflash_prep.evalsets`: a deterministic sample of ``n`` of its
prompts, already in the benchmark's prompt format) or the user's own ``--prompts FILE`` (its first
``--max-prompts``, named after the file). Every prompt is rendered here, once, by
:func:`dflash_prep.train.prompts.render_messages` (the rendering our evaluator uses), with the
run's ``enable_thinking`` (None: the chat template's default), and sent as token ids, so the
engines and our evaluator see the same tokens by construction.

Multi-turn sets (MT-Bench): the first turns are sent first; the second turn of each conversation is
rendered after the target's **own** first answer, which the engine **without** speculation gives
(:meth:`PromptSet.add_second_turns`). Every drafter is then evaluated on the same second-turn
prompts; at temperature 0 that answer is also what any lossless speculative run decodes.
As published (FastChat's ``gen_model_answer``), that first answer is a **complete** one: a first
answer cut by ``--max-tokens`` (``finish_reason`` "length") is asked again, unmeasured, under its own
cap, :func:`first_answer_cap` (up to :data:`FIRST_ANSWER_TOKENS`, within what ``--max-model-len``
leaves); an answer still cut there is counted (:attr:`PromptSet.first_answers`, in the report's set
facts), since its second turn rests on a fragment (with thinking on, a cut ``<think>``).

``--save-prompts DIR`` writes each set's ids as sent (:func:`save_prompts`): ``DIR/<set>.jsonl``,
one ``{"prompt_token_ids": [...]}`` a line, in the order sent, for replay in another tool.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from dflash_prep.errors import ConfigError
from dflash_prep.evalsets import describe, sample_benchmark
from dflash_prep.formats.fileio import atomic_write_bytes, fingerprint_json

FIRST_ANSWER_TOKENS = 1024
"""The most new tokens a first answer of a multi-turn set may take before its second turn is asked:
FastChat's ``gen_model_answer --max-new-token`` default, under which MT-Bench's published answers
were made (a shorter ``--max-model-len`` lowers it: :func:`first_answer_cap`)."""
REENCODE_SLACK = 2
"""A first answer's ids, decoded to text and rendered into the second turn, may encode to more ids
than were generated; the second-turn bound counts each answer token this many times."""


@dataclass
class PromptSet:
    """One set's prompts: the user turns of each conversation (shipped sets) and the ids sent."""

    name: str
    source: dict
    """Where the prompts come from: ``{"kind": "shipped", ...manifest facts, "n", "of", "seed"}`` or
    ``{"kind": "file", "path", "max_prompts"}``."""
    turns: list[tuple[str, ...]] | None
    """Each conversation's user turns (None for a file: rendered by ``load_prompts``)."""
    ids: list[list[int]] = field(default_factory=list)
    """The prompts sent, in order: every first turn, then (multi-turn sets, once the base run has
    answered them) every second turn."""
    turn_of: list[int] = field(default_factory=list)
    """1 or 2: the turn each prompt of :attr:`ids` asks."""
    first_answers: dict | None = None
    """Multi-turn sets, once :meth:`add_second_turns` ran: ``cap`` (the first answers' own cap),
    ``asked_again`` (first answers cut by ``--max-tokens``, asked again under ``cap``) and
    ``truncated`` (second turns resting on an answer still cut at ``cap``)."""

    @property
    def multi_turn(self) -> bool:
        return self.turns is not None and any(len(t) > 1 for t in self.turns)

    def first_turn_count(self) -> int:
        return sum(1 for t in self.turn_of if t == 1)

    def add_second_turns(self, tokenizer, answers: list[list[int]], enable_thinking: bool | None, *,
                         cap: int = 0, truncated: list[bool] | None = None, asked_again: int = 0) -> list[list[int]]:
        """Render every second turn after the target's own first answer (``answers``: the new token
        ids of each first-turn prompt, in order), append them to :attr:`ids`; the new prompts.
        ``truncated`` (per answer: its ``finish_reason`` was "length"), ``cap`` and ``asked_again``
        are recorded in :attr:`first_answers`."""
        from dflash_prep.train.prompts import render_messages

        if not self.multi_turn:
            return []
        if len(answers) != len(self.turns):
            raise ValueError(f"{self.name}: {len(answers)} first answers for {len(self.turns)} conversations")
        cut = truncated or [False] * len(answers)
        new, on_cut = [], 0
        for turns, answer, was_cut in zip(self.turns, answers, cut):
            if len(turns) < 2:
                continue
            text = tokenizer.decode(answer, skip_special_tokens=True)
            msgs = [{"role": "user", "content": turns[0]}, {"role": "assistant", "content": text},
                    {"role": "user", "content": turns[1]}]
            new.append(render_messages(tokenizer, msgs, enable_thinking=enable_thinking))
            on_cut += bool(was_cut)
        self.ids += new
        self.turn_of += [2] * len(new)
        self.first_answers = {"cap": cap, "asked_again": asked_again, "truncated": on_cut, "of": len(new)}
        return new

    def second_turn_floor(self, tokenizer, enable_thinking: bool | None) -> int:
        """The longest second-turn prompt rendered around an empty first answer (0: no second turn):
        what a second turn is known to need before any answer exists."""
        from dflash_prep.train.prompts import render_messages

        floor = 0
        for turns in (self.turns or []):
            if len(turns) > 1:
                msgs = [{"role": "user", "content": turns[0]}, {"role": "assistant", "content": ""},
                        {"role": "user", "content": turns[1]}]
                floor = max(floor, len(render_messages(tokenizer, msgs, enable_thinking=enable_thinking)))
        return floor

    def facts(self) -> dict:
        """The report's record of the set."""
        return {"name": self.name, **self.source, "prompts": len(self.ids),
                "conversations": len(self.turns) if self.turns is not None else len(self.ids),
                "turns": max(self.turn_of, default=1),
                **({"first_answers": dict(self.first_answers)} if self.first_answers is not None else {}),
                "tokens_fingerprint": fingerprint_json(self.ids),
                "prompt_tokens": {"min": min(map(len, self.ids)), "max": max(map(len, self.ids)),
                                  "mean": round(sum(map(len, self.ids)) / len(self.ids), 1)} if self.ids else None}


def first_answer_cap(model_len: int, floor: int, max_tokens: int, margin: int, most: int = FIRST_ANSWER_TOKENS) -> int:
    """The new tokens a first answer of a multi-turn set may take: ``most`` (``--first-answer-tokens``), or
    less where ``model_len`` would not hold its second turn: the prompt around an empty answer
    (``floor``), the answer counted :data:`REENCODE_SLACK` times, ``max_tokens`` and ``margin`` (the
    most tokens a step drafts, plus its bonus). Below ``max_tokens`` even a measured answer may not
    fit: that is the caller's refusal to make."""
    return min(most, (model_len - floor - max_tokens - margin) // REENCODE_SLACK)


def shipped_set(name: str, tokenizer, *, n: int, seed: int, enable_thinking: bool | None) -> PromptSet:
    """A shipped benchmark's sample of ``n`` (0: all), first turns rendered."""
    from dflash_prep.train.prompts import render_messages

    items = sample_benchmark(name, n, seed)
    d = describe(name)
    src = d.get("source") or {}
    source = {"kind": "shipped", "n": len(items), "of": d["count"], "seed": seed, "license": d.get("license"),
              "repo": src.get("repo"), "path": src.get("path"), "commit": src.get("commit"),
              "ids": [it.id for it in items]}
    ps = PromptSet(name=name, source=source, turns=[tuple(it.turns) for it in items])
    ps.ids = [render_messages(tokenizer, [{"role": "user", "content": it.turns[0]}], enable_thinking=enable_thinking)
              for it in items]
    ps.turn_of = [1] * len(ps.ids)
    return ps


def file_set(path: Path, tokenizer, *, limit: int, enable_thinking: bool | None) -> PromptSet:
    """The user's own prompts file (its first ``limit``; 0: all), named after the file."""
    from dflash_prep.train.prompts import load_prompts

    ids = load_prompts(path, tokenizer, limit=limit, enable_thinking=enable_thinking)
    return PromptSet(name=Path(path).stem, source={"kind": "file", "path": str(path), "max_prompts": limit},
                     turns=None, ids=ids, turn_of=[1] * len(ids))


def build_sets(tokenizer, *, benches: list[str], prompts: Path | None, n: int, max_prompts: int, seed: int,
               enable_thinking: bool | None) -> list[PromptSet]:
    """The run's sets, in the order given: the benchmarks, then the file; names must differ."""
    sets = [shipped_set(b, tokenizer, n=n, seed=seed, enable_thinking=enable_thinking) for b in benches]
    if prompts is not None:
        sets.append(file_set(prompts, tokenizer, limit=max_prompts, enable_thinking=enable_thinking))
    if not sets:
        raise ConfigError("nothing to evaluate: pass --bench NAMES (shipped sets) and/or --prompts FILE")
    names = [s.name for s in sets]
    dup = sorted({x for x in names if names.count(x) > 1})
    if dup:
        raise ConfigError(f"two prompt sets named {dup[0]!r}: rename the --prompts file (sets are named after it)")
    return sets


def save_prompts(sets: list[PromptSet], folder: Path) -> list[Path]:
    """``folder/<set>.jsonl`` per set (module docstring), each written atomically; the paths."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for s in sets:
        p = folder / f"{s.name}.jsonl"
        atomic_write_bytes(p, "".join(json.dumps({"prompt_token_ids": ids}, separators=(",", ":")) + "\n"
                                      for ids in s.ids).encode())
        out.append(p)
    return out
