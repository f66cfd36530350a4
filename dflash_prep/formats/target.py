"""A target folder's identity: the fingerprints a run contract and a states cache record.

:func:`target_identity`: sha256 of config.json and every weight file (``target_fingerprint``),
of the tokenizer files, and of the chat template. Light on purpose (the standard library; the
tokenizer through transformers only when the caller has none), so that ``dflash-prep extract``
and the trainer name a target the same way without importing each other.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dflash_prep.errors import ConfigError, FormatError


def _sha_files(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                h.update(chunk)
    return h.hexdigest()


def load_tokenizer(path: str | Path):
    """The tokenizer saved beside a model (transformers' ``AutoTokenizer``), or one line saying it is missing."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(Path(path))
    except (OSError, ValueError) as e:
        raise FormatError(f"{path}: no loadable tokenizer next to the model ({e}); save it with "
                          "tokenizer.save_pretrained into the same folder") from None


def target_identity(path: str | Path, tokenizer=None) -> dict:
    """Fingerprints of the target folder: weights + config, tokenizer files, chat template."""
    path = Path(path)
    weights = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
    if not weights:
        raise ConfigError(f"{path}: no .safetensors/.bin weight files")
    tok_files = sorted(p for p in path.iterdir() if p.is_file() and (
        p.name.startswith(("tokenizer", "vocab", "merges", "special_tokens")) or p.suffix == ".model")
        and p.name != "tokenizer_config.json")  # the config carries the template, hashed on its own
    tok = tokenizer if tokenizer is not None else load_tokenizer(path)
    template = getattr(tok, "chat_template", None)
    return {"target_fingerprint": _sha_files([path / "config.json", *weights]),
            "tokenizer_hash": _sha_files(tok_files) if tok_files else None,
            "chat_template_hash": hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()
            if template else None}
