"""The serving engines, found by name: ``backends.get("vllm")`` is a :class:`~.base.Backend`.

:mod:`.base` holds the protocol (the fields every engine provides) and the registry; one module
per engine fills it in: :mod:`.vllm`. Importing this package registers them; a second engine is
one more module here and one line below (docs/engines.md#adding-an-engine).
"""

from dflash_prep.engine.backends.base import Backend, get, names, register
from dflash_prep.engine.backends.vllm import VLLM

register(VLLM)

DEFAULT = VLLM.name
"""The engine of the commands that take no engine name (``extract``, ``evaluate``, ``--eval-every``)."""

__all__ = ["DEFAULT", "Backend", "get", "names", "register"]
