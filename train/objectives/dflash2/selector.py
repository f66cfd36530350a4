"""DFlash2's candidate selector: unary top-K, edge scores, the greedy walk, and its training loss.

Instead of an independent argmax per slot, DFlash2 keeps each drafted slot's top-K tokens under
the target head and walks one path through them, scoring adjacent pairs
(``/work/notes/dflash2_contract.md`` sections 4-5). For slot r = 1..B-1 of a block whose anchor
(slot 0, the verified token) is ``x[a]``:

- ``h_r`` is the drafter's final hidden state of slot r (after ``norm``); the unary logits are
  the target head's over the full vocabulary, ``transform(lm_head(h_r))`` (:func:`transform_logits`:
  ``output_multiplier`` then ``final_logit_softcapping``, the z-lab order);
- candidates ``(U_r[k], C_r[k])``, k = 0..K-1: the top K, ordered by value descending and, among
  equal values, token id ascending (:func:`unary_topk`), so candidate 0 is ``torch.argmax``'s pick;
- the edge score into candidate c from predecessor token p uses the SUCCESSOR slot's state::

      S_r(p, c) = U_r(c) + sum_rho A[p, rho] * (P h_r)[rho] * B[c, rho]

  with A = ``predecessor_codebook`` [V, R], B = ``successor_codebook`` [V, R] (bare tensors,
  indexed by token id over the full vocabulary) and P = ``hidden_projection`` (H -> R, no bias);
- **walk** (temperature 0, the public rule of vLLM's ``_selector_walk_kernel`` and z-lab's
  ``select``): greedy, not Viterbi. Slot 1's predecessor is the anchor; each slot takes the
  candidate with the highest edge score from the token just chosen, the lowest candidate index
  on ties, and that token becomes the next slot's predecessor (:func:`greedy_walk`). Equivalently
  the lexicographically largest key ``(S_1, -k_1, S_2, -k_2, ...)`` over all K^(B-1) index paths
  (:func:`brute_force_walk`, the test oracle).

``init="zero"`` zeroes the successor codebook (SpecForge, NeMo): every edge term is exactly 0, the
scores are the unary values, and the walk proposes candidate 0 per slot, i.e. exactly DFlash's
argmax. ``init="normal"`` draws both codebooks from N(0, std) (speculators). The predecessor
codebook and the projection are N(0, std) in both.

**Training** (:func:`selector_loss`), teacher-forced: the predecessor of slot r is the gold token
``x[a+r-1]`` (the anchor for r = 1; :func:`teacher_forced`), so all slots are independent. Per
slot, a K-way cross-entropy of its edge scores against the gold token's candidate index. When
the gold token is not among the K candidates:

- ``missing="drop"`` (SpecForge, NeMo, verl-SpeCo): the slot contributes nothing;
- ``missing="inject"`` (speculators): candidate K-1 (the lowest-ranked) is replaced by the gold
  token with its own unary value, and the label is K-1. Only the loss sees the injected set.

The loss is the SUM of ``w * CE`` over the contributing slots with the caller's slot weights
(the DFlash weights, 0 where a slot has no target); the caller normalises over the whole
optimizer step. Stats are sums too (:class:`SelectorLoss`): unary top-K recall, teacher-forced
accuracy on covered slots, and the unary argmax's accuracy on the same slots (the lift).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from dflash_prep.errors import ConfigError

MISSING_MODES = ("inject", "drop")
INIT_MODES = ("zero", "normal")
BRUTE_FORCE_MAX_PATHS = 20_000


class Unary(NamedTuple):
    """A slot's candidates: ``values``/``ids`` ``[..., K]`` (value desc, id asc) and, when asked
    for, the gold token's own unary value ``gold_values [...]`` (what ``inject`` needs)."""

    values: torch.Tensor
    ids: torch.Tensor
    gold_values: torch.Tensor | None = None


