"""Several OpenAI-compatible servers behind one engine: ``regenerate --base-url A --base-url B``.

:class:`ServerPool` holds one :class:`~.engines.OpenAIEngine` per URL and offers the same
``check`` / ``chat`` / ``stop`` / ``fatal`` / ``close`` the driver uses with one server; one
URL is a pool of one and behaves exactly as the engine alone (same requests, same errors).

- Start: every server is checked in the order named (``GET /v1/models``, as with one server);
  the first that cannot be reached stops the run with its own one-line error, which names its
  URL. The user named it, so a typo or a server not yet up is reported, not worked around.
  Servers that name other software or versions are allowed, with a warning: their answers at
  temperature 0 may differ, and each record names the server that answered it.
- Balancing: each request goes to the live server with the fewest requests in flight, ties to
  the one named first. Requests, not tokens: a prompt's token count is the server's to know
  (its tokenizer and chat template), and ``--concurrency N`` (the total in flight, across all
  servers) already bounds the work any one server holds. A faster server finishes its requests
  sooner and so is given more.
- Failover: a server is dead when a request to it fails on connection errors (refused, reset:
  the process is gone) through every retry, or times out through every retry and then does not
  answer ``GET /v1/models`` within :data:`PROBE_S` either (a slow request on a server that
  answers stays that record's ``timeout``, as a timeout always is with one server). A dead server is not asked again
  in this run; the request that found it dead, and each one in flight on it, is sent again, the
  whole turn, to a live server (its seed is the record's, :func:`~.engines.request_seed`, so at
  temperature 0 the answer is the one the dead server would have given). Only the reply a
  worker accepts enters its record, and the driver writes each record once, in input order, so
  nothing is lost or written twice. One line on stderr names the dead server. With no server
  left the run stops with the last one's error (with one server: exactly today's), and a resume
  continues where it stopped.
- Report: :meth:`ServerPool.report` (url, model, what it serves, software and version, the
  requests it answered, and why it died), kept in ``regenerate.json``'s ``stats.last_run``.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from dataclasses import dataclass
from typing import Callable

from dflash_prep.regenerate.engines import (EngineError, OpenAIEngine, Reply, Request, RequestFailed, Sampling,
                                            ServerDown)

PROBE_S = 30.0
"""Seconds a timed-out server has to answer ``GET /v1/models`` before it is taken for dead."""


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class _Server:
    engine: OpenAIEngine
    in_flight: int = 0
    answered: int = 0
    died: str | None = None
    """Why the server was taken for dead (its last error), None while it lives."""


class _StopAll:
    """``pool.stop``: setting it stops every server's workers (the driver sets it on its way out)."""

    def __init__(self, servers: list[_Server]):
        self._servers = servers

    def set(self) -> None:
        for s in self._servers:
            s.engine.stop.set()

    def is_set(self) -> bool:
        return all(s.engine.stop.is_set() for s in self._servers)


