"""What a serving engine is to this project: one :class:`Backend` per engine, found by name.

The generic engine code (:mod:`dflash_prep.engine.env`, :mod:`~dflash_prep.engine.vllm_server`'s
runner, :mod:`~dflash_prep.engine.extract`, :mod:`~dflash_prep.engine.worker_pipe`,
:mod:`~dflash_prep.engine.states_stream`) never names an engine: it asks :func:`get` for the one a
command uses and reads these fields. Everything that is one engine's (its venv, its command line,
its metric names, its offline worker) is that engine's module (:mod:`.vllm`), registered in
:mod:`dflash_prep.engine.backends`. The trainer side of the same name is
:mod:`dflash_prep.train.engines`.

Standard library only: importing the registry starts no engine and imports no engine package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from dflash_prep.errors import ConfigError


@dataclass(frozen=True)
class Backend:
    """One serving engine (an instance per engine, :func:`register`)."""

    name: str
    """The engine's name: ``--target-engine NAME``, ``engine.name`` in a states cache's header and
    in an evaluation report, where its counters are the section of that name."""
    label: str
    """How messages name it (``vLLM``)."""
    python_var: str
    """The environment variable that points at a python whose environment holds the engine."""
    venv_dir: str
    """Else: its venv beside the checkout, ``<repo>/<venv_dir>/bin/python``."""
    make_target: str
    """The ``make`` target that builds that venv (every message about a missing engine names it)."""
    distributions: tuple[str, ...]
    """The distribution names that install it, in lookup order; the first one installed gives the
    version string (``"<distribution> <version>"``) a states cache and a report record."""
    server_command: Callable[..., list[str]]
    """``server_command(python, model, *, port, speculative_config, max_model_len, dtype,
    max_num_seqs (None: no flag, the engine's default), enforce_eager, seed, extra_args) -> argv``: its
    OpenAI-compatible server."""
    health_path: str
    """The server's readiness URL path (200 when it serves)."""
    spec_metrics: Mapping[str, str]
    """The Prometheus counters (``GET /metrics``) of its speculative decoding, by what they count:
    ``drafts``, ``draft_tokens``, ``accepted_tokens``, ``accepted_per_pos`` (labelled ``position``)."""
    log_wrappers: tuple[str, ...]
    """Its log lines that only wrap the root cause of a failed start (the reason is logged before
    them): a failure's message quotes the last exception line that is none of these."""
    methods: Mapping[str, str]
    """Our export kinds (dflash, dflash2, eagle3) -> its ``--speculative-config`` method names."""
    worker_module: str
    """The offline-engine worker that captures hidden states (run with the engine's python,
    :mod:`dflash_prep.engine.worker_pipe` speaks its protocol)."""
    quiet_env: Mapping[str, str]
    """Set on every engine process: offline, no usage reports."""
    server_env: Mapping[str, str]
    """Set on its server besides ``quiet_env``."""
    cpu_env: Mapping[str, str]
    """Defaults on a CPU build, under the caller's own environment (the KV cache's size)."""
    offline_args: Callable[[str], dict]
    """``offline_args(version) -> kwargs``: what its offline engine needs on that build (the
    caller's ``--engine-arg`` goes on top)."""
    reserved_args: frozenset[str]
    """Offline-engine arguments the states capture sets itself (an ``--engine-arg`` of one is refused)."""
    is_cpu_build: Callable[[str], bool]
    """Whether a version string is its CPU build."""


class Registry:
    """Named entries (each with a ``name``), in registration order: the serving engines here, their
    trainer sides in :mod:`dflash_prep.train.engines`. ``unknown(name, names)`` words the
    :class:`ConfigError` of a name that is not registered."""

    def __init__(self, unknown: Callable[[str, tuple[str, ...]], str]):
        self.entries: dict[str, object] = {}
        self.unknown = unknown

    def register(self, entry):
        """Make ``entry`` findable by ``entry.name`` (a second one of a name replaces it)."""
        self.entries[entry.name] = entry
        return entry

    def get(self, name: str):
        if name not in self.entries:
            raise ConfigError(self.unknown(name, self.names()))
        return self.entries[name]

    def names(self) -> tuple[str, ...]:
        return tuple(self.entries)


REGISTRY = Registry(lambda name, known: f"no serving engine named {name!r}; known: {', '.join(known)}")
register, get, names = REGISTRY.register, REGISTRY.get, REGISTRY.names
