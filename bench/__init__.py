"""Reproducible benchmarks: each module is a script (``python -m bench.<name>``) that prints a
table and writes versioned JSON (+ PNG) under ``bench/out/``. Every figure in the README's
Benchmarks section comes from one of these scripts, with the command that produced it."""
