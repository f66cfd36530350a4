"""Reproducible benchmarks: each module is a script (``python -m bench.<name>``) that prints a
table and writes versioned JSON (+ PNG) under ``bench/out/``. Every figure in docs/benchmarks.md
(and the figures of docs/reliability.md and docs/kernels.md) comes from one of these scripts,
with the command that produced it."""
