"""Where each shipped training-prompt set comes from, under which licence, and which records ship.

The one place that names an upstream file, its commit, its licence and attribution, and the
subset; :mod:`dflash_prep.trainsets.build` copies it into ``manifest.json`` next to the data it
writes, and :mod:`dflash_prep.trainsets.sets` reads only the manifest. Edit a set here, then rebuild
(``python -m dflash_prep.trainsets.build ...``, docs/training-prompts.md).

Why these sources: each is on GitHub at a recorded commit, in a file small enough to take whole,
under a licence that allows redistribution (MIT; the LICENSE file at that commit is copied into
``NOTICE``). databricks-dolly-15k (CC BY-SA 3.0) and OpenAssistant's oasst1 (Apache-2.0) are on the
Hugging Face Hub only (dolly's GitHub copy was removed in favour of it); Stanford Alpaca, Code
Alpaca and InstructionWild are for non-commercial use only, so none of them ships.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Every set keeps at most this many records (a few thousand: enough to exercise a pipeline,
#: small enough to ship); the rule that picks them is :data:`SUBSET_RULE`.
MAX_RECORDS = 3000
SUBSET_RULE = ("drop records whose prompt repeats an earlier one of the set (after whitespace normalisation) "
               "and records that overlap a shipped evaluation set (dflash_prep.trainsets.overlap); of the rest, "
               "keep the max_records with the smallest sha256(f'0:{name}:{id}') (the evaluation sets' sample_key "
               "with seed 0), in upstream order")

_GPTEACHER = {"repo": "teknium1/GPTeacher", "commit": "481075123c29854bddb82655badeef6a438f2436", "license": "MIT",
              "copyright": "Copyright (c) 2023 Teknium"}


@dataclass(frozen=True)
class TrainSource:
    """One shipped training-prompt set: its upstream file and how a record of it becomes a prompt."""

    name: str
    """Set name (the file is ``data/<name>.jsonl.gz``)."""
    domain: str
    """What the prompts ask for: maths, code or chat."""
    repo: str
    """GitHub ``owner/name`` of the upstream repository."""
    path: str
    """The upstream file inside ``repo``."""
    commit: str
    """The upstream commit the shipped data was taken from (a build option may override it)."""
    layout: str
    """``jsonl-question``: JSON lines with a ``question`` (GSM8K); ``alpaca-list``: one JSON list of
    ``{"instruction", "input", ...}`` objects (GPTeacher)."""
    license: str
    """SPDX identifier of the data's licence."""
    copyright: str
    """The upstream copyright line, which MIT asks to keep with every copy."""
    attribution: str
    """Authors, paper or repository, and what was changed, as the upstream asks to be credited."""
    id_from: str
    """What a record's ``id`` is upstream."""
    text_from: str
    """Which upstream fields make the prompt."""
    max_records: int = MAX_RECORDS
    """At most this many records ship (:data:`SUBSET_RULE`)."""


SOURCES: tuple[TrainSource, ...] = (
    TrainSource(
        name="train-math", domain="maths", repo="openai/grade-school-math", path="grade_school_math/data/train.jsonl",
        commit="3101c7d5072418e28b9008a6636bde82a006892c", layout="jsonl-question", license="MIT",
        copyright="Copyright (c) 2021 OpenAI",
        attribution="GSM8K training set, Copyright (c) 2021 OpenAI, MIT License. Karl Cobbe, Vineet Kosaraju, "
                    "Mohammad Bavarian, Mark Chen, Heewoo Jun, Lukasz Kaiser, Matthias Plappert, Jerry Tworek, "
                    "Jacob Hilton, Reiichiro Nakano, Christopher Hesse, John Schulman: \"Training Verifiers to "
                    "Solve Math Word Problems\", arXiv:2110.14168, 2021. Only the question text of a subset is "
                    "kept; the answers are not.",
        id_from="0-based line index in train.jsonl", text_from="question"),
    TrainSource(
        name="train-code", domain="code", path="Codegen/codegen-instruct.json", layout="alpaca-list",
        **_GPTEACHER,
        attribution="GPTeacher Code-Instruct, Copyright (c) 2023 Teknium, MIT License "
                    "(https://github.com/teknium1/GPTeacher). Code tasks in several programming languages, written "
                    "by GPT-4 as its README says. Only the instruction and input of a subset are kept; the "
                    "responses are not.",
        id_from="0-based index in the JSON list", text_from="instruction, then a blank line and input when input "
                                                            "is not empty"),
    TrainSource(
        name="train-chat", domain="chat", path="Roleplay/roleplay-simple-deduped-roleplay-instruct.json",
        layout="alpaca-list", **_GPTEACHER,
        attribution="GPTeacher Roleplay-Instruct, Copyright (c) 2023 Teknium, MIT License "
                    "(https://github.com/teknium1/GPTeacher). Role-play and open writing requests, written by GPT-4 "
                    "as its README says. Only the instruction and input of each record are kept; the responses "
                    "are not.",
        id_from="0-based index in the JSON list", text_from="instruction, then a blank line and input when input "
                                                            "is not empty"),
)
