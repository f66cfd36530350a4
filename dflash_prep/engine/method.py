"""The speculative method an exported drafter asks vLLM for, read from its ``config.json`` alone.

The export's ``architectures`` picks vLLM's method (:data:`ARCHITECTURES`); anything else is refused
in one line. ``k`` (``num_speculative_tokens``): vLLM's DFlash proposer runs one query for the bonus
token and ``k`` mask queries (``num_query_per_req = 1 + k``, ``vllm/v1/spec_decode/dflash.py``), so a
drafter trained on blocks of B (anchor + B-1 slots) is served with ``k = B - 1`` (a smaller k uses
the first k slots; more than B-1 is refused: the drafter never learned those slots). EAGLE-3 chains
``k`` drafter passes, 7 by default.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dflash_prep.engine.backends.vllm import METHODS as VLLM_METHOD
from dflash_prep.errors import ConfigError, FormatError

ARCHITECTURES = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash2", "LlamaForCausalLMEagle3": "eagle3"}
"""Export architecture -> our kind. vLLM's method is ``dflash`` for both DFlash kinds (it tells a
DFlash2 export by its architecture) and ``eagle3``."""
EAGLE3_K = 7


@dataclass(frozen=True)
class Method:
    """How vLLM serves one export."""

    kind: str
    """dflash, dflash2 or eagle3 (our objectives)."""
    architecture: str
    k: int
    """``num_speculative_tokens``."""
    block_size: int | None
    """The drafter's trained block B (DFlash kinds); None for EAGLE-3."""

    def speculative_config(self, export: Path) -> dict:
        """The ``--speculative-config`` object (what users paste to serve the export)."""
        return {"method": VLLM_METHOD[self.kind], "model": str(export), "num_speculative_tokens": self.k}


def export_method(export: Path, k: int | None = None) -> Method:
    """The :class:`Method` of an export folder (module docstring); ``k`` None: the largest the
    drafter fills (B - 1), or :data:`EAGLE3_K`."""
    cfile = export / "config.json"
    if not cfile.is_file():
        raise FormatError(f"{cfile}: not found; point --export at an exported drafter folder "
                          "(python -m dflash_prep.train.export RUN --out DIR)")
    try:
        c = json.loads(cfile.read_text())
        archs = list(c.get("architectures") or [])
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, TypeError) as e:
        raise FormatError(f"{cfile}: not a JSON object with an architectures list ({e})") from None
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        known = ", ".join(f"{a} ({m})" for a, m in ARCHITECTURES.items())
        raise FormatError(f"{cfile}: architectures {archs} is not one this command serves; supported: {known}")
    kind = ARCHITECTURES[arch]
    if kind == "eagle3":
        k = EAGLE3_K if k is None else k
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
