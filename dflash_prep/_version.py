"""The one version source: pyproject reads it (``[tool.setuptools.dynamic]``), so does ``--version``."""

__version__ = "0.2.0"
