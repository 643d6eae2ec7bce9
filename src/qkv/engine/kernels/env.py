"""Environment settings a call reads every time (``QKV_NATIVE``, ``QKV_NATIVE_ISA``,
``OMP_NUM_THREADS``): read from the process environment's live mapping in one dictionary
look-up.

``os.environ.get`` encodes the name and decodes the value through three Python calls, about
a microsecond each on the machines measured; a small call read three settings. The live
mapping is CPython's ``os.environ`` store (what ``os.environ[...] = ...`` and ``putenv``
update, so a setting changed between calls is seen); an interpreter without it reads
``os.environ`` itself.

>>> import os
>>> os.environ["QKV_EXAMPLE_SETTING"] = "3"
>>> setting("QKV_EXAMPLE_SETTING"), setting("QKV_EXAMPLE_UNSET", "none")
('3', 'none')
"""

from __future__ import annotations

import functools
import os

__all__ = ["setting"]

_live = getattr(os.environ, "_data", None)
_encode = getattr(os.environ, "encodekey", None)
_decode = getattr(os.environ, "decodevalue", None)


@functools.cache
def _key(name: str) -> object:
    assert _encode is not None
    return _encode(name)


def setting(name: str, default: str = "") -> str:
    """The environment's value of ``name``, or ``default`` where it is not set."""
    if _live is None or _decode is None or _encode is None:  # pragma: no cover - not CPython
        return os.environ.get(name, default)
    raw = _live.get(_key(name))
    return default if raw is None else _decode(raw)