def transform_logits(logits: torch.Tensor, output_multiplier: float = 1.0,
                     softcap: float | None = None) -> torch.Tensor:
    """The public unary transform: ``l * m``, then ``tanh(. / cap) * cap`` when ``softcap > 0``
    (z-lab ``compute_logits``; vLLM's LogitsProcessor caps before it scales, see the contract)."""
    out = logits if output_multiplier == 1.0 else logits * float(output_multiplier)
    if softcap is not None and float(softcap) > 0:
        out = torch.tanh(out / float(softcap)) * float(softcap)
    return out


def _ordered_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``k`` of each row of ``x [R, V]``, value descending then id ascending, exactly.

    ``topk`` leaves the order of equal values, and which of them make the cut, unspecified; rows
    where a tie straddles the k-th place are redone with a stable full sort (rare for float
    logits). Logits must not be NaN.
    """
    vals, ids = x.topk(k, dim=-1, largest=True, sorted=True)               # (R, k)
    ids, perm = ids.sort(dim=-1)                                          # id ascending ...
    vals, perm2 = vals.gather(-1, perm).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(-1, perm2)                                           # ... within equal values
    straddle = (x >= vals[:, -1:]).sum(dim=-1) > k
    if bool(straddle.any()):
        rows = straddle.nonzero()[:, 0]
        v, i = x[rows].sort(dim=-1, descending=True, stable=True)
        vals, ids = vals.clone(), ids.clone()
        vals[rows], ids[rows] = v[:, :k], i[:, :k]
    return vals, ids


def unary_topk(logits: torch.Tensor, k: int, gold: torch.Tensor | None = None) -> Unary:
    """Candidates from (already transformed) logits ``[..., V]`` -> :class:`Unary` ``[..., k]``.

    ``gold [...]`` (token ids) also returns their logits (``gold_values``). Gradients flow into
    the gathered values.
    """
    V = logits.shape[-1]
    if not 1 <= k <= V:
        raise ConfigError(f"selector_top_k must be in [1, vocab size {V}], got {k}")
    flat = logits.reshape(-1, V)                                           # (R, V)
    with torch.no_grad():
        _, ids = _ordered_topk(flat.detach(), k)
    values = flat.gather(-1, ids)
    g = None if gold is None else flat.gather(-1, gold.reshape(-1, 1).long())[:, 0]
    lead = logits.shape[:-1]
    return Unary(values.view(*lead, k), ids.view(*lead, k), None if g is None else g.view(lead))


def unary_topk_from_hidden(hidden: torch.Tensor, head_weight: torch.Tensor, k: int,
                           gold: torch.Tensor | None = None, *, output_multiplier: float = 1.0,
                           softcap: float | None = None, chunk_rows: int = 1024) -> Unary:
    """Candidates from final hidden states ``[..., H]`` and the target head ``[V, H]``, in chunks
    of ``chunk_rows`` rows: each chunk's logits ``[chunk, V]`` live only while it is ranked (the
    values keep their gradient w.r.t. ``hidden``; backward forms one chunk's logit gradient at
    a time). Same result as :func:`unary_topk` of ``transform_logits(hidden @ head_weight.T)``.
    """
    H = hidden.shape[-1]
    V = head_weight.shape[0]
    if head_weight.dim() != 2 or head_weight.shape[1] != H:
        raise ValueError(f"head_weight must be [V, {H}], got {tuple(head_weight.shape)}")
    if not 1 <= k <= V:
        raise ConfigError(f"selector_top_k must be in [1, vocab size {V}], got {k}")
    if chunk_rows < 1:
        raise ConfigError(f"chunk_rows must be >= 1, got {chunk_rows}")
    rows = hidden.reshape(-1, H)                                           # (R, H)
    golds = None if gold is None else gold.reshape(-1).long()
    vals, idss, gvals = [], [], []
    for s in range(0, rows.shape[0], chunk_rows):
        raw = rows[s:s + chunk_rows] @ head_weight.t()                     # (chunk, V)
        with torch.no_grad():
            _, ids = _ordered_topk(transform_logits(raw.detach(), output_multiplier, softcap), k)
        vals.append(transform_logits(raw.gather(-1, ids), output_multiplier, softcap))
        idss.append(ids)
        if golds is not None:
            g = raw.gather(-1, golds[s:s + chunk_rows, None])[:, 0]
            gvals.append(transform_logits(g, output_multiplier, softcap))
    lead = hidden.shape[:-1]
    values = torch.cat(vals).view(*lead, k) if vals else rows.new_zeros(*lead, k)
    ids = torch.cat(idss).view(*lead, k) if idss else torch.zeros(*lead, k, dtype=torch.long)
    g = None if golds is None else (torch.cat(gvals).view(lead) if gvals else rows.new_zeros(lead))
    return Unary(values, ids, g)


def teacher_forced(block_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``block_tokens [..., B]`` = ``x[a .. a+B-1]`` (anchor first) -> ``(predecessors, gold)``,
    each ``[..., B-1]`` for slots 1..B-1: slot r's predecessor is ``x[a+r-1]``, its gold ``x[a+r]``."""
    return block_tokens[..., :-1], block_tokens[..., 1:]


