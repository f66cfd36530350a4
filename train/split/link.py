"""Point-to-point transport between target ranks and drafter ranks (:mod:`dflash_prep.train.split.roles`).

**Message.** One fixed-size int64 header (:data:`HEADER_LEN` entries, 512 bytes), then its
payload tensors, all on the default process group, in order, between one pair of ranks:

    [MAGIC, VERSION, kind, epoch, step, micro, digest, n, (dtype code, ndim, dim_0..dim_ndim-1) x n, 0...]

``kind`` is :data:`KIND_DATA` (payload: the taps, and any other tensor a drafter step needs)
or :data:`KIND_STOP` (payload: one uint8 tensor, the UTF-8 reason a target rank stopped).
``(epoch, step, micro, digest)`` is the :class:`Tag`: the manifest row the payload belongs to,
``digest`` a 64-bit BLAKE2b of the row's sample ids (:func:`sample_digest`). The receiver
checks it against its own manifest row; a mismatch is a ``FormatError`` naming both tags.
Messages between one pair are matched first-posted, first-received (torch.distributed
point-to-point order), so nothing reorders them.

**Sender** (:class:`TapsSender`, on a target rank): ``isend``; at most ``prefetch`` messages
in flight per drafter rank: before posting another it waits on that rank's oldest. On CUDA
the sends run on their own stream, which first waits on an event recorded after the forward
that produced the payload, so the next forward overlaps them (and each payload is recorded on
the send stream, so the allocator never reuses it early). On gloo a posted send stays
incomplete until the drafter has posted the matching receive (measured with torch 2.13), so
in flight means not yet taken.

**Timeouts.** Every wait is bounded by ``timeout`` seconds and ends in a one-line
:class:`LinkError` naming the peer rank and the step: gloo's ``Work.wait(timeout)`` returns
at the deadline, and at once (a "connection closed" error) when the peer process died, even
by SIGKILL; NCCL work is polled with ``is_completed`` against the deadline.
"""

from __future__ import annotations

import datetime
import hashlib
import time
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from dflash_prep.errors import ConfigError, DflashError, FormatError

MAGIC = 0x44464C4B  # "DFLK"
VERSION = 1
HEADER_LEN = 64
KIND_DATA, KIND_STOP = 1, 2
_FIXED = 8  # magic, version, kind, epoch, step, micro, digest, n
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool)
"""Payload dtypes; a tensor's code in the header is its index here."""
_CODE = {dt: i for i, dt in enumerate(DTYPES)}


class LinkError(DflashError):
    """A peer of a split job stopped, died or went silent past ``--target-timeout``."""


def sample_digest(sample_ids) -> int:
    """64-bit digest (BLAKE2b, signed int64) of a micro-batch's sample ids, in order."""
    b = np.ascontiguousarray(np.asarray(sample_ids, dtype="<i8")).tobytes()
    return int.from_bytes(hashlib.blake2b(b, digest_size=8).digest(), "little", signed=True)


@dataclass(frozen=True)
class Tag:
    """Which manifest row a message belongs to."""

    epoch: int
    step: int
    micro: int
    """The accumulation index within the drafter rank's step."""
    digest: int
    """:func:`sample_digest` of the row's sample ids."""

    @classmethod
    def of(cls, epoch: int, step: int, micro: int, sample_ids) -> "Tag":
        return cls(int(epoch), int(step), int(micro), sample_digest(sample_ids))

    def __str__(self) -> str:
        return f"epoch {self.epoch} step {self.step} micro-batch {self.micro} (sample-id digest {self.digest & (2**64 - 1):016x})"


