"""Render study rows as a text table, Markdown, CSV or JSON.

Examples
--------
>>> rows = [{"d": 4, "mode": "scaled", "entropy": 3.6983},
...         {"d": 64, "mode": "unscaled", "entropy": 0.06}]
>>> print(render_rows(rows, "markdown", columns=["d", "mode", "entropy"]))
| d | mode | entropy |
|---:|:---|---:|
| 4 | scaled | 3.698 |
| 64 | unscaled | 0.06 |
>>> print(render_rows(rows, "csv"), end="")
d,mode,entropy
4,scaled,3.6983
64,unscaled,0.06
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence
from typing import Any

from ..errors import InputError

__all__ = ["FORMATS", "format_value", "render_rows", "write_csv"]

FORMATS = ("text", "markdown", "csv", "json")


def format_value(x: Any) -> str:
    """Four significant digits for floats (``nan`` as ``-``), ``str`` for the rest.

    Examples
    --------
    >>> [format_value(x) for x in (3.69831, 0.000123456, 4096.7, 12, "scaled", float("nan"))]
    ['3.698', '0.0001235', '4097', '12', 'scaled', '-']
    """
    if isinstance(x, float):
        return "-" if math.isnan(x) else f"{x:.4g}"
    return str(x)


def _csv_text(rows: Sequence[dict[str, Any]]) -> str:
    buf = io.StringIO()
    if rows:
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return buf.getvalue()


def write_csv(path: Any, rows: Sequence[dict[str, Any]]) -> None:
    """Write ``rows`` (dicts with the same keys) as CSV with a header line."""
    with open(path, "w", newline="", encoding="utf-8") as fh:
        fh.write(_csv_text(rows))


def render_rows(
    rows: Sequence[dict[str, Any]],
    fmt: str,
    *,
    columns: Sequence[str] | None = None,
    key: str = "rows",
) -> str:
    """Render ``rows`` in ``fmt`` (one of :data:`FORMATS`).

    ``columns`` picks the columns of the text and Markdown tables (CSV and JSON always carry
    every field); JSON is ``{key: rows}``.
    """
    if fmt not in FORMATS:
        raise InputError(f"format: expected one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt == "json":
        clean = [{k: _plain(v) for k, v in r.items()} for r in rows]
        return json.dumps({key: clean}, indent=1, allow_nan=False)
    if fmt == "csv":
        return _csv_text(rows)
    cols = list(columns) if columns is not None else (list(rows[0]) if rows else [])
    cells = [[format_value(r[c]) for c in cols] for r in rows]
    numeric = [all(not isinstance(r[c], str) for r in rows) for c in cols]
    if fmt == "markdown":
        lines = ["| " + " | ".join(cols) + " |"]
        lines.append("|" + "|".join("---:" if n else ":---" for n in numeric) + "|")
        lines += ["| " + " | ".join(row) + " |" for row in cells]
        return "\n".join(lines)
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]

    def line(vals: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if n else v.ljust(w) for v, w, n in zip(vals, widths, numeric, strict=True)
        ).rstrip()

    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(r) for r in cells])


def _plain(x: Any) -> Any:
    """A JSON-ready value: NumPy scalars and arrays as Python ones, NaN and infinity as null."""
    if hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, list):
        return [_plain(v) for v in x]
    return x
