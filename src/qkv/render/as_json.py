"""JSON: the trace's own dict (:meth:`qkv.Trace.to_dict`), serialised.

The document's schema is in ``docs/trace-schema.md``; :func:`decode` turns a loaded document's
numbers (``"-inf"`` for a non-finite one) back into arrays.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ..explanation.trace import Trace

__all__ = ["decode", "render"]


def decode(x: Any) -> np.ndarray:
    """Nested lists from a document back to a float array (``"-inf"`` -> ``-inf``)."""
    if isinstance(x, list):
        return np.array([decode(e) for e in x], dtype=float)
    return np.float64(float(x))


def render(trace: Trace, *, indent: int | None = 1, **_: Any) -> str:
    """The trace as a JSON document (``schema: "qkv.trace/1"``).

    Examples
    --------
    >>> import json, qkv
    >>> doc = json.loads(qkv.explain([2, 1], [[1, 0], [3, 2]], d=4).to_json())
    >>> doc["schema"], doc["scores"]["scaled"], doc["scale"]["exact"]
    ('qkv.trace/1', [[1.0, 4.0]], '1/2')
    """
    return json.dumps(trace.to_dict(), indent=indent, ensure_ascii=False, allow_nan=False) + "\n"
