"""Benchmark prompt sets that ship with the package: GSM8K, HumanEval, MBPP (test split), MT-Bench.

Each is a small gzip JSON-lines file under ``data/``, taken from its public source at a recorded
commit, with its licence, attribution, count and sha256 in ``manifest.json`` (``NOTICE`` keeps the
licence notices). :mod:`.sets` reads them, checks them and writes each turn in the benchmark's
prompt format; :mod:`.build` remakes them from the upstream files; :mod:`.sources` says where each
comes from. MATH-500 is not shipped (its upstream file is a Git LFS pointer); docs/evaluation.md
has the table, the prompt formats and how sampling works.
"""

from dflash_prep.evalsets.sets import (
    BenchPrompt,
    benchmark_names,
    describe,
    load_benchmark,
    parse_benchmarks,
    sample_benchmark,
)

__all__ = ["BenchPrompt", "benchmark_names", "describe", "load_benchmark", "parse_benchmarks", "sample_benchmark"]
