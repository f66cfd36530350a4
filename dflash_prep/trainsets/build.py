"""Rebuild the training prompts' ``data/`` and ``manifest.json`` from the upstream files.

    python -m dflash_prep.trainsets.build --train-math train.jsonl --train-code codegen-instruct.json \\
        --train-chat roleplay-simple-deduped-roleplay-instruct.json [--out DIR]

Each input is the file :data:`dflash_prep.trainsets.sources.SOURCES` names at its commit (``git show
COMMIT:PATH`` in a clone gives it). Per set, in this order: every upstream record becomes one prompt
(``{"id", "turns": [text]}``, the text unchanged); a prompt that repeats an earlier one (after
whitespace normalisation) is dropped; a prompt that overlaps a shipped evaluation set
(:mod:`dflash_prep.trainsets.overlap`, against the evaluation sets in ``--eval-root``, by default
the package's) is dropped; of the rest the ``max_records`` with the smallest
``sha256(f"0:{name}:{id}")`` ship, in upstream order. The files are written like the evaluation
sets' (:mod:`dflash_prep.evalsets.shipped`: same records, same bytes), and the manifest records per
set the upstream identity (repo, path, commit, git blob, sha256), the licence and attribution, the
counts at each step with the ids dropped for overlap, and both hashes of the shipped file.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dflash_prep.errors import DflashError, InputError
from dflash_prep.evalsets.shipped import (
    build_parser,
    field,
    json_lines,
    json_objects,
    parsed_inputs,
    read_input,
    read_inputs,
    smallest,
    upstream_identity,
    write_set,
)
from dflash_prep.formats.fileio import atomic_write_json
from dflash_prep.trainsets import overlap
from dflash_prep.trainsets.sets import FORMAT, ROOT, VERSION
from dflash_prep.trainsets.sources import SOURCES, SUBSET_RULE, TrainSource


def _alpaca_prompt(path: Path, i: int, rec: dict) -> str:
    text = field(path, i, rec, "instruction", str)
    extra = rec.get("input", "")
    if not isinstance(extra, str):
        raise InputError(f"{path}: record {i} has a non-string 'input'; pass the upstream file as is")
    return f"{text}\n\n{extra}" if extra.strip() else text


def read_upstream(src: TrainSource, path: str | Path) -> tuple[bytes, list[dict]]:
    """The upstream file's bytes and every record as ``{"id": str, "turns": [prompt]}``, upstream order."""
    path, data = read_input(src, path)
    if src.layout == "jsonl-question":
        recs = [{"id": str(i), "turns": [field(path, i, r, "question", str)]}
                for i, r in enumerate(json_lines(path, data))]
    else:
        recs = [{"id": str(i), "turns": [_alpaca_prompt(path, i, r)]}
                for i, r in enumerate(json_objects(path, data, src.path))]
    empty = [r["id"] for r in recs if not r["turns"][0].strip()]
    if not recs or empty:
        raise InputError(f"{path}: {len(recs)} records, {len(empty)} with an empty prompt (first: {empty[:1]}); "
                         "a set needs at least one record and a prompt in each")
    return data, recs


def select(name: str, recs: list[dict], index: overlap.EvalIndex, max_records: int) -> tuple[list[dict], dict]:
    """The records that ship, and the counts at each step (:data:`~dflash_prep.trainsets.sources.SUBSET_RULE`)."""
    seen, unique = set(), []
    for r in recs:
        key = overlap.normalise(r["turns"][0])
        if key not in seen:
            seen.add(key)
            unique.append(r)
    bad = overlap.offenders([(r["id"], r["turns"][0]) for r in unique], index)
    clean = [r for r in unique if r["id"] not in bad]
    stats = {"upstream_records": len(recs), "duplicates_dropped": len(recs) - len(unique),
             "overlap_dropped": {"contains": sorted(i for i, why in bad.items() if why == "contains"),
                                 "ngram": sorted(i for i, why in bad.items() if why == "ngram")},
             "eligible": len(clean), "max_records": max_records, "rule": SUBSET_RULE}
    return smallest(name, clean, max_records, 0, lambda r: r["id"]), stats


def build(inputs: dict[str, str | Path], *, commits: dict[str, str] | None = None, out: str | Path = ROOT,
          eval_root: str | Path | None = None) -> dict:
    """Write ``out/data/<name>.jsonl.gz`` for every set, then ``out/manifest.json``; return the manifest.

    ``inputs`` maps each name of :data:`SOURCES` to its upstream file; ``commits`` overrides a set's
    recorded upstream commit; ``eval_root`` holds the evaluation sets to keep clear of."""
    commits = commits or {}
    out = Path(out)
    read = read_inputs(SOURCES, inputs, read_upstream)
    turns, eval_hashes = overlap.eval_turns(root=eval_root)
    index = overlap.build_index(turns)
    entries = []
    for src, upstream, recs in read:
        kept, stats = select(src.name, recs, index, src.max_records)
        entries.append({
            "name": src.name, "domain": src.domain, **write_set(out, src.name, kept), "turns": 1,
            "record": {"id": src.id_from, "turns": src.text_from},
            "source": upstream_identity(src, upstream, commits),
            "selection": stats, "license": src.license, "copyright": src.copyright, "attribution": src.attribution,
        })
    manifest = {"notice": "NOTICE", "sets": entries,
                "overlap_check": {"against": eval_hashes, "ngram_words": overlap.NGRAM,
                                  "words": "lower-cased \\w+ runs", "normalisation": "whitespace runs to one space, "
                                                                                      "ends stripped"}}
    atomic_write_json(out / "manifest.json", manifest, format=FORMAT, version=VERSION)
    return {"format": FORMAT, "version": VERSION, **manifest}


def main(argv: list[str] | None = None) -> int:
    ap = build_parser("python -m dflash_prep.trainsets.build", __doc__, SOURCES, ROOT)
    ap.add_argument("--eval-root", type=Path, default=None, help="the evaluation sets to keep clear of (default: "
                                                                  "the package's dflash_prep/evalsets)")
    args = vars(ap.parse_args(argv))
    inputs, commits = parsed_inputs(args, SOURCES)
    try:
        manifest = build(inputs, commits=commits, out=args["out"], eval_root=args["eval_root"])
    except DflashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for e in manifest["sets"]:
        sel = e["selection"]
        dropped = sum(len(v) for v in sel["overlap_dropped"].values())
        print(f"{e['name']:<11} {e['count']:>5} of {sel['upstream_records']:>5} records  ({sel['duplicates_dropped']} "
              f"repeats, {dropped} overlapping the evaluation sets dropped)  {e['file']}  sha256 {e['sha256'][:16]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
