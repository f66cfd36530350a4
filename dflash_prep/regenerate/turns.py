"""Which turns ``regenerate`` asks the target for, and how an answer becomes an output record.

- :func:`to_conversation` validates a record (``messages``, ``sharegpt`` or ``text``); unlike
  ``tokenize`` it needs a user prompt, not an assistant answer.
- :func:`slots`: every assistant message, plus one at the end when the conversation ends
  with a user or tool message. ``--turns all`` fills them in order; ``last`` only the last.
- :class:`Conversation` builds each request's context (the conversation up to the slot,
  earlier slots regenerated, or original with ``--keep-assistant``) and turns the replies
  into one ``chat.jsonl`` record with its provenance; each turn names the server that wrote it
  (software and version, as the record's ``target.server``; null for the in-process engine), since
  after a failover the turns of one conversation may come from different servers.
- :func:`apply_reasoning` maps ``--reasoning keep|strip|disable`` onto the reply text.
"""

from __future__ import annotations

import json
import re

from dflash_prep.regenerate.engines import FAILURE_KINDS, Reply, Request, RequestFailed, request_seed
from dflash_prep.regenerate.store import Entry
from dflash_prep.tokenize import records as rec

_THINK_BLOCK = re.compile(r"<think>.*?</think>\s*", re.S)


def to_conversation(record: dict, schema: str, fields: tuple[str, ...] = ("text",)) -> list[dict]:
    """Validate one record (a dict of its source's ``fields``) as a conversation to answer;
    raises ValueError with the reason. Reads every input format ``tokenize`` reads, through the
    same :func:`dflash_prep.tokenize.records.to_messages`; a ``text`` record is one user prompt."""
    if schema == "text":
        return [{"role": "user", "content": rec.to_text(record.get(fields[0]), fields[0])}]
    out = [{"role": m["role"], "content": m["content"]} for m in rec.to_messages(record, schema, fields)]
    if not any(m["role"] == "user" and m["content"].strip() for m in out):
        raise ValueError("no non-empty user message, so no prompt to answer")
    return out


def slots(messages: list[dict], turns: str) -> tuple[list[dict], list[int]]:
    """(messages with a placeholder answer appended if the last message awaits one, slot indices)."""
    out = [dict(m) for m in messages]
    if out[-1]["role"] in ("user", "tool"):
        out.append({"role": "assistant", "content": None})
    idx = [i for i, m in enumerate(out) if m["role"] == "assistant" and i > 0]
    if not idx:
        raise ValueError("no assistant turn to write (the conversation opens with its only assistant message)")
    return out, idx if turns == "all" else idx[-1:]


def apply_reasoning(reply: Reply, mode: str) -> tuple[str, int]:
    """(content to store, characters of reasoning removed) under ``--reasoning mode``."""
    content, sep = reply.content, reply.reasoning or ""
    if mode == "keep":
        if sep.strip():
            content = f"<think>\n{sep.strip()}\n</think>\n\n{content.lstrip()}"
        return content, 0
    kept = _THINK_BLOCK.sub("", content)
    if "</think>" in kept:  # the template opened the block in the prompt: all before it is reasoning
        kept = kept.split("</think>", 1)[1]
    if "<think>" in kept:  # cut by --max-tokens inside a block
        kept = kept[:kept.index("<think>")]
    removed = len(content) - len(kept) + len(sep)
    return (kept.lstrip() if removed else kept), removed


class Conversation:
    """One input record being answered, slot by slot."""

    def __init__(self, cfg, index: int, source: dict, where: str, messages: list[dict]):
        self.cfg, self.index, self.source, self.where = cfg, index, source, where
        self.original = messages
        self.out, self.slots = slots(messages, cfg.turns)
        self.pos = 0
        self.turns: list[dict] = []

    @property
    def pending(self) -> bool:
        return self.pos < len(self.slots)

    def request(self) -> Request:
        s = self.slots[self.pos]
        ctx = self.original if self.cfg.keep_assistant else self.out
        return Request([{"role": m["role"], "content": m["content"]} for m in ctx[:s]],
                       request_seed(self.cfg.sampling.seed, self.index, s),
                       False if self.cfg.reasoning == "disable" else None)

    def what(self) -> str:
        return f"{self.where} message {self.slots[self.pos]}"

    def accept(self, reply: Reply) -> None:
        s = self.slots[self.pos]
        content, removed = apply_reasoning(reply, self.cfg.reasoning)
        if not content.strip():
            why = f" after removing {removed} characters of reasoning" if removed else ""
            raise RequestFailed("empty", f"{self.what()}: the target's answer is empty{why} (finish_reason "
                                         f"{reply.finish_reason}); raise --max-tokens or use --reasoning keep")
        self.out[s]["content"] = content
        self.turns.append({"message": s, "finish_reason": reply.finish_reason,
                           "truncated": reply.finish_reason == "length", "prompt_tokens": reply.prompt_tokens,
                           "completion_tokens": reply.completion_tokens, "seed": self.request_seed(s),
                           "reasoning_removed_chars": removed, "server": reply.server})
        self.pos += 1

    def request_seed(self, s: int) -> int | None:
        return request_seed(self.cfg.sampling.seed, self.index, s)

    def entry(self, target: dict) -> Entry:
        cfg = self.cfg
        record = {"messages": self.out, "regenerate": {
            "record": self.index, "source": self.source, "target": target, "sampling": cfg.sampling.record(),
            "reasoning": cfg.reasoning, "turns_mode": cfg.turns, "keep_assistant": cfg.keep_assistant,
            "turns": self.turns}}
        tok = [(t["prompt_tokens"] or 0, t["completion_tokens"] or 0) for t in self.turns]
        return Entry((json.dumps(record, ensure_ascii=False) + "\n").encode(), None, 0, turns=len(self.turns),
                     truncated=sum(t["truncated"] for t in self.turns), prompt_tokens=sum(p for p, _ in tok),
                     completion_tokens=sum(c for _, c in tok))


def failure_entry(index: int, source: dict, kind: str, message: str) -> Entry:
    line = json.dumps({"record": index, "source": source, "kind": kind, "message": message}, ensure_ascii=False)
    return Entry(None, (line + "\n").encode(), 1 + FAILURE_KINDS.index(kind))
