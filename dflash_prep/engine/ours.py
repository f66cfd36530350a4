"""Our own evaluator beside the engine: the same export, prompts and token budget, decoded by
:func:`dflash_prep.train.speculate.evaluate` in this process (torch), and how its acceptance compares
with the engine's counters.

Temperature 0 only (it decodes greedily). Block ``k + 1``, and vLLM's stop rule (``engine_stop``:
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


def evaluate_ours(target: Path, export: Path, prompts_file: Path, *, k: int, max_tokens: int, max_prompts: int,
                  temperature: float, total: SpecCounters, per_prompt: list[dict]) -> dict:
    """Our evaluator on ``prompts_file`` (module docstring) against the engine's run on the same
    prompts: ``total`` its counters' delta, ``per_prompt`` its rows (each gains ``tau_ours`` and
    ``blocks_ours``); the report's ``ours`` section."""
    if temperature != 0:
        return {"skipped": "temperature > 0: our evaluator decodes greedily"}
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
            r = evaluate(target, export, prompts_file,
                         EvalConfig(max_new_tokens=max_tokens, max_prompts=max_prompts, block_size=k + 1,
                                    engine_stop=True))
    finally:
        torch.set_num_threads(threads)
        if bars:
            hf_logging.enable_progress_bar()
    ours_rows = r["per_prompt"]
    if not r["blocks"]:     # nothing drafted (every prompt done at its first token): no tau, as vLLM's counters
        r = {**r, "tau": None, "tau_pooled": None}
    tau_v, pooled = total.tau, r["tau_pooled"]
    rel = abs(tau_v - pooled) / pooled if tau_v is not None and pooled is not None else None
    differ = [{"prompt": i, "vllm": [p["num_drafts"], p["num_accepted_tokens"], p["new_tokens_spec"]],
               "ours": [len(o["acceptance_lengths"]), sum(o["acceptance_lengths"]) - len(o["acceptance_lengths"]),
                        o["new_tokens"]]}
              for i, (o, p) in enumerate(zip(ours_rows, per_prompt))
              if [len(o["acceptance_lengths"]), sum(o["acceptance_lengths"]) - len(o["acceptance_lengths"])]
              != [p["num_drafts"], p["num_accepted_tokens"]]]
    same_blocks = len(per_prompt) - len(differ)
    same_length = sum(o["new_tokens"] == p["new_tokens_spec"] for o, p in zip(ours_rows, per_prompt))
    for o, p in zip(ours_rows, per_prompt):
        p["tau_ours"] = o["tau"]
        p["blocks_ours"] = len(o["acceptance_lengths"])
    return {"tau": r["tau"], "tau_pooled": pooled, "blocks": r["blocks"], "lossless": r["lossless"],
            "proposer": r["drafter"]["proposer"], "block_size": r["block_size"], "stop_rule": "engine",
            "rel_diff": rel, "agree": rel is not None and rel <= AGREE_REL,
            "prompts_same_acceptance": same_blocks, "prompts_same_length": same_length, "of": len(per_prompt),
            "differing_prompts": differ}
