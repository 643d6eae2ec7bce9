"""The installed version of qkv (``0.0.0`` when run from a source tree without installing)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("qkv")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0"
