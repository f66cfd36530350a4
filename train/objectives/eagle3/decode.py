"""EAGLE-3 chain drafting at temperature 0: the drafting half of :mod:`dflash_prep.train.speculate`.

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

The verify/accept loop and the lossless check are :mod:`dflash_prep.train.speculate`'s (its block is
the bonus and K slots; the proposer reads the committed tokens it passes); :func:`load` is the
objective's ``decode`` hook: ``python -m dflash_prep.train.speculate --drafter DIR`` dispatches an
``LlamaForCausalLMEagle3`` folder here (``--block-size K+1`` drafts K tokens; default K = 7).
"""

from __future__ import annotations

import math

import torch

from dflash_prep.errors import ConfigError
from dflash_prep.train.objectives.eagle3.model import Eagle3Drafter, dense_attention

DRAFT_TOKENS = 7
"""Drafted tokens per round by default (SpecForge's TTT length)."""


class Eagle3Proposer:
    """Our drafter reading a :class:`Target`'s taps: chain drafting of the module docstring."""

    def __init__(self, drafter: Eagle3Drafter, *, draft_tokens: int = DRAFT_TOKENS):
        if draft_tokens < 1:
            raise ConfigError(f"--draft-tokens must be >= 1, got {draft_tokens}")
        self.drafter = drafter.eval()
        self.draft_tokens = int(draft_tokens)
        self.block_size = self.draft_tokens + 1  # bonus + drafts: the longest acceptance

    @torch.no_grad()
    def propose(self, block: torch.Tensor, ctx_feats: torch.Tensor, start: int,
                tokens: torch.Tensor | None = None) -> torch.Tensor:
        """:class:`dflash_prep.train.speculate.Proposer`'s call: the chain after the committed
        ``tokens`` ``(start,)`` and the bonus ``block[0]``, from the taps ``ctx_feats`` ``(start, 3*Ht)``."""
        if tokens is None or tokens.shape[0] != start:
            raise ValueError("EAGLE-3 drafts from the committed tokens: pass tokens (start,)")
        return self.chain(torch.cat([tokens.cpu(), block[:1].cpu()]), ctx_feats)

    @torch.no_grad()
    def chain(self, tokens: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """K target ids ``(K,)`` that follow ``tokens`` ``(m + 1,)`` (committed tokens, then the bonus),
        given the target's taps of the committed tokens ``(m, 3*Ht)`` (module docstring)."""
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


def load(drafter_dir, target, *, block_size: int = 0) -> tuple[list, dict]:
    """``([("eagle3", proposer)], meta)`` for the export at ``drafter_dir`` (the shape of a
    ``TrainerSpec.decode`` hook); ``block_size`` B > 0 drafts B - 1 tokens per round, 0 the default
    K = 7. ``meta``: :func:`~.export.load_export`'s with ``block_size`` K + 1, ``hidden_size`` the
    target's width (what a caller checks the target against) and no mask token. The proposer drafts
    from the committed tokens (:meth:`Eagle3Proposer.propose`): run it with :func:`eagle3_generate`,
    not speculate's block loop, whose proposer is given features only."""
    from dflash_prep.train.objectives.eagle3.export import load_export

    drafter, meta = load_export(drafter_dir)
    proposer = Eagle3Proposer(drafter, draft_tokens=block_size - 1 if block_size else DRAFT_TOKENS)
    target.set_layers(meta["target_layer_ids"])
    return [("eagle3", proposer)], {**meta, "block_size": proposer.block_size, "mask_token_id": None,
                                    "drafter_hidden_size": meta["hidden_size"], "hidden_size": meta["target_hidden_size"]}
