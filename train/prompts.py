"""Evaluation prompts: the token ids a speculative-decoding evaluation feeds the target.

One rendering for every evaluator, so that they all see the same prompt tokens: our own loop
(:mod:`dflash_prep.train.speculate`) and a serving engine given the ids
(:mod:`dflash_prep.engine.prompts`, vLLM's ``/v1/completions`` with a token-id prompt).
No torch here: the caller passes a tokenizer (transformers ``AutoTokenizer``).

JSONL, one record a line: ``{"messages": [...]}`` (chat: rendered with the tokenizer's chat
template up to, not including, the first assistant turn, with the generation prompt, then
encoded without special tokens: the template already wrote them) or ``{"prompt": "text"}``
(raw text, no template). ``enable_thinking`` (True/False) is passed to the chat template as the
serving mode's kwarg (``dflash-prep evaluate --thinking``, :mod:`dflash_prep.engine.serving_mode`);
None leaves it out, so the template renders its default.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_prep.errors import FormatError


def render_messages(tokenizer, messages: list[dict], *, enable_thinking: bool | None = None) -> list[int]:
    """The prompt token ids of ``messages`` (every one of them: the caller cuts; a later turn of a
    multi-turn benchmark keeps the earlier answers), rendered with ``tokenizer``'s chat template
    with the generation prompt, then encoded without special tokens (the template wrote them).
    ``enable_thinking`` reaches the template only when not None. No messages, or a conversation
    that opens or ends with an assistant turn, is a :class:`FormatError`."""
    if not messages or messages[0].get("role") == "assistant":
        raise FormatError("the conversation opens with an assistant turn; no prompt")
    if messages[-1].get("role") == "assistant":
        raise FormatError("the conversation ends with an assistant turn; nothing asks for the next answer")
    kwargs = {} if enable_thinking is None else {"enable_thinking": bool(enable_thinking)}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def load_prompts(path: str | Path, tokenizer, *, limit: int = 0, enable_thinking: bool | None = None) -> list[list[int]]:
    """Prompt token ids from a JSONL file (module docstring); ``limit`` > 0 keeps the first ones;
    chat records rendered by :func:`render_messages` with ``enable_thinking``."""
    path = Path(path)
    if not path.is_file():
        raise FormatError(f"{path}: prompts file not found")
    prompts = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise FormatError(f"{path}:{n}: not JSON ({e})") from None
            if isinstance(rec, dict) and isinstance(rec.get("messages"), list):
                msgs = rec["messages"]      # the prompt: up to, not including, the first assistant turn
                cut = next((i for i, m in enumerate(msgs) if isinstance(m, dict) and m.get("role") == "assistant"),
                           len(msgs))
                try:
                    ids = render_messages(tokenizer, msgs[:cut] or msgs[:1], enable_thinking=enable_thinking)
                except FormatError as e:
                    raise FormatError(f"{path}:{n}: {e}") from None
            elif isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
                ids = tokenizer(rec["prompt"], add_special_tokens=False)["input_ids"]
            else:
                raise FormatError(f"{path}:{n}: expected {{\"messages\": [...]}} or {{\"prompt\": \"...\"}}")
            if not ids:
                raise FormatError(f"{path}:{n}: the prompt has no tokens")
            prompts.append(list(ids))
            if limit and len(prompts) >= limit:
                break
    if not prompts:
        raise FormatError(f"{path}: no prompts")
    return prompts
