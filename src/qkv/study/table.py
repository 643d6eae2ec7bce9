"""Render study rows as a text table, Markdown, CSV or JSON.

Text and Markdown tables are :class:`qkv.render.blocks.Table` blocks drawn by the same
renderers as the explanation's tables; CSV and JSON carry every field as data.

Examples
--------
>>> rows = [{"d": 4, "mode": "scaled", "entropy": 3.6983},
...         {"d": 64, "mode": "unscaled", "entropy": 0.06}]
>>> print(render_rows(rows, "markdown", columns=["d", "mode", "entropy"]))
| d | mode | entropy |
| --- | ---: | ---: |
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
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import InputError

__all__ = ["FORMATS", "format_value", "legend_text", "render_rows", "write_csv"]

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


def _csv_text(rows: Sequence[Mapping[str, Any]]) -> str:
    buf = io.StringIO()
    if rows:
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return buf.getvalue()


def write_csv(path: Any, rows: Sequence[Mapping[str, Any]]) -> None:
    """Write ``rows`` (dicts with the same keys) as CSV with a header line."""
    with open(path, "w", newline="", encoding="utf-8") as fh:
        fh.write(_csv_text(rows))


def legend_text(legend: Mapping[str, str], fmt: str) -> str:
    """What the columns mean, to print under a text or Markdown table ("" for CSV and JSON).

    Examples
    --------
    >>> print(legend_text({"d": "feature size"}, "markdown"))
    <BLANKLINE>
    <BLANKLINE>
    columns:
    <BLANKLINE>
    - `d`: feature size
    """
    if fmt not in ("text", "markdown"):
        return ""
    if fmt == "markdown":
        return "\n\ncolumns:\n\n" + "\n".join(f"- `{c}`: {text}" for c, text in legend.items())
    return "\n\ncolumns:\n" + "\n".join(f"  {c}: {text}" for c, text in legend.items())


def _table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> Any:
    """The rows as a :class:`qkv.render.blocks.Table`; text columns are left-aligned."""
    from ..render.blocks import Cell, Table

    kinds = ["text" if any(isinstance(r[c], str) for r in rows) else "num" for c in columns]
    return Table(
        header=[Cell(c, kind="label") for c in columns],
        rows=[
            [Cell(format_value(r[c]), kind=k) for c, k in zip(columns, kinds, strict=True)]
            for r in rows
        ],
    )


def render_rows(
    rows: Sequence[Mapping[str, Any]],
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
    from ..render import render_blocks

    cols = list(columns) if columns is not None else (list(rows[0]) if rows else [])
    return render_blocks([_table(rows, cols)], fmt).rstrip("\n")


def _plain(x: Any) -> Any:
    """A JSON-ready value: NumPy scalars and arrays as Python ones, NaN and infinity as null."""
    if hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, list):
        return [_plain(v) for v in x]
    return x
