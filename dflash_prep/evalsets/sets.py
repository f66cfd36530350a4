"""Read the shipped benchmark prompt sets: names, integrity-checked records, deterministic samples.

Each set is ``data/<name>.jsonl.gz`` beside ``manifest.json`` (format ``dflash-prep/evalsets``
version 1). A record is ``{"id": str, "turns": [str, ...]}``: the upstream id and the upstream user
text, unformatted. :func:`load_benchmark` checks the file's sha256, its content's sha256 and its
record count against the manifest, then writes each turn into the benchmark's prompt format (the
manifest's template), so what a caller gets is what the drafter papers send the target.

Sampling ranks every record by ``sha256(f"{seed}:{name}:{id}")`` and keeps the ``n`` smallest,
returned in upstream order. It uses no random generator, so it is the same on every Python, numpy
and platform; a record's rank depends only on its own key, so the sample of ``n`` lies inside the
sample of ``n + 1`` (growing a sample keeps what was measured), and another seed gives another one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dflash_prep.errors import ConfigError
from dflash_prep.evalsets.shipped import read_manifest, read_set, sample
from dflash_prep.evalsets.shipped import sample_key  # noqa: F401 (re-exported: the rule's public name here)

FORMAT = "dflash-prep/evalsets"
VERSION = 1
#: The folder that ships with the package (manifest.json and data/).
ROOT = Path(__file__).resolve().parent
_REBUILD = "reinstall dflash-prep or rebuild it with `python -m dflash_prep.evalsets.build`"


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark question, ready to send."""

    bench: str
    """The set's name (``gsm8k``, ``humaneval``, ``mbpp``, ``mt-bench``)."""
    id: str
    """The upstream id: task_id, question_id, or the 0-based line index (GSM8K)."""
    turns: tuple[str, ...]
    """User turns already in the benchmark's prompt format: 1, or 2 for MT-Bench (the second is
    asked after the target's own answer to the first)."""


_ENTRY_KEYS = ("name", "file", "count", "sha256", "content_sha256", "turns", "prompt_format")


def _manifest(root: str | Path | None) -> tuple[Path, dict]:
    """The folder and its checked manifest (a FormatError in one line if it lacks what readers use)."""
    root = ROOT if root is None else Path(root)
    return root, read_manifest(root, format=FORMAT, version=VERSION, entry_keys=_ENTRY_KEYS, rebuild=_REBUILD)


def _entries(manifest: dict) -> dict[str, dict]:
    return {e["name"]: e for e in manifest["sets"]}


def _unknown(name: str, manifest: dict) -> ConfigError:
    """The one-line refusal of a name that is not shipped (a known-but-omitted set says why)."""
    known = ", ".join([e["name"] for e in manifest["sets"]] + ["all"])
    for skipped in manifest.get("not_shipped", ()):
        if skipped["name"] == name:
            return ConfigError(f"benchmark {name!r} is not shipped: {skipped['reason']} (shipped: {known})")
    what = f"unknown benchmark {name!r}" if name.strip(", ") else f"no benchmark named in {name!r}"
    return ConfigError(f"{what}; choose from {known}, comma-separated")


def benchmark_names(*, root: str | Path | None = None) -> list[str]:
    """The shipped sets, in the manifest's fixed order."""
    return [e["name"] for e in _manifest(root)[1]["sets"]]


def parse_benchmarks(spec: str, *, root: str | Path | None = None) -> list[str]:
    """``"gsm8k,mt-bench"`` or ``"all"`` -> set names in the order given, duplicates dropped.

    Raises ConfigError (one line) for an empty spec or a name that is not shipped, naming the
    shipped ones and, for a set left out on purpose (math500), why."""
    _, manifest = _manifest(root)
    names = [p.strip() for p in spec.split(",") if p.strip()]
    if not names:
        raise _unknown(spec, manifest)
    out: list[str] = []
    for name in names:
        chosen = [e["name"] for e in manifest["sets"]] if name == "all" else [name]
        if name != "all" and name not in _entries(manifest):
            raise _unknown(name, manifest)
        out.extend(n for n in chosen if n not in out)
    return out


def _entry(name: str, root: str | Path | None) -> tuple[Path, dict]:
    """The folder and the manifest entry of ``name`` (ConfigError for a name that is not shipped)."""
    root_dir, manifest = _manifest(root)
    entry = _entries(manifest).get(name)
    if entry is None:
        raise _unknown(name, manifest)
    return root_dir, entry


def describe(name: str, *, root: str | Path | None = None) -> dict:
    """The manifest's entry for ``name``: file, count, hashes, source, licence, attribution, format."""
    return json.loads(json.dumps(_entry(name, root)[1]))  # a copy: callers may edit it


def load_benchmark(name: str, *, root: str | Path | None = None) -> list[BenchPrompt]:
    """Every record of ``name``, in upstream order, each turn in the benchmark's prompt format.

    ``root`` is a folder holding ``manifest.json`` and ``data/`` (default: the copy that ships
    with the package). Raises FormatError (one line) when the file is missing, its bytes or
    content differ from the manifest's sha256, or it holds another number of records."""
    root_dir, entry = _entry(name, root)
    fmt = entry["prompt_format"]
    template, placeholder = fmt["template"], fmt["placeholder"]
    return [BenchPrompt(bench=name, id=rec["id"], turns=tuple(template.replace(placeholder, t) for t in rec["turns"]))
            for rec in read_set(root_dir, entry, _REBUILD)]


def load_raw(name: str, *, root: str | Path | None = None) -> list[dict]:
    """Every record of ``name`` as shipped, ``{"id", "turns"}`` with the upstream text unformatted
    (what :mod:`dflash_prep.trainsets` compares its prompts with); checked like :func:`load_benchmark`."""
    return read_set(*_entry(name, root), _REBUILD)


def sample_benchmark(name: str, n: int, seed: int, *, root: str | Path | None = None) -> list[BenchPrompt]:
    """``n`` records of ``name`` (all when ``n`` is 0 or at least the count), in upstream order.

    The ``n`` records with the smallest :func:`sample_key` under ``seed``
    (:func:`dflash_prep.evalsets.shipped.sample`); see the module docstring for why this is
    platform-independent and nested."""
    return sample(name, n, seed, lambda: load_benchmark(name, root=root), lambda p: p.id)
