"""The attention kernels' own errors: ``kernels`` imports nothing from the data pipeline.

Both are ``ValueError`` subclasses, so a caller that does not know them still sees a clear
message; the trainer reports them as user errors (one line, exit 1).
"""

from __future__ import annotations


class AttentionError(ValueError):
    """Base class of every error the attention API raises on bad use."""


class AttentionConfigError(AttentionError):
    """An unsupported option: a backend name, dtype, head dim, or a bad tensor layout."""


class AttentionInputError(AttentionError):
    """Offsets or lengths whose values are inconsistent (decreasing, out of range)."""