def greedy_walk(lattice: torch.Tensor, candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The public greedy walk over ``lattice [N, S, K, K]`` (slot, predecessor index, candidate).

    Slot 0's rows all hold the anchor (row 0 is read); from then on the chosen index is the row.
    Ties take the lowest candidate index (``torch.argmax`` returns the first maximum).
    Returns ``(tokens [N, S], index [N, S])`` with ``tokens = candidates.gather(index)``.
    """
    N, S, K, _ = lattice.shape
    rows = torch.arange(N, device=lattice.device)
    prev = torch.zeros(N, dtype=torch.long, device=lattice.device)
    picks = []
    for s in range(S):
        prev = lattice[rows, s, prev].argmax(dim=-1)                       # (N,) first maximum
        picks.append(prev)
    index = torch.stack(picks, dim=1) if picks else prev.new_zeros(N, 0)
    return candidates.gather(-1, index[..., None])[..., 0], index


def brute_force_walk(lattice: torch.Tensor, candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Oracle for :func:`greedy_walk`: enumerate all K^S index paths of each block and keep the
    lexicographically largest ``(S_1, -k_1, S_2, -k_2, ...)``. For tests (K^S <= 20,000)."""
    N, S, K, _ = lattice.shape
    if K ** S > BRUTE_FORCE_MAX_PATHS:
        raise ConfigError(f"brute_force_walk: {K}^{S} paths is too many (at most {BRUTE_FORCE_MAX_PATHS})")
    lat = lattice.tolist()
    best = []
    for n in range(N):
        top_key, top_path = None, None
        for path in itertools.product(range(K), repeat=S):
            key, prev = [], 0
            for s, c in enumerate(path):
                key += [lat[n][s][prev][c], -c]
                prev = c
            if top_key is None or key > top_key:
                top_key, top_path = key, path
        best.append(list(top_path))
    index = torch.tensor(best, dtype=torch.long, device=lattice.device).view(N, S)
    return candidates.gather(-1, index[..., None])[..., 0], index


class CandidateSelector(nn.Module):
    """``hidden_projection`` (H -> R), ``predecessor_codebook`` and ``successor_codebook`` [V, R].

    ``state_dict()`` keys are the checkpoint's relative to ``candidate_selector.``:
    ``hidden_projection.weight`` [R, H], ``predecessor_codebook`` [V, R], ``successor_codebook``
    [V, R] (no ``.weight`` on the codebooks).
    """

    def __init__(self, hidden: int, vocab_size: int, rank: int, top_k: int, *,
                 init: str = "zero", init_std: float = 0.02):
        super().__init__()
        if rank < 1:
            raise ConfigError(f"selector_rank must be >= 1, got {rank}")
        if not 1 <= top_k <= vocab_size:
            raise ConfigError(f"selector_top_k must be in [1, vocab size {vocab_size}], got {top_k}")
        if init not in INIT_MODES:
            raise ConfigError(f"selector init must be one of {INIT_MODES}, got {init!r}")
        if not init_std > 0:
            raise ConfigError(f"selector init_std must be positive, got {init_std}")
        self.hidden, self.vocab_size, self.rank, self.top_k = int(hidden), int(vocab_size), int(rank), int(top_k)
        self.init, self.init_std = init, float(init_std)
        self.hidden_projection = nn.Linear(self.hidden, self.rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(self.vocab_size, self.rank))
        self.successor_codebook = nn.Parameter(torch.empty(self.vocab_size, self.rank))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """N(0, std) projection and predecessor codebook; successor codebook zero (``init="zero"``)
        or N(0, std) (``"normal"``)."""
        nn.init.normal_(self.hidden_projection.weight, mean=0.0, std=self.init_std)
        nn.init.normal_(self.predecessor_codebook, mean=0.0, std=self.init_std)
        if self.init == "zero":
            self.successor_codebook.zero_()
        else:
            nn.init.normal_(self.successor_codebook, mean=0.0, std=self.init_std)

    def scores(self, hidden: torch.Tensor, unary: Unary, predecessors: torch.Tensor) -> torch.Tensor:
        """Edge scores from one predecessor per slot: ``hidden [..., H]``, ``unary`` ``[..., K]``,
        ``predecessors [...]`` (token ids) -> ``[..., K]`` = ``U + <A[p] * P h, B[c]>``."""
        ctx = self.predecessor_codebook[predecessors.long()] * self.hidden_projection(hidden)  # (..., R)
        succ = self.successor_codebook[unary.ids]                                            # (..., K, R)
        return unary.values + torch.einsum("...r,...kr->...k", ctx, succ)

    def lattice(self, hidden: torch.Tensor, unary: Unary, anchors: torch.Tensor) -> torch.Tensor:
        """All edge scores of a block: ``hidden [N, S, H]`` (slots 1..B-1), ``unary`` ``[N, S, K]``,
        ``anchors [N]`` -> ``[N, S, K(pred), K(cand)]``; slot 1's predecessor rows are the anchor,
        slot s > 1's row p is candidate p of slot s - 1."""
        N, S, K = unary.ids.shape
        pred = torch.cat((anchors.long().view(N, 1, 1).expand(N, 1, K), unary.ids[:, :-1]), dim=1)  # (N, S, K)
        ctx = self.predecessor_codebook[pred] * self.hidden_projection(hidden)[:, :, None]     # (N, S, K, R)
        succ = self.successor_codebook[unary.ids]                                              # (N, S, K, R)
        return unary.values[:, :, None, :] + torch.einsum("nspr,nscr->nspc", ctx, succ)

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, unary: Unary, anchors: torch.Tensor) -> torch.Tensor:
        """The drafted tokens ``[N, S]`` for slots 1..B-1: :func:`greedy_walk` of :meth:`lattice`."""
        return greedy_walk(self.lattice(hidden, unary, anchors), unary.ids)[0]

    def loss(self, hidden: torch.Tensor, unary: Unary, predecessors: torch.Tensor, gold: torch.Tensor,
             weights: torch.Tensor, *, missing: str = "drop", detach: bool = False) -> "SelectorLoss":
        """:func:`selector_loss` with this selector."""
        return selector_loss(self, hidden, unary, predecessors, gold, weights, missing=missing, detach=detach)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, vocab_size={self.vocab_size}, rank={self.rank}, top_k={self.top_k}"


