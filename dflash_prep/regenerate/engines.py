"""Engines for ``regenerate``: who writes the assistant turns.

- :class:`OpenAIEngine` talks to a running inference server through its OpenAI-compatible
  ``POST /v1/chat/completions`` endpoint (vLLM, SGLang and ``transformers serve`` all speak
  it). Standard library only (``http.client``): one keep-alive connection per worker thread,
  so ``--concurrency N`` worker threads are exactly N requests in flight. Connection errors,
  timeouts, HTTP 429 and 5xx, and an answer cut off mid-body (shorter than its
  ``Content-Length``) are retried ``retries`` times with exponential backoff (0.5 s, 1 s,
  2 s ... capped at 30 s, +-25% jitter, a ``Retry-After`` header wins); other 4xx are a
  refusal and are not retried. A 200 whose body is not JSON or not a chat completion is
  ``bad_response`` (not retried: the server answered, wrongly).
- :class:`HFEngine` runs batched ``generate`` on a local transformers model in-process: for
  small jobs and CPU demos. Prompts are left-padded into batches of ``batch_size``; at
  temperature 0 each row is a greedy decode, which matches the server's batch-of-1 decode up
  to float rounding in padded attention (the tests compare them).

Both return a :class:`Reply` per request. What can go wrong is split in two:

- :class:`RequestFailed` (``kind`` = refused, timeout, server_error, bad_response, empty):
  one record failed (the message names its file, line and message); ``--on-error skip``
  counts it and goes on;
- :class:`EngineError`: the engine itself cannot work (unreachable server, a model name the
  server does not serve, a target folder that does not load); the run stops whatever
  ``--on-error`` says, since every further record would fail the same way. A resumed run
  continues where it stopped. An unreachable server is its subclass :class:`ServerDown`:
  with several servers (:mod:`.servers`) the others take its requests instead.

For that pool, :meth:`OpenAIEngine.check` also notes the model's :data:`IDENTITY` (what it
loaded, its context length), :meth:`OpenAIEngine.probe` asks ``GET /v1/models`` once with a
short timeout, :class:`RequestFailed` carries the HTTP status of a 5xx, and
:meth:`OpenAIEngine.abort` shuts every worker's connection, so a server given up is left at
once, not after ``timeout``.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import random
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from dflash_prep import errors
from dflash_prep.errors import DflashError
from dflash_prep.formats.target import is_digest_cache

FAILURE_KINDS = ("bad_input", "refused", "timeout", "server_error", "bad_response", "empty")
"""Per-record failure kinds, in the order the summary prints them."""

SERVER_SOFTWARE = ("vllm", "sglang")
"""Servers that name themselves in ``/v1/models``' ``owned_by``."""

BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 30.0
BODY_EXCERPT = 300  # characters of a server's error body quoted in a message
IDENTITY = ("root", "max_model_len")
"""What ``GET /v1/models`` says of the model beyond its name, where the server reports it: vLLM
puts the checkpoint it loaded (path or Hub id) in ``root`` and its context length in
``max_model_len``; SGLang and ``transformers serve`` report neither."""


class EngineError(errors.EngineError):
    """The engine cannot serve any record: fix the server, the model name or the target (the
    project's one :class:`~dflash_prep.errors.EngineError`, so a caller catches both kinds alike)."""


