"""Rebuild ``data/`` and ``manifest.json`` from the upstream files, so anyone can check how they were made.

    python -m dflash_prep.evalsets.build --gsm8k test.jsonl --humaneval HumanEval.jsonl.gz \\
        --mt-bench question.jsonl --mbpp sanitized-mbpp.json [--out DIR]

Each input is the file named in :data:`dflash_prep.evalsets.sources.SOURCES` at its commit (``git
show COMMIT:PATH`` in a clone gives it). A set keeps only what its prompts need: the upstream id and
the user text, one ``{"id", "turns"}`` object a line in upstream order; MBPP keeps its test split.
The JSON lines are gzip-compressed at level 9 with mtime 0, no file name and Python's fixed header
(OS byte 255), so the same inputs give the same bytes on any machine with the same zlib (the
committed files were made with zlib 1.2.13; another zlib, zlib-ng say, may compress differently,
which changes only the file's sha256: the manifest's ``content_sha256`` of the lines stays). The manifest records, per set, both
hashes, the count, the upstream file's git blob id and sha256, the commit, the licence, the
attribution and the prompt format (docs/evaluation.md#benchmark-prompt-sets).
"""

from __future__ import annotations

import gzip
import sys
from pathlib import Path

from dflash_prep.errors import DflashError, InputError
from dflash_prep.evalsets.sets import FORMAT, ROOT, VERSION
from dflash_prep.evalsets.shipped import (
    build_parser,
    deterministic_gzip,
    field,
    git_blob_id,
    json_lines,
    json_objects,
    parsed_inputs,
    read_input,
    read_inputs,
    upstream_identity,
    write_set,
)
from dflash_prep.evalsets.sources import CONVENTION, MBPP_TEST_IDS, NOT_SHIPPED, SOURCES, SetSource
from dflash_prep.formats.fileio import atomic_write_json

__all__ = ["build", "deterministic_gzip", "git_blob_id", "main", "read_upstream"]


def read_upstream(src: SetSource, path: str | Path) -> tuple[bytes, list[dict]]:
    """The upstream file's bytes and its records reduced to ``{"id": str, "turns": [str, ...]}``."""
    path, data = read_input(src, path)
    if src.name == "mbpp":
        recs = []
        for i, r in enumerate(json_objects(path, data, "sanitized-mbpp.json")):
            if field(path, i, r, "task_id", int) in MBPP_TEST_IDS:
                recs.append({"id": str(r["task_id"]), "turns": [field(path, i, r, "prompt", str)]})
    else:
        text = gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data
        rows = json_lines(path, text)
        if src.name == "gsm8k":
            recs = [{"id": str(i), "turns": [field(path, i, r, "question", str)]} for i, r in enumerate(rows)]
        elif src.name == "humaneval":
            recs = [{"id": field(path, i, r, "task_id", str), "turns": [field(path, i, r, "prompt", str)]}
                    for i, r in enumerate(rows)]
        else:  # mt-bench: two user turns
            recs = []
            for i, r in enumerate(rows):
                turns = field(path, i, r, "turns", list)
                if len(turns) != src.turns or not all(isinstance(t, str) for t in turns):
                    raise InputError(f"{path}: record {i} has {len(turns)} turns, expected {src.turns} strings")
                recs.append({"id": str(field(path, i, r, "question_id", int)), "turns": list(turns)})
    ids = [r["id"] for r in recs]
    if not recs or len(set(ids)) != len(ids):
        raise InputError(f"{path}: {len(recs)} records with {len(set(ids))} distinct ids; a set needs at least "
                         "one record and unique ids (samples are keyed by id)")
    return data, recs


def build(inputs: dict[str, str | Path], *, commits: dict[str, str] | None = None, out: str | Path = ROOT) -> dict:
    """Write ``out/data/<name>.jsonl.gz`` for every set and then ``out/manifest.json``; return the manifest.

    ``inputs`` maps each name of :data:`SOURCES` to its upstream file; ``commits`` overrides the
    recorded upstream commit of a set (default: the one in :data:`SOURCES`)."""
    commits = commits or {}
    out = Path(out)
    read = read_inputs(SOURCES, inputs, read_upstream)
    entries = []
    for src, upstream, recs in read:
        entries.append({
            "name": src.name, **write_set(out, src.name, recs), "turns": src.turns,
            "record": {"id": src.id_from, "turns": src.text_from},
            "source": {**upstream_identity(src, upstream, commits), "subset": src.subset},
            "license": src.license, "copyright": src.copyright, "attribution": src.attribution,
            "prompt_format": {"template": src.template, "placeholder": src.placeholder,
                              "applies_to": "each user turn", "convention": CONVENTION},
        })
    manifest = {"notice": "NOTICE", "sets": entries, "not_shipped": list(NOT_SHIPPED)}
    atomic_write_json(out / "manifest.json", manifest, format=FORMAT, version=VERSION)
    return {"format": FORMAT, "version": VERSION, **manifest}


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser("python -m dflash_prep.evalsets.build", __doc__, SOURCES, ROOT).parse_args(argv))
    inputs, commits = parsed_inputs(args, SOURCES)
    try:
        manifest = build(inputs, commits=commits, out=args["out"])
    except DflashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for e in manifest["sets"]:
        print(f"{e['name']:<10} {e['count']:>5} records  {e['file']}  sha256 {e['sha256'][:16]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