STAT_FIELDS = ("weight_sum", "slots", "covered", "correct", "unary_correct")


@dataclass
class SelectorLoss:
    """The selector term of one micro-batch. ``loss``: sum of ``w * CE`` (with grad). The rest are
    detached float64 sums over slots with ``w > 0``: ``weight_sum`` (of the contributing slots),
    ``slots``, ``covered`` (gold in the unary top-K), ``correct`` (covered and the teacher-forced
    argmax is the gold), ``unary_correct`` (candidate 0, DFlash's pick, is the gold)."""

    loss: torch.Tensor
    weight_sum: torch.Tensor
    slots: torch.Tensor
    covered: torch.Tensor
    correct: torch.Tensor
    unary_correct: torch.Tensor

    def stat_vector(self) -> torch.Tensor:
        """The sums in :data:`STAT_FIELDS` order, float64 ``[5]`` (one all-reduce)."""
        return torch.stack([getattr(self, f) for f in STAT_FIELDS])

    @staticmethod
    def _ratio(num, den) -> float:
        den = float(den)
        return float(num) / den if den > 0 else float("nan")

    @property
    def recall(self) -> float:
        """Unary top-K recall: covered / slots."""
        return self._ratio(self.covered, self.slots)

    @property
    def accuracy(self) -> float:
        """Teacher-forced selector accuracy on covered slots: correct / covered."""
        return self._ratio(self.correct, self.covered)

    @property
    def unary_accuracy(self) -> float:
        """DFlash's argmax accuracy on all weighted slots: unary_correct / slots."""
        return self._ratio(self.unary_correct, self.slots)


