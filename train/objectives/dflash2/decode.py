"""Speculative decoding with a DFlash2 export: the drafting half (:mod:`dflash_prep.train.speculate`
runs the loop, verifies and counts acceptance).

:func:`load` offers two proposers on the same drafter forward:

- ``selector`` (:class:`SelectorProposer`, the DFlash2 proposal): the block's final hidden
  states from DFlash's packed forward (:class:`~dflash_prep.train.objectives.dflash.decode.DFlashProposer`),
  the unary logits = the target head on slots 1..B-1 (scaled, then softcapped, when the
  folder's config says so: z-lab's order), their top K (``selector_top_k``; value descending,
  token id ascending), the candidate selector's lattice, and the greedy walk from the verified
  anchor (slot 0, the bonus token), lowest candidate index on ties
  (:func:`~dflash_prep.train.objectives.dflash2.selector.greedy_walk`);
- ``no_selector``: the plain per-slot argmax of the target head on the same hidden states
  (what DFlash proposes; the selector's lift is the difference between the two).

The verify step makes both lossless whatever they propose.
"""

from __future__ import annotations

import torch

from dflash_prep.errors import ConfigError
from dflash_prep.train.objectives.dflash.decode import DFlashProposer
from dflash_prep.train.objectives.dflash2.selector import greedy_walk, transform_logits, unary_topk

META_KEYS = ("block_size", "mask_token_id", "target_layer_ids", "hidden_size", "vocab_size", "export")


class SelectorProposer(DFlashProposer):
    """A DFlash2 drafter's block proposal through its candidate selector (module docstring).

    ``output_multiplier`` / ``softcap``: the unary transform (1.0 / None for our exports, whose
    unary logits are the raw head's).
    """

    def __init__(self, drafter, target, *, block_size: int, mask_token_id: int, output_multiplier: float = 1.0,
                 softcap: float | None = None):
        super().__init__(drafter, target, block_size=block_size, mask_token_id=mask_token_id)
        self.output_multiplier = float(output_multiplier)
        self.softcap = softcap
        self.top_k = int(drafter.candidate_selector.top_k)

    @torch.no_grad()
    def lattice(self, block: torch.Tensor, ctx_feats: torch.Tensor, start: int):
        """``(lattice [1, B-1, K, K], unary)`` of the block: the walk's input (tests)."""
        h = self.hidden(block, ctx_feats, start)[1:]                       # (B-1, H)
        logits = transform_logits(self.target.lm_head(h).float(), self.output_multiplier, self.softcap)
        unary = unary_topk(logits[None], self.top_k)                             # [1, B-1, K]
        sel = self.drafter.candidate_selector
        anchor = block[:1].to(h.device).long()
        return sel.lattice(h[None].to(sel.hidden_projection.weight.dtype), unary, anchor), unary

    @torch.no_grad()
    def propose(self, block: torch.Tensor, ctx_feats: torch.Tensor, start: int, tokens=None) -> torch.Tensor:
        lat, unary = self.lattice(block, ctx_feats, start)
        return greedy_walk(lat, unary.ids)[0][0]                                 # (B-1,)


def load(drafter_dir, target, *, block_size: int = 0) -> tuple[list, dict]:
    """``([("selector", p1), ("no_selector", p2)], meta)`` for the DFlash2 export at
    ``drafter_dir`` on ``target`` (a :class:`dflash_prep.train.speculate.Target`); ``block_size``
    0 = the drafter's own B. ``meta``: DFlash's keys (``block_size`` resolved, ``mask_token_id``,
    ``target_layer_ids``, ``hidden_size``, ``vocab_size``, ``export``)."""
    from dflash_prep.train.objectives.dflash2.export import load_export

    drafter, full = load_export(drafter_dir)
    B = int(block_size or full["block_size"])
    T = drafter.config.conv_kernel_size
    if B < max(2, T):
        raise ConfigError(f"--block-size {B}: a DFlash2 block needs at least 2 slots and the convolution's "
                          f"{T} taps (conv_kernel_size); use --block-size >= {max(2, T)} or 0 (the drafter's)")
    if full["input_embedding_scale"] != 1.0:
        raise ConfigError(f"{drafter_dir}: input_embedding_scale {full['input_embedding_scale']} is not supported "
                          "here (the block embeddings are the target's, unscaled)")
    meta = {**{k: full[k] for k in META_KEYS}, "block_size": B}
    kw = {"block_size": B, "mask_token_id": meta["mask_token_id"]}
    return [("selector", SelectorProposer(drafter, target, output_multiplier=full["output_multiplier"],
                                          softcap=full["final_logit_softcapping"], **kw)),
            ("no_selector", DFlashProposer(drafter, target, **kw))], meta
