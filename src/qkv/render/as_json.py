"""JSON: every step's numbers, in the schema documented in ``docs/trace-schema.md``.

Non-finite numbers, which JSON cannot hold, are written as the strings ``"inf"``, ``"-inf"``
and ``"nan"``; :func:`decode` turns a loaded document's numbers back into arrays.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from ..errors import InputError
from ..explanation.trace import Trace

__all__ = ["MAX_NUMBERS", "SCHEMA", "decode", "render", "trace_dict"]

#: The schema identifier written into every document.
SCHEMA = "qkv.trace/1"

#: The most numbers a document may hold, counted as ``L·S·(8 + dv)`` (the ``(L, S)`` steps and
#: the weighted values); larger traces are refused rather than written as gigabytes of JSON.
MAX_NUMBERS = 1 << 24


def _num(x: Any) -> Any:
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    f = float(x)
    if math.isnan(f):
        return "nan"
    if math.isinf(f):
        return "inf" if f > 0 else "-inf"
    return f


def _arr(a: Any) -> Any:
    if a is None:
        return None
    a = np.asarray(a)
    if a.dtype == bool:
        return a.tolist()
    if a.ndim == 0:
        return _num(a)
    return [_arr(x) for x in a]


def decode(x: Any) -> np.ndarray:
    """Nested lists from a document back to a float array (``"-inf"`` -> ``-inf``)."""
    if isinstance(x, list):
        return np.array([decode(e) for e in x], dtype=float)
    return np.float64(float(x))


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


def trace_dict(t: Trace) -> dict[str, Any]:
    """The trace as plain Python objects (the JSON document before ``json.dumps``)."""
    from .. import __version__

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
        "inputs": {"q": _arr(t.q), "k": _arr(t.k), "v": _arr(t.v)},
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
        "mask": _arr(t.mask),
        "bias": _arr(t.bias),
        "steps": {name: _arr(a) for name, a in t.steps.items()},
        "sink": t.sink,
        "sink_share": _arr(t.sink_share),
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
            "raw": _arr(t.raw),
            "dot_terms": [[t.dot_terms(i, j) for j in range(t.S)] for i in range(t.L)],
            "scaled": _arr(t.scaled),
        }
    if t.reaches("weights"):
        doc["softmax"] = {
            "logits": _arr(t.logits),
            "excluded": _arr(t.excluded),
            "reasons": [[t.reasons(i, j) for j in range(t.S)] for i in range(t.L)],
            "row_max": _arr(t.row_max),
            "shifted": _arr(t.shifted),
            "exps": _arr(t.exps),
            "sums": _arr(t.sums),
            "weights": _arr(t.weights),
            "lse": _arr(t.lse),
        }
    if t.reaches("output"):
        doc["output"] = {"weighted": _arr(t.weighted), "output": _arr(t.output)}
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


def render(trace: Trace, *, indent: int | None = 1, **_: Any) -> str:
    """The trace as a JSON document (``schema: "qkv.trace/1"``).

    Examples
    --------
    >>> import json, qkv
    >>> doc = json.loads(qkv.explain([2, 1], [[1, 0], [3, 2]], d=4).to_json())
    >>> doc["schema"], doc["scores"]["scaled"], doc["scale"]["exact"]
    ('qkv.trace/1', [[1.0, 4.0]], '1/2')
    """
    return json.dumps(trace_dict(trace), indent=indent, ensure_ascii=False, allow_nan=False) + "\n"
