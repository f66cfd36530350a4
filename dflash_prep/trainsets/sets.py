"""Read the shipped training prompts and write them as ``regenerate``'s input.

Each set is ``data/<name>.jsonl.gz`` beside ``manifest.json`` (format ``dflash-prep/trainsets``
version 1), in the evaluation sets' file layout (:mod:`dflash_prep.evalsets.shipped`): one
``{"id": str, "turns": [prompt]}`` a line, checked against the manifest's sha256, content sha256
and count before a record is returned. The prompts are the upstream text with no template: the
target answers them as a user would ask them.

:func:`export` writes one JSON line per prompt, ``{"id": "<set>/<upstream id>", "messages":
[{"role": "user", "content": prompt}]}``: the ``messages`` schema that ``dflash-prep regenerate``
(and ``tokenize``) read, a conversation that ends with the user turn the target is to answer.
Sampling ``n`` of a set ranks its records by ``sha256(f"{seed}:{name}:{id}")`` like the evaluation
sets (:func:`dflash_prep.evalsets.shipped.sample_key`): seed 0 gives the first ``n`` of the rule that
chose the shipped records, and the sample of ``n`` lies inside the sample of ``n + 1``.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_prep.errors import ConfigError
from dflash_prep.evalsets.shipped import read_manifest, read_set, sample
from dflash_prep.formats.fileio import atomic_write_bytes, strict_dumps

FORMAT = "dflash-prep/trainsets"
VERSION = 1
#: The folder that ships with the package (manifest.json and data/).
ROOT = Path(__file__).resolve().parent
_REBUILD = "reinstall dflash-prep or rebuild it with `python -m dflash_prep.trainsets.build`"
_ENTRY_KEYS = ("name", "file", "count", "sha256", "content_sha256", "turns")


def _manifest(root: str | Path | None) -> tuple[Path, dict]:
    root = ROOT if root is None else Path(root)
    return root, read_manifest(root, format=FORMAT, version=VERSION, entry_keys=_ENTRY_KEYS, rebuild=_REBUILD)


def set_names(*, root: str | Path | None = None) -> list[str]:
    """The shipped training-prompt sets, in the manifest's order."""
    return [e["name"] for e in _manifest(root)[1]["sets"]]


def parse_sets(spec: str, *, root: str | Path | None = None) -> list[str]:
    """``"train-math,train-chat"`` or ``"all"`` -> set names in the order given, duplicates dropped;
    a ConfigError (one line, naming the shipped sets) for an empty spec or an unknown name."""
    known = set_names(root=root)
    names = [p.strip() for p in spec.split(",") if p.strip()]
    out: list[str] = []
    for name in names:
        if name != "all" and name not in known:
            raise ConfigError(f"unknown training-prompt set {name!r}; choose from {', '.join(known + ['all'])}, "
                              "comma-separated")
        out.extend(n for n in (known if name == "all" else [name]) if n not in out)
    if not out:
        raise ConfigError(f"no training-prompt set named in {spec!r}; choose from {', '.join(known + ['all'])}")
    return out


def describe(name: str, *, root: str | Path | None = None) -> dict:
    """The manifest's entry for ``name``: file, count, hashes, source, selection, licence, attribution."""
    for e in _manifest(root)[1]["sets"]:
        if e["name"] == name:
            return json.loads(json.dumps(e))  # a copy: callers may edit it
    raise ConfigError(f"unknown training-prompt set {name!r}; choose from {', '.join(set_names(root=root))}")


def load_set(name: str, *, root: str | Path | None = None) -> list[dict]:
    """Every record of ``name``, ``{"id", "turns": [prompt]}``, in upstream order (FormatError, one line,
    when the file differs from the manifest)."""
    root_dir, manifest = _manifest(root)
    entry = next((e for e in manifest["sets"] if e["name"] == name), None)
    if entry is None:
        raise ConfigError(f"unknown training-prompt set {name!r}; choose from {', '.join(set_names(root=root))}")
    return read_set(root_dir, entry, _REBUILD)


def sample_set(name: str, n: int, seed: int, *, root: str | Path | None = None) -> list[dict]:
    """``n`` records of ``name`` (all when ``n`` is 0 or at least the count), in upstream order: the
    ``n`` smallest ``sha256(f"{seed}:{name}:{id}")`` (:func:`dflash_prep.evalsets.shipped.sample`)."""
    return sample(name, n, seed, lambda: load_set(name, root=root), lambda r: r["id"])


def export(names: list[str], out: str | Path, *, n: int = 0, seed: int = 0,
           root: str | Path | None = None) -> dict[str, int]:
    """Write the prompts of ``names`` (``n`` of each, 0 = all) to the JSONL file ``out`` as
    ``{"id", "messages"}`` records, set after set; return the count written per set."""
    lines, counts = [], {}
    for name in names:
        recs = sample_set(name, n, seed, root=root)
        counts[name] = len(recs)
        lines += [strict_dumps({"id": f"{name}/{r['id']}", "messages": [{"role": "user", "content": r["turns"][0]}]},
                               ensure_ascii=False) + "\n" for r in recs]
    atomic_write_bytes(Path(out), "".join(lines).encode())
    return counts
