"""The speculative method an exported drafter asks vLLM for, read from its ``config.json`` alone.

The export's ``architectures`` finds the objective whose exports declare it (its registration's
:class:`~dflash_prep.objectives.serving.Serving`, :func:`dflash_prep.objectives.served`), and so
vLLM's method; anything else is refused in one line. ``k`` (``num_speculative_tokens``): vLLM's
DFlash proposer runs one query for the bonus token and ``k`` mask queries (``num_query_per_req = 1 +
k``, ``vllm/v1/spec_decode/dflash.py``), so a drafter trained on blocks of B (anchor + B-1 slots) is
served with ``k = B - 1`` (a smaller k uses the first k slots; more than B-1 is refused: the drafter
never learned those slots). A chain drafter (EAGLE-3) chains ``k`` drafter passes, its
``Serving.chain_k`` (7) by default.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dflash_prep import objectives
from dflash_prep.engine.backends.vllm import METHODS as VLLM_METHOD
from dflash_prep.errors import ConfigError, FormatError
from dflash_prep.objectives.serving import Serving


@dataclass(frozen=True)
class Method:
    """How vLLM serves one export."""

    kind: str
    """The objective whose exports declare :attr:`architecture` (dflash, dflash2, eagle3)."""
    architecture: str
    k: int
    """``num_speculative_tokens``."""
    block_size: int | None
    """The drafter's trained block B (DFlash kinds); None for a chain drafter (EAGLE-3)."""

    @property
    def serving(self) -> Serving:
        """How the engine serves it: its objective's registration."""
        return objectives.get(self.kind).serving

    def speculative_config(self, export: Path) -> dict:
        """The ``--speculative-config`` object (what users paste to serve the export)."""
        return {"method": VLLM_METHOD[self.kind], "model": str(export), "num_speculative_tokens": self.k}


def export_method(export: Path, k: int | None = None) -> Method:
    """The :class:`Method` of an export folder (module docstring); ``k`` None: the largest the
    drafter fills (B - 1), or a chain drafter's ``Serving.chain_k``."""
    cfile = export / "config.json"
    if not cfile.is_file():
        raise FormatError(f"{cfile}: not found; point --export at an exported drafter folder "
                          "(python -m dflash_prep.train.export RUN --out DIR)")
    try:
        c = json.loads(cfile.read_text())
        archs = list(c.get("architectures") or [])
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, TypeError) as e:
        raise FormatError(f"{cfile}: not a JSON object with an architectures list ({e})") from None
    served = objectives.served()
    arch = next((a for a in archs if a in served), None)
    if arch is None:
        known = ", ".join(f"{a} ({o.name})" for a, o in served.items())
        raise FormatError(f"{cfile}: architectures {archs} is not one this command serves; supported: {known}")
    kind, chain_k = served[arch].name, served[arch].serving.chain_k
    if chain_k is not None:
        k = chain_k if k is None else k
        if k < 1:
            raise ConfigError(f"--num-speculative-tokens must be >= 1, got {k}")
        return Method(kind, arch, k, None)
    dfc = c.get("dflash_config") or {}
    B = dfc.get("block_size") if dfc.get("block_size") is not None else c.get("block_size")
    if not isinstance(B, int) or B < 2:
        raise FormatError(f"{cfile}: no block_size >= 2 (dflash_config.block_size or block_size), got {B!r}")
    k = B - 1 if k is None else k
    if not 1 <= k <= B - 1:
        raise ConfigError(f"--num-speculative-tokens {k}: a DFlash drafter of block {B} fills at most {B - 1} slots "
                          f"after the bonus token (vLLM runs 1 + k queries); pass 1..{B - 1}")
    return Method(kind, arch, k, B)
