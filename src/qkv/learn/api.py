"""The live page's answers: form fields in, the library's numbers out (plain JSON data).

:func:`explain_fields` reads the fields as a learner types them (``"1,0; 3,2"``: rows by ``;``,
entries by commas or spaces, fractions and small expressions such as ``1/3`` allowed), asks
:func:`qkv.explain` for every step, and returns both the trace's own document
(:meth:`qkv.Trace.to_dict`) and the same numbers already formatted for the page. The page does
no arithmetic: it draws what comes back. Bad input raises :class:`FieldError`, a
:class:`qkv.InputError` that knows which field it is about.

Examples
--------
>>> r = explain_fields({"q": "2,1", "k": "1,0;3,2", "v": "1,2;3,4", "d": "4"})
>>> r["shown"]["weights"], r["shown"]["output"]
([['0.04743', '0.95257']], [['2.90515', '3.90515']])
>>> explain_fields({"q": "2,1", "k": "1,0;3", "v": "1,2;3,4"})
Traceback (most recent call last):
...
qkv.learn.api.FieldError: k: rows have different lengths
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..checks import parse_int, parse_window
from ..errors import InputError
from ..explanation.display import fmt
from ..explanation.practice import read_answer
from ..explanation.readings import READINGS
from ..explanation.trace import Trace, explain
from ..masks import exclusion_reasons
from ..render.as_html import weight_color

__all__ = [
    "FIELDS",
    "MAX_PAIRS",
    "FieldError",
    "explain_fields",
    "field_of",
    "fields_of",
    "step_view",
    "trace_fields",
]

#: The fields of the page's form, by the name the library's messages use.
FIELDS = ("q", "k", "v", "d", "reading", "causal", "align", "mask", "window", "exact")

#: The most query-key pairs the live page explains at once (every step is drawn).
MAX_PAIRS = 4096

#: The rows of the step view, in order: (key, heading, how the step is made).
STEPS = (
    ("raw", "scores q·kⱼ", "the dot product of the query row with each key"),
    ("scaled", "scaled scores", "each score times the scale"),
    ("logits", "masked scores", "−∞ where a key may not be attended (causal, window, mask)"),
    ("row_max", "row maximum", "the largest masked score of each row (0 when none is finite)"),
    ("shifted", "minus the maximum", "masked score − row maximum: every entry ≤ 0"),
    ("exps", "exponentials", "exp of each shifted score (0 for an excluded key)"),
    ("sums", "row sums", "the sum of each row's exponentials"),
    ("weights", "weights", "exponential / row sum: each row adds up to 1 (or is all 0)"),
    ("output", "output", "Σⱼ weightⱼ · vⱼ, one row per query"),
)


class FieldError(InputError):
    """Bad input in one field of the page; ``field`` names it (one of :data:`FIELDS`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def fields_of(message: str) -> list[str]:
    """The fields a library message is about, from the argument names that start it.

    >>> fields_of("k: expected a 2-D array"), fields_of("k, v: S differs"), fields_of("x")
    (['k'], ['k', 'v'], [])
    """
    head = message.split(":", 1)[0] if ":" in message else ""
    names = [n.strip().lower() for n in head.replace(" and ", ",").split(",")]
    return [n for n in names if n in FIELDS]


def field_of(message: str) -> str | None:
    """The first field a library message is about (``None`` when it names none)."""
    return next(iter(fields_of(message)), None)


def _text(fields: dict[str, Any], name: str) -> str:
    value = fields.get(name, "")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise FieldError(name, f"{name}: expected text, got {type(value).__name__}")
    return value.strip()


def _matrix(fields: dict[str, Any], name: str, *, required: bool = True) -> np.ndarray | None:
    text = _text(fields, name)
    if not text:
        if required:
            raise FieldError(name, f"{name}: required (numbers split by commas, rows by ';')")
        return None
    try:
        return read_answer(text)
    except InputError as exc:
        raise FieldError(name, f"{name}: {exc}") from None


def _flag(fields: dict[str, Any], name: str) -> bool:
    value = fields.get(name, False)
    if not isinstance(value, bool):
        raise FieldError(name, f"{name}: expected true or false, got {value!r}")
    return value


def _window(text: str) -> tuple[int | None, int | None] | None:
    if not text:
        return None
    try:
        window = parse_window(text, "window")
    except InputError as exc:
        raise FieldError("window", str(exc)) from None
    return None if window == (None, None) else window


def _mask(text: str, L: int, S: int) -> np.ndarray | None:
    if not text:
        return None
    try:
        m = np.atleast_2d(read_answer(text))
    except InputError as exc:
        raise FieldError("mask", f"mask: {exc}") from None
    if not np.isin(m, (0, 1)).all():
        raise FieldError("mask", "mask: expected 1 (may attend) or 0 (may not), entry by entry")
    if m.shape not in ((1, S), (L, S)):
        raise FieldError(
            "mask",
            f"mask: expected {S} numbers (one per key) or {L} rows of {S}, "
            f"got {m.shape[0]} rows of {m.shape[1]}",
        )
    return np.broadcast_to(m.astype(bool), (L, S))


def trace_fields(
    fields: dict[str, Any],
) -> tuple[Trace, np.ndarray | None, np.ndarray | None]:
    """The trace the fields ask for, the top-left causal cells it excludes and the mask field
    (each ``None`` when not asked for).

    Causal attention in qkv is bottom-right aligned (query row ``i`` of ``L`` sits at position
    ``S − L + i``); ``align = "top-left"`` (PyTorch's ``is_causal=True``) is given to the
    library as the boolean mask ``j ≤ i``, combined with the mask field.
    """
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise FieldError(unknown[0], f"{unknown[0]}: not a field of the page")
    q, k, v = (_matrix(fields, n, required=n != "v") for n in ("q", "k", "v"))
    assert q is not None and k is not None  # required
    k = np.atleast_2d(k)
    if v is not None:
        v = np.atleast_2d(v)  # one row typed is one key's value
    d_text = _text(fields, "d")
    d = parse_int(d_text, "d", minimum=1) if d_text else None
    reading = fields.get("reading") or "divide"
    scales = {key: expr for key, _, expr in READINGS}
    if reading not in scales:
        raise FieldError("reading", f"reading: expected one of {', '.join(scales)}")
    expr = scales[reading]
    kw: dict[str, Any] = {"scale": expr} if expr != "1/sqrt(d)" else {}
    if "d" in expr:
        kw["d"] = d
    elif d is not None:
        kw["scale"] = 1  # no scale: d plays no part
    causal, exact = _flag(fields, "causal"), _flag(fields, "exact")
    align = fields.get("align") or "bottom-right"
    if align not in ("bottom-right", "top-left"):
        raise FieldError("align", "align: expected bottom-right or top-left")
    L, S = (1 if q.ndim == 1 else q.shape[0]), k.shape[0]
    if L * S > MAX_PAIRS:
        raise FieldError("q", f"q, k: the page draws every step of L·S ≤ {MAX_PAIRS} pairs")
    mask = user = _mask(_text(fields, "mask"), L, S)
    top_left = None
    if causal and align == "top-left":
        top_left = np.arange(S)[None, :] > np.arange(L)[:, None]
        mask = ~top_left if mask is None else mask & ~top_left
        causal = False
    t = explain(
        q, k, v, causal=causal, mask=mask, window=_window(_text(fields, "window")), exact=exact,
        **kw,
    )  # fmt: skip
    return t, top_left, user


def _shown(a: np.ndarray) -> list[list[str]]:
    a = np.asarray(a)
    rows = a[:, None] if a.ndim == 1 else a
    return [[fmt(x) for x in r] for r in rows]


def _reasons(t: Trace, top_left: np.ndarray | None, user: np.ndarray | None) -> list[list[str]]:
    """Why each excluded key is excluded, in words (empty for a key that is attended)."""
    out = []
    for i in range(t.L):
        row = []
        for j in range(t.S):
            rules, p, parts = t.reasons(i, j), int(t.positions[i]), []
            if "causal" in rules or "window" in rules:
                win = t.window if "window" in rules else None
                parts += exclusion_reasons(p, j, "causal" in rules, win)
            if top_left is not None and top_left[i, j]:
                parts.append(f"causal (top-left): key {j} comes after query row {i}")
            if user is not None and not user[i, j]:
                parts.append("mask is 0")
            row.append("; ".join(parts))
        out.append(row)
    return out


def explain_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """Every step for the page's fields: the trace's document and the numbers as shown.

    Returns
    -------
    dict
        ``trace`` (:meth:`qkv.Trace.to_dict`), ``shown`` (each step of :data:`STEPS` as rows
        of formatted numbers), ``steps`` (their headings), ``scale`` (the scale in words),
        ``excluded`` and ``reasons`` (why each excluded key is), ``colors`` (the heatmap's),
        ``dots`` (each score's dot product written out) and, with ``exact``, ``exact`` (each
        step's exact values as text).

    Raises
    ------
    FieldError
        For bad input, naming the field; the message is the library's.
    """
    try:
        t, top_left, user = trace_fields(fields)
    except FieldError:
        raise
    except InputError as exc:
        raise FieldError(field_of(str(exc)) or "q", str(exc)) from None
    return step_view(t, top_left, user)


def step_view(
    t: Trace, top_left: np.ndarray | None = None, user: np.ndarray | None = None
) -> dict[str, Any]:
    """A trace as the page's step view (see :func:`explain_fields` for the keys); ``top_left``
    and ``user`` are the cells a top-left causal rule and a mask field exclude, for the
    reasons shown."""
    assert t.weights is not None and t.excluded is not None  # a view is of a trace's weights
    doc = t.to_dict()
    shown = {key: _shown(getattr(t, key)) for key, _, _ in STEPS if getattr(t, key) is not None}
    colors = [
        [
            "#d9d9d9" if t.excluded[i, j] else weight_color(float(t.weights[i, j]))
            for j in range(t.S)
        ]
        for i in range(t.L)
    ]
    out: dict[str, Any] = {
        "trace": doc,
        "shown": shown,
        "steps": [{"key": k, "title": h, "how": w} for k, h, w in STEPS if k in shown],
        "scale": t.scale.describe(),
        "note": t.scale.note or "",
        "excluded": t.excluded.tolist(),
        "reasons": _reasons(t, top_left, user),
        "colors": colors,
        "dots": doc["scores"]["dot_terms"],
        "shape": doc["shape"],
        "keys": [t.key_label(j) for j in range(t.S)],
        "queries": [t.query_label(i) for i in range(t.L)],
    }
    if doc["exact"] is not None:
        ex = doc["exact"]
        out["exact"] = {
            key: [[c["text"] for c in row] for row in _rows(ex[key])]
            for key, _, _ in STEPS
            if ex.get(key) is not None
        }
    return out


def _rows(cells: Any) -> list[Any]:
    """Exact cells as rows (a per-row value such as the maximum becomes a column)."""
    return [c if isinstance(c, list) else [c] for c in cells]
