"""Evaluation prompts: the token ids a speculative-decoding evaluation feeds the target.

One rendering for every evaluator, so that they all see the same prompt tokens: our own loop
(:mod:`dflash_prep.train.speculate`) and a serving engine given the ids
(:mod:`dflash_prep.engine.prompts`, vLLM's ``/v1/completions`` with a token-id prompt).
No torch here: the caller passes a tokenizer (transformers ``AutoTokenizer``).

JSONL, one record a line: ``{"messages": [...]}`` (chat: rendered with the tokenizer's chat
template up to, not including, the first assistant turn, with the generation prompt, then
encoded without special tokens: the template already wrote them) or ``{"prompt": "text"}``
(raw text, no template).
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_prep.errors import FormatError


def load_prompts(path: str | Path, tokenizer, *, limit: int = 0) -> list[list[int]]:
    """Prompt token ids from a JSONL file (module docstring); ``limit`` > 0 keeps the first ones."""
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
                msgs = rec["messages"]
                cut = next((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), len(msgs))
                if cut == 0:
                    raise FormatError(f"{path}:{n}: the conversation opens with an assistant turn; no prompt")
                text = tokenizer.apply_chat_template(msgs[:cut], tokenize=False, add_generation_prompt=True)
            elif isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
                text = rec["prompt"]
            else:
                raise FormatError(f"{path}:{n}: expected {{\"messages\": [...]}} or {{\"prompt\": \"...\"}}")
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if not ids:
                raise FormatError(f"{path}:{n}: the prompt has no tokens")
            prompts.append(list(ids))
            if limit and len(prompts) >= limit:
                break
    if not prompts:
        raise FormatError(f"{path}: no prompts")
    return prompts
