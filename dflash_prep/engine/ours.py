"""Our own evaluator beside the engine: the same export, prompts and token budget, decoded by
:func:`dflash_prep.train.speculate.evaluate` in this process (torch), and how its acceptance compares
with the engine's counters.

One :func:`decode_ours` per export over every prompt of the run (one model load), then one
:func:`compare_ours` per prompt set on its slice. Temperature 0 only (it decodes greedily). Block ``k + 1``, and vLLM's stop rule (``engine_stop``:
vLLM emits the bonus token with the accepted ones and verifies nothing once ``max_tokens`` are out;
the reference loop our evaluator follows by default verifies one more block when the last one ends
one token short, which on a drafter that is always rejected is one extra block per prompt).

**Off by default on large targets** (:func:`ours_default`): it loads the target in float32 in this
process, on the CPU, and decodes each prompt one block at a time, each block a forward that reads
every weight. Above :data:`OURS_MAX_PARAMETERS` target parameters (counted from the safetensors
headers, nothing loaded: :func:`target_parameters`) it runs only when asked (``--ours``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from dflash_prep.engine.load_check import safetensors_shapes
from dflash_prep.engine.vllm_server import SpecCounters
from dflash_prep.formats.target import read_target_config

AGREE_REL = 0.02
"""tau_ours and tau_vllm agree when they differ by at most 2 % of tau_ours."""
OURS_MAX_PARAMETERS = 1_000_000_000
"""Target parameters above which our evaluator is off unless ``--ours`` asks for it. An estimate,
not a measurement: a block's forward streams every float32 weight from memory, 4 GB at 1 B
parameters, 32 GB for Qwen3-8B; at the ~10 GB/s one CPU core draws, about 0.4 s and 3 s a block. A
default run (4 sets, ``--n 32``, 64 new tokens, tau ~3) decodes ~2,700 blocks per export: ~20 min
at 1 B, over 2 h at 8 B; docs/evaluation.md's Qwen3-8B run (every prompt, 2,048 new tokens) weeks."""


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


def target_parameters(target: Path) -> int:
    """The target's parameter count, read without loading it: the shapes in its ``*.safetensors``
    headers; a folder without safetensors (``.bin`` weights), estimated from its config.json (embedding
    and head, attention with its key/value heads, the MLP times its experts)."""
    shapes = {k: v for f in sorted(Path(target).glob("*.safetensors")) for k, v in safetensors_shapes(f).items()}
    if shapes:
        return sum(math.prod(v) for v in shapes.values())
    c = read_target_config(target)
    h, L, heads, inter, vocab = (int(c[k]) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                     "intermediate_size", "vocab_size"))
    head_dim = int(c.get("head_dim") or h // heads)
    kv = int(c.get("num_key_value_heads") or heads)
    experts = int(c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts") or 1)
    if experts > 1:                                  # a mixture of experts: each expert its own (smaller) MLP
        inter = int(c.get("moe_intermediate_size") or inter)
    attention = h * heads * head_dim * 2 + h * kv * head_dim * 2      # q and o, k and v
    embeddings = vocab * h * (1 if c.get("tie_word_embeddings") else 2)
    return embeddings + L * (attention + 3 * h * inter * experts)


def ours_default(target: Path, requested: bool | None) -> dict:
    """Whether our evaluator runs: ``requested`` (``--ours`` / ``--no-ours``) when given, else on up
    to :data:`OURS_MAX_PARAMETERS` target parameters. The report's ``ours_evaluator`` section: ``on``,
    ``requested``, ``target_parameters``, ``limit`` and ``line`` (what to say when it was turned off,
    None otherwise)."""
    n = target_parameters(target)
    on = requested if requested is not None else n <= OURS_MAX_PARAMETERS
    line = None
    if requested is None and not on:
        line = (f"our evaluator is off: the target has {n / 1e9:.2f} B parameters, over "
                f"{OURS_MAX_PARAMETERS / 1e9:g} B, and it would load it in float32 in this process and decode "
                "every prompt on the CPU; pass --ours to run it anyway")
    return {"on": on, "requested": requested, "target_parameters": n, "limit": OURS_MAX_PARAMETERS, "line": line}
