"""Speculative decoding with a DFlash export: the drafting half (:mod:`dflash_prep.train.speculate`
runs the loop, verifies and counts acceptance).

:func:`load` reads an export (:func:`~dflash_prep.train.objectives.dflash.export.load_export`) and
returns its proposer with what the loop needs to know of it.
"""

from __future__ import annotations

import torch


class DFlashProposer:
    """Our drafter (:class:`dflash_prep.train.objectives.dflash.drafter.Drafter`) reading the target's features.

    One packed drafter forward with one document and one block at anchor ``start``: the block
    sees the context ``[0, start)`` and itself, exactly as after a prefill of ``start`` tokens.
    The packed contract wants ``anchor < S_d`` (training anchors sit inside their document), so
    the context gets one zero row at position ``start`` that the mask hides (only ``[0, a)`` is
    visible); the target's ``lm_head`` on the drafter's outputs for slots 1..B-1, argmax.
    A drafter with a sliding window W (its config's ``sliding_window``) gets only the context
    its widest row sees, ``[start - W + 1, start)``, at its absolute positions (the mask works
    on position differences, so the cut document gives the same output): O(W) per block.
    """

    def __init__(self, drafter, target, *, block_size: int, mask_token_id: int):
        self.drafter = drafter.eval()
        self.target = target
        self.block_size = int(block_size)
        self.mask_token_id = int(mask_token_id)

    @torch.no_grad()
    def propose(self, block: torch.Tensor, ctx_feats: torch.Tensor, start: int, tokens=None) -> torch.Tensor:
        h = self.hidden(block, ctx_feats, start)  # (B, H)
        return self.target.lm_head(h[1:]).argmax(-1)  # (B-1,)

    @torch.no_grad()
    def hidden(self, block: torch.Tensor, ctx_feats: torch.Tensor, start: int) -> torch.Tensor:
        """The drafter's final hidden states ``(B, H)`` of ``block`` at ``start`` (what :meth:`propose`
        turns into tokens)."""
        dev = self.target.device
        B = self.block_size
        noise = self.target.embed(block.to(dev))  # (B, H)
        window = int(getattr(self.drafter.config, "sliding_window", 0))
        lo = max(0, start - (window - 1)) if window else 0  # slot 0's window start: the widest view
        feats = ctx_feats[lo:start].to(dev)
        feats = torch.cat([feats, feats.new_zeros(1, feats.shape[1])])  # (start - lo + 1, k*H)
        ctx_pos = torch.arange(lo, start + 1, device=dev)  # (S,) absolute positions, for RoPE
        blk_pos = torch.arange(start, start + B, device=dev)  # (B,)
        cu_ctx = torch.tensor([0, start - lo + 1], dtype=torch.int32, device=dev)
        cu_blk = torch.tensor([0, B], dtype=torch.int32, device=dev)
        anchors = torch.tensor([start - lo], dtype=torch.int32, device=dev)  # within the cut document
        return self.drafter(noise, feats, ctx_pos, blk_pos, cu_ctx, cu_blk, anchors, B)  # (B, H)


def load(drafter_dir, target, *, block_size: int = 0) -> tuple[list, dict]:
    """``([("dflash", proposer)], meta)`` for the export at ``drafter_dir`` on ``target`` (a
    :class:`dflash_prep.train.speculate.Target`); ``block_size`` 0 = the drafter's own B. ``meta``:
    :func:`~dflash_prep.train.objectives.dflash.export.load_export`'s, with ``block_size`` resolved."""
    from dflash_prep.train.objectives.dflash.export import load_export

    drafter, meta = load_export(drafter_dir)
    meta = {**meta, "block_size": block_size or meta["block_size"]}
    return [("dflash", DFlashProposer(drafter, target, block_size=meta["block_size"],
                                      mask_token_id=meta["mask_token_id"]))], meta
