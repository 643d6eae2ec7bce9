"""Compiled kernels (Numba), an optional extra: ``pip install "qkv[jit]"``.

The NumPy kernels are the library; these are faster versions of some of them, used only when
Numba is installed and not switched off with ``QKV_JIT=0``. Every compiled kernel is tested
equal to :func:`qkv.reference.attention`, exactly as the NumPy kernels are.

The functions are compiled with ``nogil=True`` and without Numba's own thread pool: qkv's
worker threads (:func:`qkv.engine.kernels.threads.parallel_map`) run them in parallel, so a call
from any Python thread, or in a forked child, is as safe as the NumPy path. They are compiled on
first use and cached on disk (``cache=True``); the first call in a fresh environment pays the
compile time.
"""

from __future__ import annotations

import functools
import importlib.util
import os

__all__ = ["enabled"]


@functools.cache
def _installed() -> bool:
    return importlib.util.find_spec("numba") is not None


def enabled() -> bool:
    """Whether the compiled kernels may be used: Numba installed and ``QKV_JIT`` not ``0``."""
    return os.environ.get("QKV_JIT", "1") != "0" and _installed()
