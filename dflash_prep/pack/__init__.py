"""Stage 3, plan -> manifests: per-epoch bucketing, step schedule, rank balance, resume re-packing, metrics."""