def selector_loss(selector: CandidateSelector, hidden: torch.Tensor, unary: Unary, predecessors: torch.Tensor,
                  gold: torch.Tensor, weights: torch.Tensor, *, missing: str = "drop",
                  detach: bool = False) -> SelectorLoss:
    """Teacher-forced K-way CE (module docstring). Any leading shape ``L``: ``hidden [*L, H]``,
    ``unary`` ``[*L, K]`` (with ``gold_values [*L]`` for ``inject``), ``predecessors``/``gold``
    ``[*L]`` token ids (valid ids even where ``w = 0``), ``weights [*L]``. ``detach`` stops the
    gradient into ``hidden`` and the unary values (verl-SpeCo; SpecForge's stop_gradient)."""
    if missing not in MISSING_MODES:
        raise ConfigError(f"selector missing-gold rule must be one of {MISSING_MODES}, got {missing!r}")
    ids, values = unary.ids, unary.values
    K = ids.shape[-1]
    gold = gold.long()
    if not (ids.shape[:-1] == gold.shape == predecessors.shape == weights.shape == hidden.shape[:-1]):
        raise ValueError(f"selector_loss: shapes disagree: hidden {tuple(hidden.shape)}, candidates "
                         f"{tuple(ids.shape)}, predecessors {tuple(predecessors.shape)}, gold "
                         f"{tuple(gold.shape)}, weights {tuple(weights.shape)}")
    if detach:
        hidden, values = hidden.detach(), values.detach()
    match = ids == gold[..., None]                                         # (*L, K)
    covered = match.any(dim=-1)
    label = match.long().argmax(dim=-1)                                    # first match; 0 when absent
    if missing == "inject":
        if unary.gold_values is None:
            raise ConfigError("missing='inject' needs the gold tokens' unary values: pass gold= to "
                              "unary_topk / unary_topk_from_hidden")
        gv = unary.gold_values.detach() if detach else unary.gold_values
        last = torch.where(covered, ids[..., -1], gold)
        ids = torch.cat((ids[..., :-1], last[..., None]), dim=-1)
        values = torch.cat((values[..., :-1], torch.where(covered, values[..., -1], gv.to(values.dtype))[..., None]),
                           dim=-1)
        label = torch.where(covered, label, torch.full_like(label, K - 1))
        include = torch.ones_like(covered)
    else:
        include = covered
    s = selector.scores(hidden, Unary(values, ids), predecessors)          # (*L, K)
    ce = F.cross_entropy(s.float().reshape(-1, K), label.reshape(-1), reduction="none").view_as(label)
    active = weights > 0
    use = active & include
    w = weights.to(ce.dtype)
    loss = torch.where(use, w * ce, torch.zeros_like(ce)).sum()
    with torch.no_grad():
        hit = s.argmax(dim=-1) == label
        f64 = torch.float64
        return SelectorLoss(
            loss=loss,
            weight_sum=torch.where(use, w, torch.zeros_like(w)).sum().to(f64),
            slots=active.sum().to(f64),
            covered=(active & covered).sum().to(f64),
            correct=(active & covered & hit).sum().to(f64),
            unary_correct=(active & (unary.ids[..., 0] == gold)).sum().to(f64),
        )
