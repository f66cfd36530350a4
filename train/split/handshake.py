"""The set-up handshake of a split job (``--target-ranks K``): a refusal on any rank ends every rank with one line.

A split job's start (:mod:`.split`) meets on the default group :data:`MEETINGS` times, in this
order on every rank: (1) every epoch's manifest exists, (2) drafter rank 0's cursor, (3) the
target ranks have loaded the target. Each meeting is one ``all_gather_object`` of every rank's
status, ``{"ok": payload}`` or ``{"refused": its error's line}``. A rank that fails between two
meetings (a ConfigError, a target it cannot load) brings its line to the next one
(:func:`refuse`) instead of leaving: the others would otherwise wait in a collective for a peer
that is gone and end on gloo's 60-line "Connection closed by peer". At a meeting every rank
reads the refusals, and each rank that did not refuse raises :class:`PeerRefused`, one line
naming the first refusing rank by its role. Collectives match in order, so the refusing rank's
one extra meeting is the one the others wait in; past the last meeting it does nothing.
"""

from __future__ import annotations

import torch.distributed as tdist

from dflash_prep.errors import DflashError

from dflash_prep.train.distributed import backend_reason

#: meetings of a split job's start, on every rank (module docstring)
MEETINGS = 3

_met = {"count": 0}


class PeerRefused(DflashError):
    """Another rank refused the split job at set-up (its own line says why); this rank stops too."""


class PeerLost(DflashError):
    """A rank left the split job during its set-up (it died, or was killed) before saying why."""


def role_of(roles, rank: int) -> str:
    """``"target rank k"`` or ``"drafter rank i"`` for global rank ``rank`` of ``roles``."""
    return f"target rank {rank}" if roles.is_target(rank) else f"drafter rank {roles.drafter_index(rank)}"


def begin() -> None:
    """A new job's start: no meeting held yet (call once per process, after the roles are set)."""
    _met["count"] = 0


def meet(place, payload=None) -> list:
    """One meeting (module docstring): every rank's ``payload``, in global-rank order.

    Raises :class:`PeerRefused` when any rank refused, :class:`PeerLost` when the collective
    broke (a rank is gone)."""
    statuses = _gather(place, {"ok": payload})
    _met["count"] += 1
    refused = [(r, s["refused"]) for r, s in enumerate(statuses) if "refused" in s]
    if refused:
        r, line = refused[0]
        _met["count"] = MEETINGS
        raise PeerRefused(f"{role_of(place.roles, place.rank)}: {role_of(place.roles, r)} (global rank {r}) refused "
                          f"the job at set-up, so this rank stops too (its own line says why): {line}")
    return [s["ok"] for s in statuses]


def refuse(place, error: BaseException) -> None:
    """Bring this rank's set-up ``error`` to the next meeting, so that every rank stops with it.

    Does nothing without a split job (``place`` None), past the last meeting (training has
    started: the link's own errors take over), or for an error a meeting raised. If the meeting
    itself cannot be held (a peer is gone too), there is nobody left to tell: the caller raises
    ``error`` either way, which is this rank's one line."""
    if place is None or isinstance(error, (PeerRefused, PeerLost)) or _met["count"] >= MEETINGS:
        return
    _met["count"] = MEETINGS
    line = " ".join(str(error).split()) or type(error).__name__
    try:
        _gather(place, {"refused": line})
    except PeerLost:
        pass


def _gather(place, status: dict) -> list:
    out = [None] * place.roles.world_size
    try:
        tdist.all_gather_object(out, status)
    except RuntimeError as e:   # gloo/NCCL: a peer closed its connection or the group timed out
        _met["count"] = MEETINGS
        raise PeerLost(f"{role_of(place.roles, place.rank)}: a rank left the split job during its set-up "
                       f"({backend_reason(e)}); "
                       "it stopped or died before it could say why: see the other ranks' output") from None
    return out
