"""qkv's version: the one place it is written.

``pyproject.toml`` reads it from here when the package is built (``[tool.setuptools.dynamic]``),
so the installed metadata, ``qkv --version``, ``qkv.__version__``, the documentation site and
the first entry of ``CHANGELOG.md`` (checked by the tests) all say the same.
"""

from __future__ import annotations

__version__ = "0.1.0"