def encode_header(kind: int, tag: Tag, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The int64 ``[HEADER_LEN]`` header of a message (module docstring)."""
    h = [MAGIC, VERSION, int(kind), tag.epoch, tag.step, tag.micro, tag.digest, len(tensors)]
    for t in tensors:
        if t.dtype not in _CODE:
            raise ValueError(f"target link: dtype {t.dtype} cannot be sent; use one of {DTYPES}")
        h += [_CODE[t.dtype], t.dim(), *t.shape]
    if len(h) > HEADER_LEN:
        raise ValueError(f"target link: {len(tensors)} tensors of ranks {[t.dim() for t in tensors]} overflow the "
                         f"{HEADER_LEN}-entry header; send fewer or flatter tensors")
    return torch.tensor(h + [0] * (HEADER_LEN - len(h)), dtype=torch.int64)


def decode_header(h: torch.Tensor, *, peer: str) -> tuple[int, Tag, list[tuple[torch.dtype, tuple[int, ...]]]]:
    """``(kind, tag, [(dtype, shape)])`` of a received header; a foreign one is a FormatError."""
    v = [int(x) for x in h.tolist()]
    if v[0] != MAGIC or v[1] != VERSION or v[2] not in (KIND_DATA, KIND_STOP):
        raise FormatError(f"{peer} sent a message that is not a target-link v{VERSION} header (magic {v[0]:#x}, "
                          f"version {v[1]}, kind {v[2]}); run every rank with the same dflash-prep")
    tag, n, i, specs = Tag(v[3], v[4], v[5], v[6]), v[7], _FIXED, []
    for _ in range(n):
        code, nd = v[i], v[i + 1]
        if not 0 <= code < len(DTYPES) or i + 2 + nd > HEADER_LEN:
            raise FormatError(f"{peer} sent a corrupt target-link header for {tag} (dtype code {code}, ndim {nd})")
        specs.append((DTYPES[code], tuple(v[i + 2:i + 2 + nd])))
        i += 2 + nd
    return v[2], tag, specs


def _why(e: Exception, timeout: float) -> str:
    """gloo's error in a few words: the deadline, or the connection a dead peer closed."""
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    if "Timed out" in msg or "timeout" in msg.lower():
        return f"nothing within {timeout:g} s"
    core = msg.split("] ", 1)[-1].split(". ")[0]
    return f"the connection broke ({core})"


def wait_work(work, timeout: float) -> str | None:
    """Wait for ``work`` at most ``timeout`` s; None when it completed, else why it did not."""
    if dist.get_backend() == "nccl":
        deadline = time.monotonic() + timeout
        while not work.is_completed():
            if time.monotonic() > deadline:
                return f"nothing within {timeout:g} s"
            time.sleep(1e-4)
        return None
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:  # gloo: the deadline, or the peer's connection closed
        return _why(e, timeout)
    return None


def link_device(device: torch.device) -> torch.device:
    """Where a link's tensors live: ``device`` under NCCL, else the CPU (gloo stages GPU tensors
    through host memory; two ranks sharing one GPU must use gloo, NCCL refuses them)."""
    return device if device.type == "cuda" and dist.get_backend() == "nccl" else torch.device("cpu")


def _check_timeout(timeout: float) -> None:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise ConfigError(f"--target-timeout must be a finite number of seconds > 0, got {timeout!r}")


@dataclass
class _InFlight:
    tag: Tag
    works: list
    tensors: list   # kept alive until the send completes


class TapsSender:
    """A target rank's outgoing messages, ``prefetch`` in flight per drafter rank (module docstring).

    ``peers`` maps each destination global rank to its name in messages (``"drafter rank 1"``).
    ``bytes_sent``/``messages`` count posted messages (header included); ``send_s`` is the time
    spent posting and waiting; :meth:`in_flight` the messages posted and not yet seen taken
    (at most ``prefetch`` per drafter rank: a send is only checked when the window is full).
    """

    def __init__(self, peers: dict[int, str], *, prefetch: int = 2, timeout: float = 600.0,
                 device: torch.device = torch.device("cpu"), me: str = "target rank"):
        if prefetch < 1:
            raise ConfigError(f"--target-prefetch must be >= 1, got {prefetch}")
        _check_timeout(timeout)
        self.peers, self.prefetch, self.timeout, self.device, self.me = dict(peers), int(prefetch), float(timeout), device, me
        self._q: dict[int, deque[_InFlight]] = {p: deque() for p in self.peers}
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.bytes_sent = self.messages = 0
        self.send_s = 0.0

    def in_flight(self) -> int:
        return sum(len(q) for q in self._q.values())

    def send(self, dst: int, tag: Tag, tensors: Sequence[torch.Tensor], kind: int = KIND_DATA) -> None:
        """Post one message to global rank ``dst`` (after waiting on its oldest when ``prefetch`` are out)."""
        t0 = time.perf_counter()
        q = self._q[dst]
        while len(q) >= self.prefetch:
            self._retire(dst, q.popleft())
        tensors = [t.to(self.device).contiguous() for t in tensors]   # to the host under gloo
        header = encode_header(kind, tag, tensors)
        try:
            if self._stream is not None:  # the send stream waits for the forward that made the payload
                ready = torch.cuda.current_stream(self.device).record_event()
                with torch.cuda.stream(self._stream):
                    self._stream.wait_event(ready)
                    for t in tensors:
                        t.record_stream(self._stream)
                    header = header.to(self.device, non_blocking=True)
                    works = [dist.isend(header, dst)] + [dist.isend(t, dst) for t in tensors]
            else:
                works = [dist.isend(header, dst)] + [dist.isend(t, dst) for t in tensors]
        except RuntimeError as e:   # gloo refuses to post on a pair its dead peer closed
            raise self._lost(dst, tag, _why(e, self.timeout)) from None
        nbytes = header.numel() * 8 + sum(t.numel() * t.element_size() for t in tensors)
        q.append(_InFlight(tag, works, [header, *tensors]))
        self.bytes_sent += nbytes
        self.messages += 1
        self.send_s += time.perf_counter() - t0

    def flush(self) -> None:
        """Wait until every drafter rank has taken every message."""
        t0 = time.perf_counter()
        for dst, q in self._q.items():
            while q:
                self._retire(dst, q.popleft())
        self.send_s += time.perf_counter() - t0

    def stop(self, reason: str, *, timeout: float = 5.0) -> None:
        """Best effort: tell every drafter rank why this target rank stops (a STOP message), so it
        fails with the reason instead of a timeout. Never raises: the caller is already failing."""
        payload = torch.frombuffer(bytearray(reason.encode()[:4096] or b"?"), dtype=torch.uint8)
        if self.device.type == "cuda":
            payload = payload.to(self.device)
        header = encode_header(KIND_STOP, Tag(-1, -1, -1, 0), [payload]).to(payload.device)
        for dst in self.peers:
            try:
                works = [dist.isend(header, dst), dist.isend(payload, dst)]
                for w in works:
                    if wait_work(w, timeout) is not None:
                        break
            except RuntimeError:
                continue  # that drafter is gone: nothing to tell

    def _retire(self, dst: int, m: _InFlight) -> None:
        for w in m.works:
            why = wait_work(w, self.timeout)
            if why is not None:
                raise self._lost(dst, m.tag, why)

    def _lost(self, dst: int, tag: Tag, why: str) -> LinkError:
        return LinkError(f"{self.me}: {self.peers[dst]} (global rank {dst}) did not take the taps of {tag}: {why}; it "
                         "stopped or hangs (see its log). Raise --target-timeout if it is only slow")


class TapsReceiver:
    """A drafter rank's incoming messages from the target rank ``src`` (module docstring)."""

    def __init__(self, src: int, *, timeout: float = 600.0, me: str = "drafter rank", peer: str = "target rank",
                 device: torch.device = torch.device("cpu")):
        _check_timeout(timeout)
        self.src, self.timeout, self.me, self.peer = int(src), float(timeout), me, peer
        self.device = device   # where the link's tensors live: the GPU under NCCL, else CPU
        self.wait_s = 0.0
        self.bytes_received = self.messages = 0

    def recv(self, want: Tag) -> list[torch.Tensor]:
        """The payload of the next message, which must carry ``want`` (the drafter's own row)."""
        t0 = time.perf_counter()
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        self._take([header], want)
        kind, tag, specs = decode_header(header.cpu(), peer=f"{self.peer} (global rank {self.src})")
        bufs = [torch.empty(shape, dtype=dt, device=self.device) for dt, shape in specs]
        self._take(bufs, want)   # taken even on a mismatch: the sender is not left waiting
        if kind == KIND_DATA and tag != want:
            raise FormatError(f"{self.me}: {self.peer} sent the taps of {tag}, but this rank's manifest row is "
                              f"{want}; every rank must read the same --manifests, --plan and --data and resume from "
                              "the same checkpoint")
        if kind == KIND_STOP:
            reason = bytes(bufs[0].cpu().numpy()).decode(errors="replace") if bufs else "no reason given"
            raise LinkError(f"{self.me}: {self.peer} (global rank {self.src}) stopped before {want}: {reason}")
        self.wait_s += time.perf_counter() - t0
        self.messages += 1
        self.bytes_received += HEADER_LEN * 8 + sum(b.numel() * b.element_size() for b in bufs)
        return bufs

    def _take(self, bufs: list[torch.Tensor], want: Tag) -> None:
        """Receive into ``bufs`` in order; a dead or silent target is a one-line LinkError."""
        try:
            works = [dist.irecv(b, self.src) for b in bufs]
        except RuntimeError as e:   # gloo refuses to post on a pair its dead peer closed
            works, why = [], _why(e, self.timeout)
        else:
            why = None
        for w in works:
            why = why or wait_work(w, self.timeout)
        if why is not None:
            raise LinkError(f"{self.me}: {self.peer} (global rank {self.src}) sent nothing for {want}: {why}; it "
                            "stopped or died (see its log). Raise --target-timeout if it is only slow")
