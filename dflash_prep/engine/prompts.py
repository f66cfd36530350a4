"""The prompt token ids an engine evaluation sends, rendered by the same function our evaluator uses.

:func:`dflash_prep.train.prompts.load_prompts`: the target's chat template up to the first assistant
turn, encoded without special tokens. The ids go to vLLM on ``/v1/completions``, so that vLLM and our
evaluator see the same prompt tokens by construction; vLLM echoes them (``return_token_ids``) and the
report checks it. The chat endpoint would render the template again, with vLLM's transformers and
its defaults. The tokenizer is loaded once (:func:`target_tokenizer`) for any number of prompt files
(:func:`render_prompts` each).
"""

from __future__ import annotations

from pathlib import Path

from dflash_prep.errors import FormatError
from dflash_prep.train.prompts import load_prompts


def target_tokenizer(target: Path):
    """The target's tokenizer (transformers ``AutoTokenizer``, local files only); a
    :class:`FormatError` naming the folder when it has none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    except (OSError, ValueError) as e:
        raise FormatError(f"{target}: no tokenizer to render the prompts with ({e})") from None


def render_prompts(tokenizer, prompts_file: Path, limit: int) -> list[list[int]]:
    """The token ids of the first ``limit`` prompts of ``prompts_file`` (0 = all), as our evaluator
    renders them (module docstring)."""
    return load_prompts(prompts_file, tokenizer, limit=limit)
