"""One exception family for everything a user can get wrong.

Every message says what is wrong, where (file, line or record), and how to fix it.
Only the CLI turns these into ``typer.Exit(1)``; library callers catch ``DflashError``.
"""

from __future__ import annotations


class DflashError(Exception):
    """Base class: a user-facing error whose message explains the fix."""


class InputError(DflashError):
    """Bad input data: a malformed record, a missing field, an unreadable file."""


class ConfigError(DflashError, ValueError):
    """An invalid option or combination of options."""


class FormatError(DflashError):
    """A file on disk has the wrong format name, an unknown version, or is corrupt."""


class FingerprintMismatch(DflashError):
    """Two artefacts that must belong together do not (e.g. a plan from another dataset)."""


class UpToDate(DflashError):
    """The requested output already exists for the same inputs; nothing was done."""


class EngineError(DflashError):
    """A serving engine (vLLM) is not installed, refuses a model or an export, or dies: the message
    keeps the engine's own words and names the fix (e.g. ``make venv-vllm``). ``regenerate``'s
    engine errors are a kind of it."""
