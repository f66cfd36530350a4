"""EAGLE-3 chain drafting at temperature 0: mean acceptance length of a drafter on held-out prompts.

One prompt at a time, on :class:`dflash_prep.train.speculate.Target` (KV cache, taps
``cat(hidden_states[l + 1] for l in target_layer_ids)``: the outputs of the tapped layers, the
drafter's ``taps``)::

    prefill   the target runs the prompt x[0, n): its argmax after x[n-1] is the bonus b = x[n];
              the taps of the prompt are F[0, n)
    repeat    m = committed tokens (prompt included), x[m] = b
      draft   the drafter's step 0 over rows 0..m-1 (hidden fc(F[t]), token x[t+1], RoPE position t,
              causal): row m-1 gives d_1 = argmax, mapped to a target id through d2t; then for
              j = 1..K-1 one query at RoPE position m-1+j with hidden = the previous pre-norm output
              and token d_j, attending to the step-0 keys of rows 0..m-1 and the chain's keys so far:
              d_{j+1}. This is TTT step j at row m-1 fed its own drafts (the training forward of
              :mod:`.model` with ground truth replaced by drafts; tested).
      verify  one target forward over [b, d_1 .. d_K] at positions m..m+K gives p_i = argmax after
              [b, d_1 .. d_i]
      accept  a = length of the prefix of d that matches p[0 .. K-1]; [b, d_1 .. d_a] are committed,
              p_a is the next bonus; the acceptance length is a + 1 (1..K+1); the target's cache is
              cut back to m + a + 1 and its taps of the committed tokens join F
    stop      as :mod:`dflash_prep.train.speculate`: after a round whose committed tokens or next
              bonus hold a stop token, or once max_new_tokens are committed; the output (committed
              + the last bonus) is cut after its first stop token and at max_new_tokens

Every committed token is the target's argmax given everything before it, so the output equals the
target's greedy decoding (:func:`~dflash_prep.train.speculate.greedy_generate`; the tests check it).
Work: the drafter's step 0 is recomputed over the whole context each round (O(m); the engines keep a
draft KV cache of the same keys, which depend only on the taps, tokens and positions).

:func:`evaluate` is :func:`dflash_prep.train.speculate.evaluate`'s counterpart for an exported
EAGLE-3 folder (:mod:`.export`): same prompts file, same result layout (format
``dflash-prep/speculate-eval`` v1) with ``method: eagle3`` and ``draft_tokens`` K; its ``block_size``
is K + 1 (the longest acceptance, as the histogram counts 1..K+1). :func:`load` is the drafting half
in the shape of an objective's ``decode`` hook.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import torch

from dflash_prep.errors import ConfigError
from dflash_prep.train.speculate import (EVAL_FORMAT, EVAL_VERSION, Decoded, Target, greedy_generate, load_prompts,
                                         summarize)

from .model import Eagle3Drafter, dense_attention

DRAFT_TOKENS = 7
"""Drafted tokens per round by default (SpecForge's TTT length)."""


class ChainProposer(Protocol):
    draft_tokens: int

    def propose(self, tokens: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """K target ids ``(K,)`` that follow ``tokens`` ``(m + 1,)`` (committed tokens, then the bonus),
        given the target's taps of the committed tokens ``(m, 3*Ht)``."""


class Eagle3Proposer:
    """Our drafter reading a :class:`Target`'s taps: chain drafting of the module docstring."""

    def __init__(self, drafter: Eagle3Drafter, *, draft_tokens: int = DRAFT_TOKENS):
        if draft_tokens < 1:
            raise ConfigError(f"--draft-tokens must be >= 1, got {draft_tokens}")
        self.drafter = drafter.eval()
        self.draft_tokens = int(draft_tokens)
        self.block_size = self.draft_tokens + 1  # bonus + drafts: the longest acceptance

    @torch.no_grad()
    def propose(self, tokens: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        d = self.drafter
        mid, c = d.midlayer, d.config
        dev = d.fc.weight.device
        m = feats.shape[0]
        tokens, feats = tokens.to(dev), feats.to(dev, d.fc.weight.dtype)
        scale = 1.0 / math.sqrt(c.head_dim)
        h = d.fc(feats)  # (m, H)
        q, k, v = mid.qkv(d.embed_tokens(tokens[1:m + 1]).to(h.dtype), h,
                          *d.rope(torch.arange(m, device=dev), h.dtype))  # step-0 keys of rows 0..m-1
        ks, vs = [k], [v]
        h = mid.finish(h[-1:], dense_attention(q[-1:], k, v, scale))  # (1, H): row m-1 sees rows 0..m-1
        out = [int(d.to_target_ids(d.logits(h).argmax(-1))[0])]
        for j in range(1, self.draft_tokens):  # TTT step j at row m-1: RoPE m-1+j, its own earlier keys
            e = d.embed_tokens(torch.tensor([out[-1]], device=dev)).to(h.dtype)
            q, k, v = mid.qkv(e, h, *d.rope(torch.tensor([m - 1 + j], device=dev), h.dtype))
            ks, vs = ks + [k], vs + [v]
            h = mid.finish(h, dense_attention(q, torch.cat(ks), torch.cat(vs), scale))
            out.append(int(d.to_target_ids(d.logits(h).argmax(-1))[0]))
        return torch.tensor(out, dtype=torch.long)


def load(drafter_dir, target: Target, *, block_size: int = 0) -> tuple[list, dict]:
    """``([("eagle3", proposer)], meta)`` for the export at ``drafter_dir`` (the shape of a
    ``TrainerSpec.decode`` hook); ``block_size`` B > 0 drafts B - 1 tokens per round, 0 the default
    K = 7. ``meta``: :func:`~.export.load_export`'s with ``block_size`` K + 1, ``hidden_size`` the
    target's width (what a caller checks the target against) and no mask token. The proposer drafts
    from the committed tokens (:meth:`Eagle3Proposer.propose`): run it with :func:`eagle3_generate`,
    not speculate's block loop, whose proposer is given features only."""
    from .export import load_export

    drafter, meta = load_export(drafter_dir)
    proposer = Eagle3Proposer(drafter, draft_tokens=block_size - 1 if block_size else DRAFT_TOKENS)
    target.set_layers(meta["target_layer_ids"])
    return [("eagle3", proposer)], {**meta, "block_size": proposer.block_size, "mask_token_id": None,
                                    "drafter_hidden_size": meta["hidden_size"], "hidden_size": meta["target_hidden_size"]}


def _cut(tokens: list[int], stop_ids: set[int], max_new: int) -> list[int]:
    """The first ``max_new`` tokens, cut after the first stop token (speculate's rule)."""
    tokens = tokens[:max_new]
    return next((tokens[:i + 1] for i, t in enumerate(tokens) if t in stop_ids), tokens)


@torch.no_grad()
def eagle3_generate(target: Target, proposer: ChainProposer, prompt: list[int], *, max_new_tokens: int,
                    stop_ids: set[int]) -> Decoded:
    """The loop of the module docstring for one prompt (temperature 0); ``acceptance_lengths`` 1..K+1."""
    t0 = time.perf_counter()
    target.reset()
    committed = list(prompt)
    logits, feats = target.forward(torch.tensor(prompt, dtype=torch.long), 0)
    bonus = int(logits[-1].argmax())
    out: list[int] = []
    acc: list[int] = []
    while len(out) < max_new_tokens:
        m = len(committed)
        drafts = proposer.propose(torch.tensor(committed + [bonus], dtype=torch.long), feats).cpu()  # (K,)
        block = torch.cat([torch.tensor([bonus]), drafts])  # (K+1,)
        logits, f = target.forward(block, m)
        post = logits.argmax(-1).cpu()  # (K+1,) the target's argmax after block[:i+1]
        a = int((drafts == post[:-1]).to(torch.int64).cumprod(0).sum())
        acc.append(a + 1)
        new = [int(t) for t in block[:a + 1]]
        committed += new
        out += new
        bonus = int(post[a])
        target.crop(m + a + 1)
        feats = torch.cat([feats, f[:a + 1]])
        if any(t in stop_ids for t in new) or bonus in stop_ids:
            break
    out.append(bonus)
    return Decoded(_cut(out, stop_ids, max_new_tokens), acc, time.perf_counter() - t0)


@dataclass(frozen=True)
class Eagle3EvalConfig:
    """One acceptance evaluation (temperature 0)."""

    max_new_tokens: int = 128
    """New tokens per prompt, at most."""
    max_prompts: int = 0
    """Evaluate the first N prompts (0 = all)."""
    draft_tokens: int = DRAFT_TOKENS
    """K: tokens drafted per round (one drafter step each)."""
    check_lossless: bool = True
    """Also decode each prompt with the target alone and compare token for token."""

    def __post_init__(self):
        if self.max_new_tokens < 1 or self.draft_tokens < 1 or self.max_prompts < 0:
            raise ConfigError("--max-new-tokens and --draft-tokens must be >= 1, --max-prompts >= 0")


def evaluate(target_dir: str | Path, drafter_dir: str | Path, prompts_file: str | Path,
             cfg: Eagle3EvalConfig = Eagle3EvalConfig()) -> dict:
    """Chain drafting of every prompt with the exported drafter; the result dict (module docstring;
    keys as :func:`dflash_prep.train.speculate.evaluate`'s). Refuses a target of another shape, or,
    when the export records it, another target fingerprint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_prep.train.objectives.dflash.export import folder_fingerprint
    from dflash_prep.train.target import target_identity

    from .export import load_export

    drafter, meta = load_export(drafter_dir)
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    c = model.config
    if (int(c.hidden_size), int(c.vocab_size)) != (meta["target_hidden_size"], meta["vocab_size"]):
        raise ConfigError(f"{drafter_dir}: the drafter was built for hidden {meta['target_hidden_size']} / vocab "
                          f"{meta['vocab_size']}, the target {target_dir} has {c.hidden_size} / {c.vocab_size}; pass "
                          "the target it was trained on")
    ident = target_identity(target_dir, tok)
    source = (meta.get("export") or {}).get("source") or {}
    want = source.get("target_fingerprint") or ((source.get("run_key") or {}).get("contract") or {}).get(
        "target_fingerprint")
    if want and want != ident["target_fingerprint"]:
        raise ConfigError(f"{drafter_dir} was trained on target {want}, but {target_dir} is "
                          f"{ident['target_fingerprint']}; pass the target folder the drafter was trained on")
    target = Target(model, meta["target_layer_ids"])
    proposer = Eagle3Proposer(drafter, draft_tokens=cfg.draft_tokens)
    stop = {int(tok.eos_token_id)} if tok.eos_token_id is not None else set()
    prompts = load_prompts(prompts_file, tok, limit=cfg.max_prompts)
    rows, t_spec, t_greedy = [], 0.0, 0.0
    for p in prompts:
        d = eagle3_generate(target, proposer, p, max_new_tokens=cfg.max_new_tokens, stop_ids=stop)
        t_spec += d.seconds
        row = {"prompt_tokens": len(p), "new_tokens": len(d.tokens), "acceptance_lengths": d.acceptance_lengths,
               "tau": sum(d.acceptance_lengths) / max(len(d.acceptance_lengths), 1), "lossless": None,
               "first_mismatch": None}
        if cfg.check_lossless:
            g = greedy_generate(target, p, max_new_tokens=cfg.max_new_tokens, stop_ids=stop)
            t_greedy += g.seconds
            row["lossless"] = g.tokens == d.tokens
            if not row["lossless"]:
                row["first_mismatch"] = next((i for i, (x, y) in enumerate(zip(g.tokens, d.tokens)) if x != y),
                                             min(len(g.tokens), len(d.tokens)))
        rows.append(row)
    K = cfg.draft_tokens
    return {"format": EVAL_FORMAT, "version": EVAL_VERSION, "method": "eagle3",
            "target": {"path": str(target_dir), **ident},
            "drafter": {"path": str(drafter_dir), "fingerprint": folder_fingerprint(drafter_dir)},
            "prompts": {"path": str(prompts_file), "n": len(prompts)},
            "draft_tokens": K, "block_size": K + 1, "temperature": 0.0, "max_new_tokens": cfg.max_new_tokens,
            **summarize(rows, K + 1),
            "lossless": all(r["lossless"] for r in rows) if cfg.check_lossless else None,
            "new_tokens": sum(r["new_tokens"] for r in rows),
            "seconds_spec": round(t_spec, 3), "seconds_greedy": round(t_greedy, 3),
            "config": asdict(cfg), "per_prompt": rows}
