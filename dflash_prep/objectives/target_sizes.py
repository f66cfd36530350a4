"""The target model's sizes, read once for every drafter cost model (:mod:`.drafter_cost`).

From a transformers ``config.json`` (``--target-config``: a folder or the file; a multimodal
config's ``text_config``) or from ``--target-dims name=value,...``. :class:`TargetSizes` holds
the seven sizes and the target's parameter count; the DFlash, DFlash2 and EAGLE-3 cost
models extend it with their drafters' sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from dflash_prep.errors import ConfigError
from dflash_prep.formats.target import read_target_config

#: The fields of a transformers config.json this model reads, and their names there.
CONFIG_KEYS = {"hidden": "hidden_size", "layers": "num_hidden_layers", "intermediate": "intermediate_size",
               "heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "head_dim": "head_dim",
               "vocab": "vocab_size"}


def config_sizes(folder: str | Path) -> dict:
    """The seven :data:`CONFIG_KEYS` sizes of a transformers ``config.json`` (a folder or the file),
    read and checked by :func:`~dflash_prep.formats.target.read_target_config`; ``head_dim`` and
    ``num_key_value_heads`` default as in transformers."""
    cfg = read_target_config(folder, model_type=False,
                             fix="pass --target-config DIR holding the target's config.json, or --target-dims")
    vals = {ours: cfg.get(theirs) for ours, theirs in CONFIG_KEYS.items()}
    if vals["head_dim"] is None:
        vals["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    if vals["kv_heads"] is None:
        vals["kv_heads"] = cfg["num_attention_heads"]
    return {k: int(v) for k, v in vals.items()}


def dims_sizes(spec: str) -> dict:
    """The seven sizes of ``--target-dims``, e.g.
    ``"hidden=4096,layers=36,intermediate=12288,heads=32,kv_heads=8,head_dim=128,vocab=151936"``."""
    vals = {}
    for part in spec.split(","):
        k, sep, v = part.strip().partition("=")
        if not sep or k not in CONFIG_KEYS:
            raise ConfigError(f"--target-dims {spec!r}: write name=value pairs with names {', '.join(CONFIG_KEYS)}")
        try:
            vals[k] = int(v)
        except ValueError:
            raise ConfigError(f"--target-dims: {k}={v!r} is not an integer") from None
    missing = [k for k in CONFIG_KEYS if k not in vals]
    if missing:
        raise ConfigError(f"--target-dims {spec!r} lacks {', '.join(missing)}")
    return vals


@dataclass(frozen=True)
class TargetSizes:
    """The target model's sizes every drafter cost model reads.

    Attributes:
        hidden: the target's d_model ``H`` (the drafter shares it).
        layers: target decoder layers.
        intermediate: SwiGLU width.
        heads: query heads ``h``.
        kv_heads: key/value heads ``h_kv``.
        head_dim: ``d``.
        vocab: ``V``, the LM head's rows.
    """

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    def __post_init__(self):
        for f in fields(self):
            if int(getattr(self, f.name)) < 1:
                raise ConfigError(f"cost model: {f.name} must be >= 1, got {getattr(self, f.name)}")

    @classmethod
    def from_config(cls, folder: str | Path, **extra):
        """Sizes from a transformers ``config.json`` (a folder or the file itself), plus ``extra`` fields."""
        return cls(**config_sizes(folder), **extra)

    @classmethod
    def from_dims(cls, spec: str, **extra):
        """Sizes from ``--target-dims`` (:func:`dims_sizes`), plus ``extra`` fields."""
        return cls(**dims_sizes(spec), **extra)

    def sizes(self) -> dict:
        """The seven sizes by name (what :class:`TargetSizes` of them takes)."""
        return {k: getattr(self, k) for k in CONFIG_KEYS}

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer: q, k, v, o projections and the SwiGLU MLP."""
        H, hd = self.hidden, self.head_dim
        return H * self.heads * hd * 2 + H * self.kv_heads * hd * 2 + 3 * H * self.intermediate

    @property
    def target_params(self) -> int:
        return self.layers * self.layer_params
