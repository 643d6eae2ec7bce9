"""Terminal text: headings underlined, aligned tables, numbers to at least 4 significant digits."""

from __future__ import annotations

import textwrap
from typing import Any

from .blocks import Heading, Heatmap, Para, Table, build

__all__ = ["render", "render_blocks", "table_lines"]

WIDTH = 100


def table_lines(t: Table) -> list[str]:
    """An aligned table: header, a rule, rows; excluded keys are marked with ``×``."""
    rows = [t.header] + t.rows
    ncol = max(len(r) for r in rows)
    gap = [
        n > 0 and bool(r) and r[0].kind == "gap" and r[0].text != "…" for n, r in enumerate(rows)
    ]
    grid = [
        [c.text + (" ×" if c.style == "masked" and n == 0 else "") for n, c in enumerate(r)]
        + [""] * (ncol - len(r))
        for r in rows
    ]
    right = [[c.kind == "num" for c in r] + [False] * (ncol - len(r)) for r in rows]
    widths = [
        max(len(g[c]) for g, is_gap in zip(grid, gap, strict=True) if not is_gap)
        for c in range(ncol)
    ]

    def line(n: int) -> str:
        if gap[n]:
            return "  " + grid[n][0]
        cells = [
            x.rjust(w) if (n > 0 and right[n][c]) else x.ljust(w)
            for c, (x, w) in enumerate(zip(grid[n], widths, strict=True))
        ]
        return "  " + "  ".join(cells).rstrip()

    out = []
    if t.caption:
        out.append("  " + t.caption)
    out.append(line(0))
    out.append("  " + "  ".join("─" * w for w in widths))
    out += [line(n) for n in range(1, len(rows))]
    return out


def render_blocks(blocks: list[Any]) -> str:
    out: list[str] = []
    for b in blocks:
        if isinstance(b, Heading):
            if out:
                out.append("")
            out.append(b.text)
            out.append(("=" if b.level == 1 else "-" if b.level == 2 else "·") * len(b.text))
        elif isinstance(b, Para):
            prefix = "  " if b.style == "formula" else ""
            out += textwrap.wrap(
                b.text, WIDTH, initial_indent=prefix, subsequent_indent=prefix + "  "
            ) or [""]
        elif isinstance(b, Table):
            out.append("")
            out += table_lines(b)
            out.append("")
        elif isinstance(b, Heatmap):
            continue  # the weights table in "Results" carries the same numbers
    text = "\n".join(out)
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    return text.strip("\n") + "\n"


def render(trace: Any, **options: Any) -> str:
    """The trace as plain text for a terminal.

    Examples
    --------
    >>> import qkv
    >>> text = qkv.explain([2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4]], d=4).to_text()
    >>> "0.95257" in text and "2·3 + 1·2 = 8" in text and "[2.90515, 3.90515]" in text
    True
    """
    return render_blocks(build(trace, **options))
