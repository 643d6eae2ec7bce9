"""The trace as plain data: the JSON-ready dict of ``docs/trace-schema.md``.

:meth:`qkv.Trace.to_dict` builds it here; the JSON renderer (in the render package) only
serialises it. Non-finite numbers, which JSON cannot hold, are the strings ``"inf"``,
``"-inf"`` and ``"nan"``.

Examples
--------
>>> import qkv
>>> doc = qkv.explain([2, 1], [[1, 0], [3, 2]], d=4).to_dict()
>>> doc["schema"], doc["scores"]["scaled"], doc["scale"]["exact"]
('qkv.trace/1', [[1.0, 4.0]], '1/2')
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import InputError

__all__ = ["MAX_NUMBERS", "SCHEMA", "json_array", "trace_dict"]

#: The schema identifier written into every document.
SCHEMA = "qkv.trace/1"

#: The most numbers a document may hold, counted as ``L·S·(8 + dv)`` (the ``(L, S)`` steps and
#: the weighted values); larger traces are refused rather than written as gigabytes of JSON.
MAX_NUMBERS = 1 << 24


def _json_number(x: Any) -> Any:
    """A number as JSON holds it: a float, or a string for a non-finite one (not display text)."""
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    f = float(x)
    if math.isnan(f):
        return "nan"
    if math.isinf(f):
        return "inf" if f > 0 else "-inf"
    return f


def json_array(a: Any) -> Any:
    """An array as nested lists of JSON numbers (booleans stay booleans)."""
    if a is None:
        return None
    a = np.asarray(a)
    if a.dtype == bool:
        return a.tolist()
    if a.ndim == 0:
        return _json_number(a)
    return [json_array(x) for x in a]


def _exact(ex: Any, rows: Any) -> Any:
    if rows is None:
        return None
    if isinstance(rows, list):
        return [_exact(ex, r) for r in rows]
    text = ex.text(rows)
    if text in ("-oo", "oo"):
        return {
            "text": "-inf" if text == "-oo" else "inf",
            "latex": ex.latex(rows),
            "value": text.replace("oo", "inf"),
        }
    return {"text": text, "latex": ex.latex(rows), "value": ex.value(rows)}


def trace_dict(t: Any) -> dict[str, Any]:
    """The trace as plain Python objects (the JSON document before ``json.dumps``).

    ``t`` is a :class:`qkv.explanation.trace.Trace` (not imported: the trace module imports
    this one, and no module imports the one above it, even for typing)."""
    from .._version import __version__

    n = t.L * t.S * (8 + t.dv)
    if n > MAX_NUMBERS:
        raise InputError(
            f"json: the document would hold every number of every step, about L·S·(8 + dv) = "
            f"{n} for L = {t.L}, S = {t.S}, dv = {t.dv}, more than {MAX_NUMBERS}; use a "
            "summarised format (text, markdown, latex, html) or fewer rows or keys"
        )
    s = t.scale
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "qkv_version": __version__,
        "title": t.title,
        "stage": t.stage,
        "shape": {"L": t.L, "S": t.S, "d": t.d, "dv": t.dv, "single_query": t.squeeze},
        "dtype": str(t.q.dtype),
        "inputs": {"q": json_array(t.q), "k": json_array(t.k), "v": json_array(t.v)},
        "scale": {
            "value": s.value,
            "expression": s.expr.text,
            "formula": s.formula,
            "d": s.d,
            "d_given": s.d_given,
            "q_dim": s.q_dim,
            "substituted": s.substituted,
            "exact": s.exact_text,
            "text": s.describe(),
            "note": s.note,
        },
        "causal": t.causal,
        "window": None if t.window is None else list(t.window),
        "mask": json_array(t.mask),
        "bias": json_array(t.bias),
        "steps": {name: json_array(a) for name, a in t.steps.items()},
        "sink": t.sink,
        "sink_share": json_array(t.sink_share),
        "positions": [int(p) for p in t.positions],
        "labels": {
            "keys": None if t.key_labels is None else list(t.key_labels),
            "queries": None if t.query_labels is None else list(t.query_labels),
        },
        "scores": None,
        "softmax": None,
        "output": None,
        "exact": None,
    }
    if t.reaches("scores"):
        doc["scores"] = {
            "raw": json_array(t.raw),
            "dot_terms": [[t.dot_terms(i, j) for j in range(t.S)] for i in range(t.L)],
            "scaled": json_array(t.scaled),
        }
    if t.reaches("weights"):
        doc["softmax"] = {
            "logits": json_array(t.logits),
            "excluded": json_array(t.excluded),
            "reasons": [[t.reasons(i, j) for j in range(t.S)] for i in range(t.L)],
            "row_max": json_array(t.row_max),
            "shifted": json_array(t.shifted),
            "exps": json_array(t.exps),
            "sums": json_array(t.sums),
            "weights": json_array(t.weights),
            "lse": json_array(t.lse),
        }
    if t.reaches("output"):
        doc["output"] = {"weighted": json_array(t.weighted), "output": json_array(t.output)}
    if t.exact is not None:
        ex = t.exact
        doc["exact"] = {
            name: _exact(ex, getattr(ex, name))
            for name in (
                "scale",
                "raw",
                "scaled",
                "logits",
                "row_max",
                "shifted",
                "exps",
                "sums",
                "weights",
                "output",
            )
        }
    return doc
