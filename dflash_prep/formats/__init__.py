"""The on-disk formats (dataset, lengths, plan, manifest) and the atomic, guarded file I/O they share."""
