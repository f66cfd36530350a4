"""Our own evaluator beside the engine: the same export, prompts and token budget, decoded by
:func:`dflash_prep.train.speculate.evaluate` in this process (torch), and how its acceptance compares
with the engine's counters.

One :func:`decode_ours` per export over every prompt of the run (one model load), then one
:func:`compare_ours` per prompt set on its slice. Temperature 0 only (it decodes greedily). Block ``k + 1``, and vLLM's stop rule (``engine_stop``:
vLLM emits the bonus token with the accepted ones and verifies nothing once ``max_tokens`` are out;
the reference loop our evaluator follows by default verifies one more block when the last one ends
one token short, which on a drafter that is always rejected is one extra block per prompt).
"""

from __future__ import annotations

import os
from pathlib import Path

from dflash_prep.engine.vllm_server import SpecCounters

AGREE_REL = 0.02
"""tau_ours and tau_vllm agree when they differ by at most 2 % of tau_ours."""


def decode_ours(target: Path, export: Path, prompts: list[list[int]], *, k: int, max_tokens: int) -> dict:
    """Our evaluator on the prompt token ids ``prompts`` (module docstring): the result of
    :func:`dflash_prep.train.speculate.evaluate`, one ``per_prompt`` row per prompt in order (each
    with ``acceptance_lengths``, ``new_tokens``, ``tau``, ``lossless``)."""
    import torch
    from transformers.utils import logging as hf_logging

    from dflash_prep.train.speculate import EvalConfig, evaluate

    # the report's table is the output: transformers' per-load "Loading weights" bars are noise here
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    # one decode step at a time on tiny forwards: torch's default (one thread per core) made this
    # 6.5x slower on the 2-core VM (52 s against 8 s for the DFlash demo); $OMP_NUM_THREADS wins
    threads = torch.get_num_threads()
    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(1)
    try:
        with torch.no_grad():
            return evaluate(target, export, None,
                            EvalConfig(max_new_tokens=max_tokens, block_size=k + 1, engine_stop=True),
                            prompt_ids=prompts)
    finally:
        torch.set_num_threads(threads)
        if bars:
            hf_logging.enable_progress_bar()


def compare_ours(r: dict, ours_rows: list[dict], *, total: SpecCounters, per_prompt: list[dict]) -> dict:
    """The report's ``ours`` section for one prompt set: ``ours_rows`` our evaluator's rows on its
    prompts (a slice of :func:`decode_ours`'s ``per_prompt``; ``r`` that result, for the drafter's
    facts), ``total`` the engine's counters' delta over the same prompts, ``per_prompt`` the
    engine's rows (each gains ``tau_ours`` and ``blocks_ours``)."""
    from dflash_prep.train.speculate import summarize

    s = summarize(ours_rows, r["block_size"])
    tau_mean, pooled = (s["tau"], s["tau_pooled"]) if s["blocks"] else (None, None)
    tau_v = total.tau               # nothing drafted (every prompt done at its first token): no tau, as vLLM's counters
    rel = abs(tau_v - pooled) / pooled if tau_v is not None and pooled is not None else None
    drafted = lambda o: [len(o["acceptance_lengths"]), sum(o["acceptance_lengths"]) - len(o["acceptance_lengths"])]  # noqa: E731
    differ = [{"prompt": i, "vllm": [p["num_drafts"], p["num_accepted_tokens"], p["new_tokens_spec"]],
               "ours": [*drafted(o), o["new_tokens"]]}
              for i, (o, p) in enumerate(zip(ours_rows, per_prompt))
              if drafted(o) != [p["num_drafts"], p["num_accepted_tokens"]]]
    same_length = sum(o["new_tokens"] == p["new_tokens_spec"] for o, p in zip(ours_rows, per_prompt))
    for o, p in zip(ours_rows, per_prompt):
        p["tau_ours"] = o["tau"]
        p["blocks_ours"] = len(o["acceptance_lengths"])
    return {"tau": tau_mean, "tau_pooled": pooled, "blocks": s["blocks"],
            "lossless": all(o["lossless"] for o in ours_rows),
            "proposer": r["drafter"]["proposer"], "block_size": r["block_size"], "stop_rule": "engine",
            "rel_diff": rel, "agree": rel is not None and rel <= AGREE_REL,
            "prompts_same_acceptance": len(per_prompt) - len(differ), "prompts_same_length": same_length,
            "of": len(per_prompt), "differing_prompts": differ}