class ServerDown(EngineError):
    """The server stopped answering: connection errors (refused, reset) through every retry."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason or message
        """The failure alone (e.g. ``ConnectionRefusedError: ...; 6 tries``), for a warning."""


class RequestFailed(DflashError):
    """One request failed for a reason specific to it; counted under ``--on-error skip``."""

    def __init__(self, kind: str, message: str, status: int | None = None):
        super().__init__(message)
        self.kind = kind
        self.status = status
        """The HTTP status of the last try, when the server answered one (``server_error``, ``refused``)."""


@dataclass(frozen=True)
class Sampling:
    """Sampling settings sent with every request (and recorded in every output record)."""

    temperature: float = 0.0
    """0 = greedy."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    max_tokens: int = 1024
    """Most new tokens per assistant turn; a turn cut here has finish_reason ``length``."""
    seed: int | None = None
    """Base seed; each request gets :func:`request_seed` (record, message) from it."""
    extra_body: dict = field(default_factory=dict)
    """Extra request fields merged into every request body (server-specific: ``top_k``,
    ``min_p``, ``repetition_penalty`` on vLLM/SGLang)."""

    def __post_init__(self):
        if not 0.0 <= self.temperature <= 10.0:
            raise ValueError(f"--temperature must be in [0, 10], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if not isinstance(self.extra_body, dict):
            raise ValueError("--extra-body must be a JSON object")

    def record(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens,
                "seed": self.seed, "extra_body": self.extra_body}


def request_seed(seed: int | None, record: int, message: int) -> int | None:
    """A per-request seed, a pure function of (seed, record, message): 31 bits of SHA-256."""
    if seed is None:
        return None
    h = hashlib.sha256(f"{seed}:{record}:{message}".encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


@dataclass(frozen=True)
class Request:
    """One chat-completions call: the context so far and the settings."""

    messages: list
    seed: int | None
    enable_thinking: bool | None
    """``False`` under ``--reasoning disable`` (sent as chat-template kwarg), else not sent."""


@dataclass(frozen=True)
class Reply:
    content: str
    reasoning: str | None
    """Reasoning the server returned apart from the content (``reasoning_content``), if any."""
    finish_reason: str
    prompt_tokens: int | None
    completion_tokens: int | None
    token_ids: tuple[int, ...] | None = None
    """The generated ids, eos included (in-process engine only; not written to the output)."""
    server: dict | None = None
    """Which server answered (:attr:`OpenAIEngine.server`), set by :class:`.servers.ServerPool`."""


def _excerpt(data: bytes | str) -> str:
    s = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    s = " ".join(s.split())
    return s[:BODY_EXCERPT] + ("..." if len(s) > BODY_EXCERPT else "")


def _has_surrogates(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def parse_reply(data: bytes) -> Reply:
    """Parse a chat-completions response body; malformed or non-UTF-8 bodies raise
    ``RequestFailed('bad_response')``. An empty content is returned as is (the caller decides
    after reasoning handling)."""
    try:
        obj = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise RequestFailed("bad_response", f"the response body is not UTF-8 ({e}); the server returned "
                                            "broken text") from None
    except json.JSONDecodeError as e:
        raise RequestFailed("bad_response", f"the response is not JSON ({e.msg}): {_excerpt(data)}") from None
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise RequestFailed("bad_response", f"the response has no choices: {_excerpt(data)}")
    msg = choices[0].get("message")
    if not isinstance(msg, dict):
        raise RequestFailed("bad_response", f"the response's first choice has no message: {_excerpt(data)}")
    content = msg.get("content") or ""
    reasoning = msg.get("reasoning_content") or msg.get("reasoning") or None
    for name, val in (("content", content), ("reasoning_content", reasoning)):
        if val is not None and not isinstance(val, str):
            raise RequestFailed("bad_response", f"the response's {name} is a {type(val).__name__}, not text")
        if val and _has_surrogates(val):
            raise RequestFailed("bad_response", f"the response's {name} is not valid UTF-8 text (lone surrogate "
                                                "escapes); the server decoded tokens badly")
    usage = obj.get("usage") if isinstance(obj.get("usage"), dict) else {}
    ints = {k: usage.get(k) if isinstance(usage.get(k), int) else None for k in ("prompt_tokens", "completion_tokens")}
    return Reply(content, reasoning, str(choices[0].get("finish_reason") or "unknown"), **ints)


def chat_url(base_url: str) -> tuple[str, int, bool, str]:
    """``--base-url`` -> (host, port, https, path prefix ending in /v1)."""
    u = urlsplit(base_url if "://" in base_url else f"http://{base_url}")
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"--base-url must look like http://HOST:PORT/v1, got {base_url!r}")
    prefix = u.path.rstrip("/")
    if not prefix.endswith("/v1"):
        prefix += "/v1"
    return u.hostname, u.port or (443 if u.scheme == "https" else 80), u.scheme == "https", prefix


class OpenAIEngine:
    """Client of an OpenAI-compatible server; :meth:`chat` is thread-safe (one connection per thread)."""

    def __init__(self, *, base_url: str, model: str, sampling: Sampling, timeout: float = 600.0, retries: int = 5,
                 api_key: str | None = None):
        self.base_url, self.model, self.sampling = base_url, model, sampling
        self.host, self.port, self.https, self.prefix = chat_url(base_url)
        self.timeout, self.retries = float(timeout), int(retries)
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.stop = threading.Event()  # set on a fatal error: other workers stop retrying
        self.fatal: EngineError | None = None
        self._local = threading.local()
        self._conns: set[http.client.HTTPConnection] = set()  # every thread's connection, for abort()
        self._conns_lock = threading.Lock()
        self._rng = random.Random()  # backoff jitter only; never touches output
        self.listed: list[str] | None = None
        self.server: dict = {"software": None, "version": None}
        """What :meth:`check` found: ``software`` (``vllm`` or ``sglang`` when the model list says
        so in ``owned_by``; None otherwise: ``transformers serve`` puts the repo's namespace there)
        and ``version`` (the server's ``GET /version``), recorded in every record's provenance."""
        self.identity: dict = dict.fromkeys(IDENTITY)
        """What :meth:`check` found of the model (:data:`IDENTITY`), None where not reported."""
        self._model_confirmed = False

    # -- transport --------------------------------------------------------------------
    def _conn(self) -> http.client.HTTPConnection:
        c = getattr(self._local, "conn", None)
        if c is None:
            cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            c = cls(self.host, self.port, timeout=self.timeout)
            with self._conns_lock:
                if self.stop.is_set():  # given up (abort): no new connection to it
                    raise EngineError(f"{self.base_url}: stopped")
                self._conns.add(c)
            self._local.conn = c
        return c

    def _drop_conn(self) -> None:
        c = getattr(self._local, "conn", None)
        if c is not None:
            c.close()
            self._local.conn = None
            with self._conns_lock:
                self._conns.discard(c)

    def abort(self) -> None:
        """Give the server up: set :attr:`stop` and shut every thread's connection down, so a
        worker blocked reading an answer that will not come wakes now (end of stream), not after
        ``timeout``; it then raises instead of retrying. Safe to call again (a connection opened
        meanwhile is shut too)."""
        self.stop.set()
        with self._conns_lock:
            conns = list(self._conns)
        for c in conns:
            sock = getattr(c, "sock", None)
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:  # already closed by its own thread
                    pass

    def close(self) -> None:
        self._drop_conn()

    def _send(self, method: str, path: str, body: bytes | None, *, root: bool = False) -> tuple[int, dict, bytes]:
        """One request on this thread's connection; ``path`` is under ``/v1``, or under the
        server's root with ``root``."""
        path = (self.prefix[:-len("/v1")] if root else self.prefix) + path
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        reused = getattr(self._local, "conn", None) is not None
        c = self._conn()
        try:
            c.request(method, path, body=body, headers=headers)
            r = c.getresponse()
        except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
            if not reused:
                raise
            self._drop_conn()  # a kept-alive connection the server had closed: reconnect once, not a try
            c = self._conn()
            c.request(method, path, body=body, headers=headers)
            r = c.getresponse()
        data = r.read()
        if r.getheader("connection", "").lower() == "close":
            self._drop_conn()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, data

    def _fatal(self, message: str, kind: type[EngineError] = EngineError, **kw) -> EngineError:
        """Record the first fatal error and stop every worker; returns the error to raise."""
        err = kind(message, **kw)
        if self.fatal is None:
            self.fatal = err
        self.stop.set()
        return err

    def _backoff(self, attempt: int, retry_after: str | None) -> None:
        delay = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** attempt) * self._rng.uniform(0.75, 1.25)
        if retry_after and retry_after.strip().isdigit():
            delay = min(BACKOFF_CAP_S, float(retry_after))
        self.stop.wait(delay)

    def _call(self, method: str, path: str, body: bytes | None, what: str) -> tuple[int, bytes]:
        """Send with retries; returns (status, body) of the first non-retryable answer."""
        url = f"{'https' if self.https else 'http'}://{self.host}:{self.port}{self.prefix}{path}"
        last = ""
        for attempt in range(self.retries + 1):
            if self.stop.is_set():
                raise (type(self.fatal) if self.fatal else EngineError)(str(self.fatal) if self.fatal
                                                                        else f"{what}: stopped")
            retry_after = None
            try:
                status, headers, data = self._send(method, path, body)
            except (TimeoutError, socket.timeout):
                self._drop_conn()
                last = f"timeout: no answer within {self.timeout:g} s"
                if attempt == self.retries:
                    raise RequestFailed("timeout", f"{what}: {url} gave no answer within {self.timeout:g} s "
                                                   f"({self.retries + 1} tries); raise --timeout or lower "
                                                   "--max-tokens / --concurrency") from None
            except http.client.IncompleteRead as e:  # reached, but the answer broke off mid-body
                self._drop_conn()
                last = f"{type(e).__name__}: {e}"
                if attempt == self.retries:
                    raise RequestFailed("server_error", f"{what}: {url} cut its answer off mid-body ({last}; "
                                                        f"{self.retries + 1} tries); check the server's log") from None
            except (OSError, http.client.HTTPException) as e:
                self._drop_conn()
                last = f"{type(e).__name__}: {e}"
            else:
                if status < 500 and status != 429:
                    return status, data
                last = f"HTTP {status}: {_excerpt(data)}"
                retry_after = headers.get("retry-after")
                if attempt == self.retries:
                    raise RequestFailed("server_error", f"{what}: {url} answered {last} ({self.retries + 1} tries); "
                                                        "check the server's log", status)
            if attempt < self.retries:
                self._backoff(attempt, retry_after)
        raise self._fatal(f"{what}: cannot reach the server at {url} ({last}; {self.retries + 1} tries). Start "
                          "the server, or fix --base-url (e.g. http://127.0.0.1:8000/v1)", ServerDown,
                          reason=f"{last}; {self.retries + 1} tries")

    # -- API --------------------------------------------------------------------------
    def check(self) -> None:
        """Reach ``GET /v1/models`` (fails fast on an unreachable server), note what it lists, and
        identify the server (:attr:`server`)."""
        status, data = self._call("GET", "/models", None, "listing models")
        if status != 200:
            raise EngineError(f"{self.base_url}: GET /models answered HTTP {status}: {_excerpt(data)}; is this an "
                              "OpenAI-compatible server? (vLLM, SGLang and `transformers serve` are)")
        try:
            models = [m for m in json.loads(data)["data"] if isinstance(m, dict)]
        except (ValueError, KeyError, TypeError):
            models = []
        listed = [m.get("id") for m in models]
        self.listed = listed
        self._model_confirmed = self.model in listed
        entry = next((m for m in models if m.get("id") == self.model), {})
        self.identity = {k: entry.get(k) for k in IDENTITY}
        owner = entry.get("owned_by")
        self.server = {"software": owner if owner in SERVER_SOFTWARE else None, "version": self._server_version()}

    def probe(self, timeout: float) -> str | None:
        """Why the server does not answer ``GET /v1/models`` within ``timeout`` seconds (one try,
        on a connection of its own), or None when it answers: tells a dead server from one that
        is only slow on one request. An answer of 5xx counts as none (a proxy whose backend is
        gone answers 502/503); any other status is the server answering."""
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        c = cls(self.host, self.port, timeout=timeout)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            c.request("GET", self.prefix + "/models", headers=headers)
            r = c.getresponse()
            r.read()
        except (TimeoutError, socket.timeout):
            return f"no answer to GET /models within {timeout:g} s"
        except (OSError, http.client.HTTPException) as e:
            return f"GET /models: {type(e).__name__}: {e}"
        finally:
            c.close()
        return f"GET /models answered HTTP {r.status}" if r.status >= 500 else None

    def _server_version(self) -> str | None:
        """``GET /version`` at the server's root (vLLM and SGLang answer ``{"version": ...}``); None
        when the server has no such endpoint or answers anything else. One try: it only labels."""
        try:
            status, _, data = self._send("GET", "/version", None, root=True)
            version = json.loads(data).get("version") if status == 200 else None
        except (OSError, http.client.HTTPException, ValueError, AttributeError):
            self._drop_conn()
            return None
        return str(version) if isinstance(version, (str, int, float)) else None

    def _wrong_model(self, status: int, data: bytes) -> EngineError:
        served = ", ".join(repr(m) for m in self.listed) if self.listed else "(none listed)"
        return self._fatal(f"model {self.model!r} is not served at {self.base_url}: it lists {served} and answered "
                           f"HTTP {status}: {_excerpt(data)}. Pass --model with a served name")

    def chat(self, req: Request, what: str) -> Reply:
        s = self.sampling
        body = {"model": self.model, "messages": req.messages, "max_tokens": s.max_tokens,
                "temperature": s.temperature, "top_p": s.top_p, "stream": False}
        if req.seed is not None:
            body["seed"] = req.seed
        if req.enable_thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": req.enable_thinking}
        body.update(s.extra_body)
        status, data = self._call("POST", "/chat/completions", json.dumps(body).encode(), what)
        if status != 200:
            if not self._model_confirmed and status in (400, 404):
                raise self._wrong_model(status, data)
            raise RequestFailed("refused", f"{what}: the server refused the request, HTTP {status}: "
                                           f"{_excerpt(data)}")
        self._model_confirmed = True
        try:
            return parse_reply(data)
        except RequestFailed as e:  # the record's location, as every other failure of a request names it
            raise RequestFailed(e.kind, f"{what}: {e}; check the server's log") from None


def target_revision(path: Path) -> str:
    """Revision of a local model folder: the Hub commit of an HF cache snapshot
    (``.../snapshots/<commit>``), else a fingerprint of its small files' bytes (config,
    tokenizer, generation config) and its weight files' names and sizes (cheap at any size); the
    digest cache dflash-prep keeps there (formats/target.py) left out."""
    path = Path(path).resolve()
    if path.parent.name == "snapshots" and len(path.name) == 40:
        return path.name
    h = hashlib.sha256()
    for f in sorted(p for p in path.iterdir() if p.is_file() and not is_digest_cache(p)):
        h.update(f.name.encode() + b"\0")
        if f.stat().st_size <= 4 << 20:
            h.update(f.read_bytes())
        else:
            h.update(str(f.stat().st_size).encode())
    return "local-" + h.hexdigest()[:16]


class HFEngine:
    """Batched in-process ``generate`` with a local transformers model (CPU or one GPU)."""

    def __init__(self, *, target: Path, sampling: Sampling, batch_size: int = 8, device: str = "auto"):
        try:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as e:
            raise EngineError(f"--engine hf needs torch and transformers ({e}); pip install 'dflash-prep[train,chat]'") from None
        target = Path(target)
        if not (target / "config.json").is_file():
            raise EngineError(f"{target}: not a transformers model folder (no config.json); pass --target DIR")
        self.torch, self.sampling, self.batch_size = torch, sampling, int(batch_size)
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        try:
            self.tok = AutoTokenizer.from_pretrained(target)
            self.model = AutoModelForCausalLM.from_pretrained(target, dtype="auto").to(self.device).eval()
        except (OSError, ValueError) as e:
            raise EngineError(f"{target}: cannot load the model or tokenizer ({e})") from None
        if self.tok.chat_template is None:
            raise EngineError(f"{target}: the tokenizer has no chat template; regenerate needs one")
        eos = self.model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos] if eos is not None else [self.tok.eos_token_id]
        self.eos = {int(e) for e in eos if e is not None}
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else min(self.eos)
        self.name = str(target)
        self.revision = target_revision(target)

    def _prompt_ids(self, req: Request) -> list[int]:
        kwargs = {} if req.enable_thinking is None else {"enable_thinking": req.enable_thinking}
        out = self.tok.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=True,
                                           return_dict=True, **kwargs)
        return list(out["input_ids"])

    def chat_batch(self, reqs: list[Request]) -> list[Reply]:
        """Generate one reply per request, ``batch_size`` at a time (left padding).

        Sampled batches draw from ``torch.manual_seed(request_seed of the batch's first
        request)`` inside a forked RNG, so sampled text depends on the batch composition;
        greedy text does not (up to float rounding)."""
        torch, s = self.torch, self.sampling
        replies: list[Reply] = []
        for b in range(0, len(reqs), self.batch_size):
            batch = reqs[b:b + self.batch_size]
            ids = [self._prompt_ids(r) for r in batch]
            width = max(map(len, ids))
            input_ids = torch.tensor([[self.pad] * (width - len(x)) + x for x in ids], device=self.device)  # (B, L)
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=self.device)  # (B, L)
            gen = self.model.generation_config.to_dict()
            gen.update(max_new_tokens=s.max_tokens, do_sample=s.temperature > 0, pad_token_id=self.pad)
            if s.temperature > 0:
                gen.update(temperature=s.temperature, top_p=s.top_p)
            else:
                gen.update(temperature=None, top_p=None, top_k=None)
            from transformers import GenerationConfig

            seed = batch[0].seed if batch[0].seed is not None else 0
            dev = torch.device(self.device)
            ids_kw = {"devices": []} if dev.type == "cpu" else {"devices": [dev.index or 0], "device_type": dev.type}
            with torch.random.fork_rng(**ids_kw):  # sampling never moves the caller's RNG state
                torch.manual_seed(seed)
                with torch.no_grad():
                    seqs = self.model.generate(input_ids=input_ids, attention_mask=mask,
                                               generation_config=GenerationConfig(**gen))
            for row, x in zip(seqs[:, width:].tolist(), ids):
                cut = next((i + 1 for i, t in enumerate(row) if t in self.eos), len(row))
                out = row[:cut]
                text = self.tok.decode(out, skip_special_tokens=True)
                finish = "length" if len(out) >= s.max_tokens else "stop"
                replies.append(Reply(text, None, finish, len(x), len(out), tuple(out)))
        return replies