class ServerPool:
    """One or more OpenAI-compatible servers serving ``model``; :meth:`chat` is thread-safe."""

    def __init__(self, *, base_urls: tuple[str, ...] | list[str], model: str, sampling: Sampling,
                 timeout: float = 600.0, retries: int = 5, api_key: str | None = None,
                 warn: Callable[[str], None] = _stderr):
        if not base_urls:
            raise ValueError("ServerPool needs at least one --base-url")
        self.model, self.timeout, self.warn = model, float(timeout), warn
        self.servers = [_Server(OpenAIEngine(base_url=u, model=model, sampling=sampling, timeout=timeout,
                                             retries=retries, api_key=api_key)) for u in base_urls]
        self.stop = _StopAll(self.servers)
        self._lock = threading.Lock()
        self._fatal: EngineError | None = None

    @property
    def fatal(self) -> EngineError | None:
        """Why the run must stop: no server left, or an error no other server can help with
        (a model name a server does not serve); None while the run goes on."""
        if self._fatal is not None:
            return self._fatal
        return next((s.engine.fatal for s in self.servers
                     if s.died is None and s.engine.fatal is not None and not isinstance(s.engine.fatal, ServerDown)),
                    None)

    @property
    def server(self) -> dict:
        """The first server's identity (``software``, ``version``): the records' default."""
        return self.servers[0].engine.server

    def check(self) -> None:
        """Check every server in order; the first unreachable one raises its error. Warns when
        the servers name different software or versions."""
        for s in self.servers:
            s.engine.check()
        ids = {(s.engine.server["software"], s.engine.server["version"]) for s in self.servers}
        if len(ids) > 1:
            named = ", ".join(f"{s.engine.base_url} {s.engine.server['software'] or '?'} "
                              f"{s.engine.server['version'] or '?'}" for s in self.servers)
            self.warn(f"regenerate: warning: the servers differ ({named}); at temperature 0 their answers may "
                      "differ; each record names the server that answered it")

    def _pick(self) -> _Server:
        with self._lock:
            live = [s for s in self.servers if s.died is None]
            if self._fatal is not None or not live:
                raise self._fatal or EngineError("no server left")
            s = min(live, key=lambda x: x.in_flight)  # min keeps the first of equals: ties by order
            s.in_flight += 1
            return s

    def _dead(self, s: _Server, why: str, message: str) -> None:
        """Take ``s`` for dead (``why``: the failure, for the warning and the report; ``message``:
        the whole error, for the one that stops the run when no server is left)."""
        with self._lock:
            if s.died is not None:
                return
            s.died = why
            s.engine.stop.set()  # its other workers give up their retries and come back here
            live = [x for x in self.servers if x.died is None]
            if not live:
                err = s.engine.fatal if len(self.servers) == 1 and isinstance(s.engine.fatal, ServerDown) else None
                self._fatal = err or EngineError(
                    f"no server left: all {len(self.servers)} died; the last, {s.engine.base_url}: {message}")
                for x in self.servers:
                    x.engine.stop.set()
                return
        self.warn(f"regenerate: warning: server {s.engine.base_url} is down ({why}); its requests go to the "
                  f"{len(live)} other{'s' if len(live) > 1 else ''}: "
                  + ", ".join(x.engine.base_url for x in live))

    def chat(self, req: Request, what: str) -> Reply:
        """Answer ``req`` on the least busy live server; on a dead one, again on another."""
        while True:
            s = self._pick()
            try:
                reply = s.engine.chat(req, what)
            except EngineError as e:  # ServerDown, or the "stopped" of a server marked dead meanwhile
                if not (isinstance(e, ServerDown) or s.died is not None):
                    raise
                first = s.engine.fatal if isinstance(s.engine.fatal, ServerDown) else e
                self._dead(s, getattr(first, "reason", str(first)), str(first))
                continue
            except RequestFailed as e:  # with one server a timeout stays the record's, as it always was
                if e.kind != "timeout" or len(self.servers) == 1:
                    raise
                if s.died is None and s.engine.responds(min(PROBE_S, self.timeout)):
                    raise
                why = f"no answer within {self.timeout:g} s, nor to GET /models within {min(PROBE_S, self.timeout):g} s"
                self._dead(s, why, f"{e}; and GET /models gives no answer either")
                continue
            finally:
                with self._lock:
                    s.in_flight -= 1
            with self._lock:
                s.answered += 1
            return dataclasses.replace(reply, server=s.engine.server)

    def close(self) -> None:
        for s in self.servers:
            s.engine.close()

    def report(self) -> list[dict]:
        """Per server: url, model, what it lists, software, version, requests answered, why it died."""
        return [{"url": s.engine.base_url, "model": self.model, "listed": s.engine.listed,
                 "software": s.engine.server["software"], "version": s.engine.server["version"],
                 "requests": s.answered, "died": s.died} for s in self.servers]
