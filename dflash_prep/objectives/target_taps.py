"""Which hidden states of the frozen target each drafter objective reads: one rule for the trainer,
``dflash-prep extract`` (the states cache) and the size estimates of analyze and pack.

Layer ids here are ours: tap ``l`` (0-based) is the *output* of decoder layer ``l``, transformers'
``hidden_states[l + 1]``. The final hidden state is the last layer's output after the model's
final norm (the input of the LM head), which ``--loss kl`` and EAGLE-3 turn into the teacher's
next-token distribution.

- **DFlash / DFlash2**: ``N`` draft layers tap :func:`dflash_taps` ``(L, N)``: one draft layer the
  middle layer ``L // 2``; ``N > 1`` layers ``round(1 + i * (L - 4) / (N - 1))``, i = 0..N-1 (the
  public DFlash rule; Python's ``round``); the final hidden state only under ``--loss kl``.
- **EAGLE-3**: three distinct taps :func:`eagle3_taps` ``(1, L // 2 - 1, L - 4)`` (the engines'
  default) and always the final hidden state.

Explicit ids (``--target-layer-ids``) replace the rule; the trainer reads the taps in the order
given (duplicates included: ``dflash_taps(4, 2)`` is ``[1, 1]``).

vLLM numbers the same states differently (:func:`vllm_layer_id`): its
``eagle_aux_hidden_state_layer_ids`` entry ``j`` is the residual stream after ``j`` layers, so our
tap ``l`` is its ``l + 1``, and its ``L`` is the last layer's output *before* the final norm.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from dflash_prep.errors import ConfigError
from dflash_prep.formats.states import bytes_per_token
from dflash_prep.objectives import base

def dflash_taps(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The target layers a DFlash drafter of ``num_draft_layers`` layers taps (module docstring)."""
    L, N = int(num_target_layers), int(num_draft_layers)
    if N < 1 or L < 1:
        raise ConfigError(f"build_target_layer_ids: need >= 1 target and draft layers, got L={L}, N={N}")
    if N == 1:
        return [L // 2]
    if L < 4:
        raise ConfigError(f"build_target_layer_ids: a {N}-layer drafter taps layers 1..L-3, so the target needs "
                          f"at least 4 layers (it has {L}); use one draft layer or pass target_layer_ids")
    return [int(round(1 + i * (L - 4) / (N - 1))) for i in range(N)]


def repeated_taps(taps) -> str:
    """A warning when ``taps`` repeat a layer (the public DFlash rule does for small targets, e.g.
    ``[1, 1]`` for 4 layers and 2 draft layers), else ``""``. Training and z-lab's code take such
    taps; vLLM dedups the layers it captures and then refuses the drafter (docs/engines.md)."""
    taps = [int(t) for t in taps]
    again = sorted({t for t in taps if taps.count(t) > 1})
    if not again:
        return ""
    return (f"taps {taps} repeat layer(s) {again}: vLLM refuses such a drafter (it captures each layer once); "
            f"pass --target-layer-ids with {len(taps)} distinct layers to serve it there")


def eagle3_taps(num_target_layers: int, given=()) -> tuple[int, ...]:
    """EAGLE-3's three taps: ``given`` or ``(1, L // 2 - 1, L - 4)``; three distinct layers of the target."""
    L = int(num_target_layers)
    ids = tuple(int(i) for i in given) or (1, L // 2 - 1, L - 4)
    if len(set(ids)) != 3 or len(ids) != 3 or not all(0 <= i < L for i in ids):
        raise ConfigError(f"eagle3 taps {list(ids)} of a {L}-layer target: three distinct layers in 0..{L - 1} are "
                          "needed; pass --target-layer-ids A B C (a small target's default ids coincide)")
    return ids


def vllm_layer_id(tap: int) -> int:
    """vLLM's ``eagle_aux_hidden_state_layer_ids`` entry that captures our tap ``tap`` (its output)."""
    return int(tap) + 1


@dataclass(frozen=True)
class StatesNeed:
    """What a drafter run reads of its target, per token: ``taps`` (our ids, in the trainer's order)
    and whether the ``final`` hidden state is needed."""

    taps: tuple[int, ...]
    final: bool

    def slots(self) -> tuple[int, ...]:
        """The distinct taps, sorted: what a states cache stores (the final state is one slot more)."""
        return tuple(sorted(set(self.taps)))

    def num_slots(self) -> int:
        return len(self.slots()) + int(self.final)

    def describe(self) -> str:
        t = ", ".join(map(str, self.taps))
        return f"taps [{t}]" + (" + the final hidden state" if self.final else "")


def states_need(objective: str, num_target_layers: int, *, draft_layers: int | None = None,
                target_layer_ids=(), loss: str = "ce") -> StatesNeed:
    """What ``objective`` reads of an ``L``-layer target (module docstring): its registration's
    :meth:`~dflash_prep.objectives.base.DataObjective.states_need`; ``draft_layers`` and ``loss``
    are DFlash's, ``target_layer_ids`` replaces the rule."""

    if objective not in base.state_readers():
        raise ConfigError(f"--objective {objective} reads no target hidden states; one of "
                          f"{', '.join(base.state_readers())} does")
    return base.get(objective).states_need(num_target_layers, draft_layers=draft_layers,
                                           target_layer_ids=target_layer_ids, loss=loss)


def dflash_need(objective: str, num_target_layers: int, *, draft_layers: int | None, target_layer_ids,
                loss: str) -> StatesNeed:
    """DFlash's and DFlash2's rule (module docstring): the taps of ``draft_layers`` (or
    ``target_layer_ids``), the final hidden state under ``--loss kl``."""
    L = int(num_target_layers)
    given = tuple(int(i) for i in target_layer_ids)
    if loss not in ("ce", "kl"):
        raise ConfigError(f"--loss must be ce or kl, got {loss!r}")
    if draft_layers is None and not given:
        raise ConfigError(f"--objective {objective}: pass --draft-layers N (the taps follow from it) or "
                          "--target-layer-ids")
    taps = given or tuple(dflash_taps(L, draft_layers))
    bad = [i for i in taps if not 0 <= i < L]
    if bad:
        raise ConfigError(f"target layers {bad} do not exist (the target has {L} layers)")
    return StatesNeed(taps, loss == "kl")


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000.0
    return f"{n:,.1f} PB"  # pragma: no cover


def states_estimate(objective: str, num_target_layers: int, hidden: int, tokens: int, *,
                    draft_layers: int | None = None) -> str:
    """One line: the size of the states cache ``dflash-prep extract`` writes for ``tokens`` tokens of an
    ``L``-layer, ``hidden``-wide target (bytes per token x tokens; bf16, fp8, and DFlash's ``--loss kl``)."""
    if objective == "eagle3":      # three distinct taps whatever their ids (a small target passes its own)
        ce = StatesNeed((0, 1, 2), True)
    else:
        ce = states_need(objective, num_target_layers, draft_layers=draft_layers)
    b16, b8 = (bytes_per_token(ce.num_slots(), hidden, d) for d in ("bf16", "fp8"))
    what = f"{len(ce.slots())} tap(s)" + (" + the final state" if ce.final else "")
    line = (f"states cache (dflash-prep extract --objective {objective}): {what} x H={hidden:,} = {b16:,} B/token bf16 "
            f"x {int(tokens):,} tokens = {_size(b16 * tokens)} (fp8: {_size(b8 * tokens)}")
    if not ce.final:
        kl = states_need(objective, num_target_layers, draft_layers=draft_layers, loss="kl")
        line += f"; --loss kl: {_size(bytes_per_token(kl.num_slots(), hidden, 'bf16') * tokens)} bf16"
    return line + ")"


def extract_command(*, data, target, out, objective: str, draft_layers: int | None = None, target_layer_ids=(),
                    loss: str = "ce", dtype: str = "bf16") -> str:
    """The ``dflash-prep extract`` line that builds a cache for these settings (the trainer prints it
    when it refuses a cache)."""

    chosen = base.get(objective).fixed_states is None      # --draft-layers and --loss choose its states
    parts = ["dflash-prep", "extract", str(data), "--target", str(target), "--objective", objective]
    if chosen and draft_layers is not None and not target_layer_ids:
        parts += ["--draft-layers", str(draft_layers)]
    for i in target_layer_ids:
        parts += ["--target-layer-ids", str(i)]
    if chosen and loss != "ce":
        parts += ["--loss", loss]
    parts += ["--dtype", dtype, "--out", str(out)]
    return shlex.join(parts)
