"""A target folder's config and identity: what a run contract and a states cache record.

:func:`read_target_config`: the sizes every reader of a target's ``config.json`` relies on, checked
in one place, so a folder whose config lacks them (``{}``) is refused in one line naming the file
and every missing key, by ``extract``, ``evaluate``, the trainer and ``pack --target-config`` alike.

:func:`target_identity`: sha256 of config.json and every weight file (``target_fingerprint``),
of the tokenizer files, and of the chat template. Light on purpose (the standard library and the project's file I/O; the
tokenizer through transformers only when the caller has none), so that ``dflash-prep extract``
and the trainer name a target the same way without importing each other.

**Digest cache.** Hashing every weight byte costs minutes on a 140 GB target, and every rank of
every run does it at start. So each digest is cached (:data:`DIGEST_CACHE`, format
``dflash-prep/target-digests`` version 1) under the key ``(name, size, mtime_ns, ctime_ns,
inode, device)`` of each file it covers, in the target folder when it is writable, else in
``$XDG_CACHE_HOME/dflash-prep/target-digests/`` (``~/.cache`` without it), else nowhere. A
lookup re-stats the files and uses the cached digest only when every key is equal; any
difference (a rewritten shard, a copy, another filesystem) re-hashes all of them. ``ctime_ns``
changes on every write and cannot be set back by ``touch``/``os.utime``, so restoring a
modification time does not pass for the old bytes. A digest is not stored when a file was
modified within :data:`RACY_S` of the hash (the bytes may still be moving) or its key changed
while it was read. A cache file that does not parse, has another format or version, or holds
malformed entries is ignored and rewritten, never trusted. It is written atomically (a temp
beside it, then a rename): ranks starting together each hash and the last rename wins, and a
reader sees one whole file or none. Entries are keyed by the stat keys themselves, so the views of
one shared folder from several machines (each client mount its own device number) sit side by
side instead of evicting each other (the newest :data:`MAX_ENTRIES` are kept). The value is the same digest as without the cache; its cost
on a multi-GB file: docs/reliability.md#target-identity.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from dflash_prep.errors import ConfigError, FormatError
from dflash_prep.formats.fileio import atomic_write_json

DIGEST_CACHE = "dflash-prep-digests.json"
"""The one file dflash-prep writes into a target folder (when it is writable)."""
DIGEST_FORMAT, DIGEST_VERSION = "dflash-prep/target-digests", 1
RACY_S = 2.0
"""A file modified less than this many seconds before its hash started is hashed but not cached."""
MAX_ENTRIES = 64
"""Entries a cache file keeps, the newest first (old versions of the files, other machines' views)."""

TARGET_CONFIG_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
"""The sizes of a target's ``config.json`` (its ``text_config`` for a multimodal model) that every
reader needs; ``num_key_value_heads`` and ``head_dim`` default to the attention heads' as in
transformers."""


def read_target_config(path: str | Path, *, need: tuple[str, ...] = TARGET_CONFIG_KEYS, model_type: bool = True,
                       fix: str = "point --target at a local transformers model folder (save_pretrained's)") -> dict:
    """The language model's part of a target's ``config.json`` (``path``: the folder or the file):
    the top level, or its ``text_config`` where it has one. Refused in one line naming the file
    and every key of ``need`` that is missing or not a positive integer, and a missing
    ``model_type`` (what transformers and vLLM pick the architecture by) unless ``model_type`` is
    False; ``fix`` ends the message."""
    p = Path(path)
    p = p / "config.json" if p.is_dir() else p
    try:
        raw = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{p}: cannot read the target's config.json ({e}); {fix}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: the target's config.json is a JSON {type(raw).__name__}, not an object; {fix}")
    cfg = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    missing = [k for k in need if cfg.get(k) is None]
    bad = [f"{k}={cfg[k]!r}" for k in need if k not in missing
           and (isinstance(cfg[k], bool) or not isinstance(cfg[k], int) or cfg[k] < 1)]
    if model_type and not (raw.get("model_type") or cfg.get("model_type")):
        missing.insert(0, "model_type")
    if missing or bad:
        what = "; ".join(filter(None, [f"no {', '.join(missing)}" if missing else "",
                                       f"not positive integers: {', '.join(bad)}" if bad else ""]))
        raise ConfigError(f"{p}: {what}, which every reader of a target's config.json needs; {fix}")
    return cfg


def is_digest_cache(f: Path) -> bool:
    """The digest cache or one of its temps: what a folder's own fingerprint must leave out (it is
    rewritten whenever a digest changes, not part of the model)."""
    return f.name == DIGEST_CACHE or (f.name.startswith(f".{DIGEST_CACHE}.") and f.name.endswith(".tmp"))


def _stat_key(f: Path) -> list:
    st = os.stat(f)
    return [f.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _hash_files(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                h.update(chunk)
    return h.hexdigest()


def _cache_paths(folder: Path) -> list[Path]:
    """Where ``folder``'s digests are kept, in order: beside the files where the folder is
    writable, then the per-user cache (``$XDG_CACHE_HOME/dflash-prep/target-digests/``)."""
    beside = [folder / DIGEST_CACHE] if os.access(folder, os.W_OK | os.X_OK) else []
    try:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash-prep" / "target-digests"
    except (RuntimeError, KeyError):             # no $HOME and no passwd entry: beside the files or nowhere
        return beside
    return beside + [base / (hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:32] + ".json")]


def _read_cache(p: Path) -> dict:
    """The cache's entries, or ``{}`` for a missing, unreadable or foreign file (never trusted)."""
    try:
        obj = json.loads(p.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    if not (isinstance(obj, dict) and obj.get("format") == DIGEST_FORMAT and obj.get("version") == DIGEST_VERSION
            and isinstance(obj.get("entries"), dict)):
        return {}
    return {k: v for k, v in obj["entries"].items() if isinstance(v, dict) and isinstance(v.get("files"), list)
            and isinstance(v.get("sha256"), str) and len(v["sha256"]) == 64
            and type(v.get("written_ns", 0)) is int}


def _write_cache(paths: list[Path], key: str, entry: dict) -> None:
    """Add ``entry`` under ``key`` to the first cache file that can be written, keeping what other
    ranks or machines wrote (the newest :data:`MAX_ENTRIES`); none writable only costs the next
    run a re-hash."""
    for p in paths:
        try:
            entries = _read_cache(p) | {key: entry}
            keep = sorted(entries, key=lambda k: entries[k].get("written_ns", 0), reverse=True)[:MAX_ENTRIES]
            atomic_write_json(p, {"entries": {k: entries[k] for k in keep}}, format=DIGEST_FORMAT,
                              version=DIGEST_VERSION)
            return
        except OSError:
            continue


def _sha_files(files: list[Path], *, cache: bool = True) -> str:
    """sha256 of each file's name, a NUL and its bytes, in order; through the digest cache (module
    docstring) unless ``cache`` is False. All files are in one folder. An entry is keyed by the
    files' stat keys themselves, so the views of one folder from several machines (a shared
    filesystem gives each client its own device number) are kept side by side, not overwritten
    in turn."""
    if not cache:
        return _hash_files(files)
    paths = _cache_paths(files[0].parent)
    stats = [_stat_key(f) for f in files]
    key = hashlib.sha256(json.dumps(stats).encode()).hexdigest()
    for p in paths:
        hit = _read_cache(p).get(key)
        if hit is not None and hit["files"] == stats:
            return hit["sha256"]
    start = time.time_ns()
    digest = _hash_files(files)
    settled = all(s[2] < start - int(RACY_S * 1e9) for s in stats) and [_stat_key(f) for f in files] == stats
    if settled:
        _write_cache(paths, key, {"files": stats, "sha256": digest, "written_ns": time.time_ns()})
    return digest


def load_tokenizer(path: str | Path):
    """The tokenizer saved beside a model (transformers' ``AutoTokenizer``), or one line saying it is missing."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(Path(path))
    except (OSError, ValueError) as e:
        raise FormatError(f"{path}: no loadable tokenizer next to the model ({e}); save it with "
                          "tokenizer.save_pretrained into the same folder") from None


def load_target_config(path: str | Path):
    """transformers' ``AutoConfig`` of a target folder, after :func:`read_target_config` has checked
    the keys every reader needs (transformers would fill a missing one with its class default)."""
    from transformers import AutoConfig

    read_target_config(path)
    try:
        return AutoConfig.from_pretrained(Path(path))
    except (OSError, ValueError) as e:
        raise FormatError(f"{path}: transformers cannot read its config.json ({e})") from None


def target_identity(path: str | Path, tokenizer=None, *, cache: bool = True) -> dict:
    """Fingerprints of the target folder: weights + config, tokenizer files, chat template
    (``cache``: through the digest cache, module docstring; the same values without it)."""
    path = Path(path)
    weights = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
    if not weights:
        raise ConfigError(f"{path}: no .safetensors/.bin weight files")
    tok_files = sorted(p for p in path.iterdir() if p.is_file() and (
        p.name.startswith(("tokenizer", "vocab", "merges", "special_tokens")) or p.suffix == ".model")
        and p.name != "tokenizer_config.json")  # the config carries the template, hashed on its own
    tok = tokenizer if tokenizer is not None else load_tokenizer(path)
    template = getattr(tok, "chat_template", None)
    return {"target_fingerprint": _sha_files([path / "config.json", *weights], cache=cache),
            "tokenizer_hash": _sha_files(tok_files, cache=cache) if tok_files else None,
            "chat_template_hash": hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()
            if template else None}
