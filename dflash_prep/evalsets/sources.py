"""Where each shipped prompt set comes from, under which licence, and how its prompts are written.

This is the one place that names an upstream file, its commit, its licence and attribution, and
the prompt template; :mod:`dflash_prep.evalsets.build` copies it into ``manifest.json`` next to the
data it writes, and :mod:`dflash_prep.evalsets.sets` reads only the manifest. Edit a set here, then
rebuild (``python -m dflash_prep.evalsets.build ...``, docs/evaluation.md#benchmark-prompt-sets).

A template holds exactly one placeholder (``{question}``, ``{prompt}``, ``{turn}``), replaced
literally by each user turn's upstream text; nothing else in it is interpreted, so the braces of
GSM8K's ``\\boxed{}`` are plain text. The templates follow z-lab's DFlash benchmark
(:data:`CONVENTION`), which SpecForge and other drafter projects reuse, so acceptance lengths
measured here compare with theirs.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The public code whose prompt formats ours follow (its per-dataset ``format`` entries).
CONVENTION = {"repo": "z-lab/dflash", "path": "dflash/benchmark.py",
              "commit": "44947fbf71114e241c96de194f4b382b5dd330d0"}

_STEP_BY_STEP = "\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class SetSource:
    """One shipped set: its upstream file and how a record of it becomes user turns."""

    name: str
    """Benchmark name (the file is ``data/<name>.jsonl.gz``)."""
    repo: str
    """GitHub ``owner/name`` of the upstream repository."""
    path: str
    """The upstream file inside ``repo``."""
    commit: str
    """The upstream commit the shipped data was taken from (a build option may override it)."""
    license: str
    """SPDX identifier of the data's licence."""
    copyright: str
    """The upstream copyright line (MIT asks that it be kept), or the licensor for CC-BY."""
    attribution: str
    """Authors, paper and what was changed, as the upstream asks to be credited."""
    turns: int
    """User turns per record: 1, or 2 for MT-Bench (the second follows the target's first answer)."""
    id_from: str
    """What a record's ``id`` is upstream."""
    text_from: str
    """Which upstream field becomes the record's turns."""
    template: str
    """The prompt format of every turn; :attr:`placeholder` is replaced by the turn's text."""
    placeholder: str
    """The one placeholder in :attr:`template`."""
    subset: str = "all records"
    """Which upstream records ship."""


SOURCES: tuple[SetSource, ...] = (
    SetSource(
        name="gsm8k", repo="openai/grade-school-math", path="grade_school_math/data/test.jsonl",
        commit="3101c7d5072418e28b9008a6636bde82a006892c", license="MIT",
        copyright="Copyright (c) 2021 OpenAI",
        attribution="GSM8K test set, Copyright (c) 2021 OpenAI, MIT License. Karl Cobbe, Vineet Kosaraju, "
                    "Mohammad Bavarian, Mark Chen, Heewoo Jun, Lukasz Kaiser, Matthias Plappert, Jerry Tworek, "
                    "Jacob Hilton, Reiichiro Nakano, Christopher Hesse, John Schulman: \"Training Verifiers to "
                    "Solve Math Word Problems\", arXiv:2110.14168, 2021. Only the question text is kept.",
        turns=1, id_from="0-based line index in test.jsonl", text_from="question",
        template="{question}" + _STEP_BY_STEP, placeholder="{question}"),
    SetSource(
        name="humaneval", repo="openai/human-eval", path="data/HumanEval.jsonl.gz",
        commit="6d43fb980f9fee3c892a914eda09951f772ad10d", license="MIT",
        copyright="Copyright (c) OpenAI (https://openai.com)",
        attribution="HumanEval, Copyright (c) OpenAI (https://openai.com), MIT License. Mark Chen, Jerry Tworek, "
                    "Heewoo Jun, Qiming Yuan, Henrique Ponde de Oliveira Pinto, et al.: \"Evaluating Large "
                    "Language Models Trained on Code\", arXiv:2107.03374, 2021. Only task_id and prompt are kept.",
        turns=1, id_from="task_id", text_from="prompt",
        template="Write a solution to the following problem and make sure that it passes the tests:\n"
                 "```python\n{prompt}\n```",
        placeholder="{prompt}"),
    SetSource(
        name="mbpp", repo="google-research/google-research", path="mbpp/sanitized-mbpp.json",
        commit="dec705a28fea05552916c0b83c52f5f23609e8ee", license="CC-BY-4.0",
        copyright="Google LLC (google-research/google-research)",
        attribution="Mostly Basic Python Problems (MBPP), sanitized, by Google Research, licensed under CC BY 4.0 "
                    "(https://creativecommons.org/licenses/by/4.0/). Jacob Austin, Augustus Odena, Maxwell Nye, "
                    "Maarten Bosma, Henryk Michalewski, David Dohan, Ellen Jiang, Carrie Cai, Michael Terry, "
                    "Quoc Le, Charles Sutton: \"Program Synthesis with Large Language Models\", arXiv:2108.07732, "
                    "2021. Changes: only the evaluation split (task_ids 11-510) is kept, and of each record only "
                    "task_id and prompt, the prompt text unchanged.",
        turns=1, id_from="task_id", text_from="prompt", template="{prompt}", placeholder="{prompt}",
        subset="the test split: task_id 11..510 inclusive (the upstream README's evaluation split)"),
    SetSource(
        name="mt-bench", repo="lm-sys/FastChat", path="fastchat/llm_judge/data/mt_bench/question.jsonl",
        commit="0e6d3e4beaab66f4d3f93db72541a4abab8af28d", license="Apache-2.0",
        copyright="LMSYS (lm-sys/FastChat), Apache License 2.0",
        attribution="MT-Bench questions from FastChat (lm-sys/FastChat), Apache License 2.0. Lianmin Zheng, "
                    "Wei-Lin Chiang, Ying Sheng, Siyuan Zhuang, Zhanghao Wu, Yonghao Zhuang, Zi Lin, Zhuohan Li, "
                    "Dacheng Li, Eric P. Xing, Hao Zhang, Joseph E. Gonzalez, Ion Stoica: \"Judging LLM-as-a-Judge "
                    "with MT-Bench and Chatbot Arena\", arXiv:2306.05685, 2023. Only question_id and the two "
                    "turns are kept.",
        turns=2, id_from="question_id", text_from="turns", template="{turn}", placeholder="{turn}"),
)

#: MBPP's evaluation split (its README: task_ids 11-510 for evaluation, the rest for prompting/training).
MBPP_TEST_IDS = range(11, 511)

#: Sets a drafter paper reports but this package cannot ship, each with its reason.
NOT_SHIPPED: tuple[dict, ...] = (
    {"name": "math500",
     "source": {"repo": "openai/prm800k", "path": "prm800k/math_splits/test.jsonl",
                "commit": "7ecc794703b2877f63226f2477a49b34f9b25163"},
     "reason": "its source, openai/prm800k prm800k/math_splits/test.jsonl at commit 7ecc7947, is a Git LFS "
               "pointer (131 bytes naming a 446564-byte object), not the problems, so no copy can be taken from "
               "the repository itself; pass your own MATH-500 prompts with --prompts FILE"},
)
