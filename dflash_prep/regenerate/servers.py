"""Several OpenAI-compatible servers behind one engine: ``regenerate --base-url A --base-url B``.

:class:`ServerPool` holds one :class:`~.engines.OpenAIEngine` per URL and offers the same
``check`` / ``chat`` / ``stop`` / ``fatal`` / ``close`` the driver uses with one server; one
URL is a pool of one and behaves exactly as the engine alone (same requests, same errors, no
watchdog). What follows is for several.

- Start: every server is probed at once (``GET /v1/models``, one try, :data:`PROBE_S`); one that
  does not answer (refused, silent, or 5xx: a proxy whose backend is gone) is skipped for the
  run with one line on stderr, and the others start it. Then each answering server is checked
  as one server is. The run is refused only when none answers. A server that answers but is
  not an OpenAI-compatible server, or is refused otherwise, stops the run as with one server.
- Same model: each server's entry for ``--model`` in ``GET /v1/models`` is compared on
  :data:`~.engines.IDENTITY`, ``root`` (the checkpoint vLLM loaded) and ``max_model_len``, where
  two servers both report a field: a difference is refused in one line naming both servers and
  the field, since their answers would mix two targets. A server that reports nothing (SGLang,
  ``transformers serve``) cannot be compared and is taken on trust. Servers that name other
  software or versions are allowed, with a warning: their answers at temperature 0 may differ,
  and each turn of each record names the software and version of the server that wrote it.
- Balancing: each request goes to the live server with the fewest requests in flight, ties to
  the one named first. Requests, not tokens: a prompt's token count is the server's to know
  (its tokenizer and chat template), and ``--concurrency N`` (the total in flight, across all
  servers) already bounds the work any one server holds. A faster server finishes its requests
  sooner and so is given more.
- Failover: a server is dead when

  - a request to it fails on connection errors (refused, reset: the process is gone) through
    every retry;
  - :data:`DEAD_AFTER_5XX` requests in a row (no answer between) get 502, 503 or 504 through
    every retry: a proxy or load balancer in front of a backend that is gone. Each such request
    is handed on at once to a live server that has not answered it so, whether or not its server
    is dead yet; only when every live server answers it so is it the record's ``server_error``.
    A 500 stays the record's (the server ran the request and failed on it);
  - a request is stuck: in flight longer than max(:data:`STALL_FLOOR_S`, :data:`STALL_FACTOR` x
    the p90 of the pool's last :data:`STALL_WINDOW` completed request times), and its server
    then does not answer ``GET /v1/models`` within :data:`PROBE_S`. A watchdog thread looks
    every :data:`WATCH_S`. Why this limit: request times scale with ``--max-tokens`` and the
    servers' load, so a fixed limit is either too slow for short answers or too eager for long
    ones; 3 x p90 is passed only by the longest few generations of a live server, and for
    those the probe answers in milliseconds (a false suspicion costs one ``GET``; the request
    goes on), so the limit can be this tight. The 60 s floor keeps the first requests, before
    any p90 exists, and runs of very short answers from probing on every hiccup. A hung host
    is then noticed after max(60 s, 3 x p90) + at most 30 s, not after ``--timeout`` x
    (``--retries`` + 1): an hour at the defaults, while the in-order writer waits on its record;
  - a request times out through every retry and then ``GET /v1/models`` gets no answer within
    :data:`PROBE_S` either (a slow request on a server that answers stays that record's
    ``timeout``, as a timeout always is with one server).

  A dead server is not asked again in this run: its connections are shut down
  (:meth:`~.engines.OpenAIEngine.abort`), so the workers waiting on it wake now, and the request
  that found it dead, and each one in flight on it, is sent again, the whole turn, to a live
  server (its seed is the record's, :func:`~.engines.request_seed`, so at temperature 0 the
  answer is the one the dead server would have given). Only the reply a worker accepts enters
  its record, and the driver writes each record once, in input order, so nothing is lost or
  written twice. One line on stderr names the dead server. With no server left the run stops
  with the last one's error (with one server: exactly today's), and a resume continues where it
  stopped.
- Report: :meth:`ServerPool.report` (url, model, what it lists, ``root`` and ``max_model_len``,
  software and version, the requests it answered, and why it died or was skipped), kept in
  ``regenerate.json``'s ``stats.last_run``.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from dflash_prep.regenerate.engines import (IDENTITY, EngineError, OpenAIEngine, Reply, Request, RequestFailed,
                                            Sampling, ServerDown)

PROBE_S = 30.0
"""Seconds a server has to answer ``GET /v1/models`` (at start, or when suspect) before it is taken for dead."""
GATEWAY_5XX = (502, 503, 504)
"""Statuses that say the server cannot serve now, not that the request is bad."""
DEAD_AFTER_5XX = 3
"""Requests in a row answered :data:`GATEWAY_5XX` through every retry that mark their server dead."""
STALL_FLOOR_S = 60.0
"""A request in flight this long at least (else :data:`STALL_FACTOR` x p90) makes its server suspect."""
STALL_FACTOR = 3.0
STALL_WINDOW = 256
"""Completed request times (the pool's latest) the p90 is taken over."""
WATCH_S = 1.0
"""Seconds between two looks of the watchdog."""


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass(eq=False)
class _Server:
    engine: OpenAIEngine
    in_flight: dict = field(default_factory=dict)
    """Request token -> the monotonic time it was sent, for each request in flight on it."""
    answered: int = 0
    died: str | None = None
    """Why the server was taken for dead or skipped at start, None while it lives."""
    failed_5xx: int = 0
    """Requests in a row answered :data:`GATEWAY_5XX` through every retry."""
    probed_at: float = float("-inf")
    probing: bool = False


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
        self._times: collections.deque = collections.deque(maxlen=STALL_WINDOW)  # completed requests, s
        self._closed = threading.Event()
        self._watchdog: threading.Thread | None = None

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
        """The first live server's identity (``software``, ``version``): the records' default."""
        return next((s for s in self.servers if s.died is None), self.servers[0]).engine.server

    def _live(self) -> list[_Server]:
        return [s for s in self.servers if s.died is None]

    # -- start ------------------------------------------------------------------------
    def check(self) -> None:
        """One server: its own check. Several: skip those that do not answer, refuse when none
        does or when two serve different models, warn when their software or versions differ,
        and start the watchdog."""
        if len(self.servers) == 1:
            self.servers[0].engine.check()
            return
        probe_s = min(PROBE_S, self.timeout)
        with ThreadPoolExecutor(len(self.servers), thread_name_prefix="regenerate-probe") as ex:
            silent = list(ex.map(lambda s: s.engine.probe(probe_s), self.servers))
        for s, why in zip(self.servers, silent):
            if why is None:
                try:
                    s.engine.check()
                except (ServerDown, RequestFailed) as e:  # gone since the probe, or 5xx through the retries
                    why = getattr(e, "reason", str(e))
            if why is not None:
                s.died = f"down at start: {why}"
                s.engine.abort()
        live = self._live()
        if not live:
            raise EngineError(f"listing models: none of the {len(self.servers)} servers answers: "
                              + "; ".join(f"{s.engine.base_url} ({s.died})" for s in self.servers)
                              + ". Start them, or fix --base-url (e.g. http://127.0.0.1:8000/v1)")
        others = f"{len(live)} other{'s' if len(live) > 1 else ''}: " + ", ".join(x.engine.base_url for x in live)
        for s in self.servers:
            if s.died is not None:
                self.warn(f"regenerate: warning: server {s.engine.base_url} is {s.died}; the run starts on "
                          f"the {others}")
        self._same_model(live)
        ids = {(s.engine.server["software"], s.engine.server["version"]) for s in live}
        if len(ids) > 1:
            named = ", ".join(f"{s.engine.base_url} {s.engine.server['software'] or '?'} "
                              f"{s.engine.server['version'] or '?'}" for s in live)
            self.warn(f"regenerate: warning: the servers differ ({named}); at temperature 0 their answers may "
                      "differ; each turn of each record names the server that wrote it")
        self._watchdog = threading.Thread(target=self._watch, name="regenerate-watchdog", daemon=True)
        self._watchdog.start()

    def _same_model(self, live: list[_Server]) -> None:
        """Refuse two servers that report different :data:`~.engines.IDENTITY` fields."""
        for name in IDENTITY:
            told = [s for s in live if s.engine.identity.get(name) is not None]
            for s in told[1:]:
                a, b = told[0].engine, s.engine
                if b.identity[name] != a.identity[name]:
                    raise EngineError(
                        f"the servers serve different models: {a.base_url} reports {name} {a.identity[name]!r}, "
                        f"{b.base_url} reports {name} {b.identity[name]!r} for {self.model!r}; point every "
                        "--base-url at servers of one checkpoint (same path) and one --max-model-len")

    # -- failover ---------------------------------------------------------------------
    def _pick(self, tried: list[_Server]) -> tuple[_Server | None, object]:
        """The least busy live server not in ``tried`` (None when every live one is), and a token
        for its request in flight."""
        with self._lock:
            live = self._live()
            if self._fatal is not None or not live:
                raise self._fatal or EngineError("no server left")
            untried = [x for x in live if x not in tried]
            if not untried:
                return None, None
            s = min(untried, key=lambda x: len(x.in_flight))  # min keeps the first of equals: ties by order
            token = object()
            s.in_flight[token] = time.monotonic()
            return s, token

    def _dead(self, s: _Server, why: str, message: str) -> None:
        """Take ``s`` for dead (``why``: the failure, for the warning and the report; ``message``:
        the whole error, for the one that stops the run when no server is left)."""
        with self._lock:
            if s.died is not None:
                return
            s.died = why
            live = self._live()
            if not live:
                err = s.engine.fatal if len(self.servers) == 1 and isinstance(s.engine.fatal, ServerDown) else None
                self._fatal = err or EngineError(
                    f"no server left: all {len(self.servers)} died; the last, {s.engine.base_url}: {message}")
        if len(self.servers) > 1:  # one server stops as it always has: its fatal error sets its stop
            s.engine.abort()  # its workers stop retrying or waiting, and come back here
        if not live:
            self.stop.set()
            return
        self.warn(f"regenerate: warning: server {s.engine.base_url} is down ({why}); its requests go to the "
                  f"{len(live)} other{'s' if len(live) > 1 else ''}: " + ", ".join(x.engine.base_url for x in live))

    def _handed_on(self, s: _Server, e: RequestFailed, tried: list[_Server]) -> bool:
        """Whether a request that failed on ``s`` goes to another server (True), or fails (False)."""
        if len(self.servers) == 1:
            return False
        if s.died is not None:  # its connection was shut under the request: not the request's fault
            return True
        if e.kind == "timeout":  # with one server a timeout stays the record's, as it always was
            probe_s = min(PROBE_S, self.timeout)
            if s.engine.probe(probe_s) is None:
                return False
            self._dead(s, f"no answer within {self.timeout:g} s, nor to GET /models within {probe_s:g} s",
                       f"{e}; and GET /models gives no answer either")
            return True
        if e.status not in GATEWAY_5XX:
            return False
        with self._lock:
            s.failed_5xx += 1
            tried.append(s)
            n, others = s.failed_5xx, any(x.died is None and x not in tried for x in self.servers)
        if n >= DEAD_AFTER_5XX:
            self._dead(s, f"HTTP {e.status} to {n} requests in a row, each through "
                          f"{s.engine.retries + 1} tries", str(e))
        return others

    def chat(self, req: Request, what: str) -> Reply:
        """Answer ``req`` on the least busy live server; on a dead one, again on another; after
        502/503/504 through every retry, again on one that has not answered it so."""
        tried: list[_Server] = []
        failed: RequestFailed | None = None
        while True:
            s, token = self._pick(tried)
            if s is None:  # every live server answered it 502/503/504: the record's server_error
                raise failed
            try:
                reply = s.engine.chat(req, what)
            except EngineError as e:  # ServerDown, or the "stopped" of a server marked dead meanwhile
                if not (isinstance(e, ServerDown) or s.died is not None):
                    raise
                first = s.engine.fatal if isinstance(s.engine.fatal, ServerDown) else e
                self._dead(s, getattr(first, "reason", str(first)), str(first))
                continue
            except RequestFailed as e:
                if self._handed_on(s, e, tried):
                    failed = e
                    continue
                raise
            finally:
                with self._lock:
                    sent = s.in_flight.pop(token)
            with self._lock:
                s.answered += 1
                s.failed_5xx = 0
                self._times.append(time.monotonic() - sent)
            return dataclasses.replace(reply, server=s.engine.server)

    # -- watchdog ---------------------------------------------------------------------
    def stall_limit(self) -> float:
        """Seconds in flight past which a request makes its server suspect (module docstring)."""
        with self._lock:
            times = sorted(self._times)
        p90 = times[int(0.9 * (len(times) - 1))] if times else 0.0
        return max(STALL_FLOOR_S, STALL_FACTOR * p90)

    def _watch(self) -> None:
        """Every :data:`WATCH_S`: probe each live server holding a stuck request (at most once per
        limit, in a thread of its own), and shut the connections of dead ones again."""
        while not self._closed.wait(WATCH_S):
            limit, now = self.stall_limit(), time.monotonic()
            if limit >= self.timeout:  # --timeout comes first: the timeout path probes
                continue
            with self._lock:
                suspects = [(s, now - min(s.in_flight.values())) for s in self._live()
                            if s.in_flight and not s.probing and now - min(s.in_flight.values()) > limit
                            and now - s.probed_at > limit]
                for s, _ in suspects:
                    s.probing, s.probed_at = True, now
                gone = [s for s in self.servers if s.died is not None and s.in_flight]
            for s in gone:  # a connection opened as it died
                s.engine.abort()
            for s, stuck in suspects:
                threading.Thread(target=self._probe_stuck, args=(s, stuck, limit), daemon=True,
                                 name="regenerate-probe").start()

    def _probe_stuck(self, s: _Server, stuck: float, limit: float) -> None:
        why = s.engine.probe(min(PROBE_S, self.timeout))
        with self._lock:
            s.probing = False
        if why is None:  # alive: the request is only long, and goes on
            return
        self._dead(s, f"a request in flight {stuck:.1f} s, past the pool's limit of {limit:.1f} s, and {why}",
                   f"a request in flight {stuck:.1f} s and {why}")

    def close(self) -> None:
        self._closed.set()
        if self._watchdog is not None:
            self._watchdog.join()
        for s in self.servers:
            s.engine.close()

    def report(self) -> list[dict]:
        """Per server: url, model, what it lists, root and max_model_len, software, version,
        requests answered, why it died (or was skipped at start)."""
        return [{"url": s.engine.base_url, "model": self.model, "listed": s.engine.listed, **s.engine.identity,
                 "software": s.engine.server["software"], "version": s.engine.server["version"],
                 "requests": s.answered, "died": s.died} for s in self.servers]
