"""Markdown: headings, pipe tables and paragraphs; every text is escaped."""

from __future__ import annotations

import re
from typing import Any

from .blocks import Cell, Heading, Heatmap, Para, Table, build

__all__ = ["escape", "render", "render_blocks"]

# "_" between two letters or digits never starts emphasis (CommonMark), so it stays as is.
_SPECIAL = re.compile(r"([\\`*<>|#~]|(?<![^\W_])_|_(?![^\W_])|\[(?=[^\]]*\]\())")


def escape(text: str) -> str:
    """Escape Markdown (and inline HTML) metacharacters.

    Examples
    --------
    >>> print(escape("a|b <script> *x* [1, 2] [a](b)"))
    a\\|b \\<script\\> \\*x\\* [1, 2] \\[a](b)
    """
    return _SPECIAL.sub(r"\\\1", text.replace("&", "&amp;"))


def _cell(c: Cell) -> str:
    text = escape(c.text) if c.text else " "
    if c.style == "masked":
        return f"~~{text}~~" if c.kind == "label" else text
    if c.style in ("strong", "total") and c.text:
        return f"**{text}**"
    return text


def render_blocks(blocks: list[Any]) -> str:
    out: list[str] = []
    for b in blocks:
        if isinstance(b, Heading):
            out += ["#" * b.level + " " + escape(b.text), ""]
        elif isinstance(b, Para):
            text = escape(b.text)
            out += [f"> {text}" if b.style == "note" else text, ""]
        elif isinstance(b, Table):
            if b.caption:
                out += [f"*{escape(b.caption)}*", ""]
            ncol = len(b.header)
            out.append("| " + " | ".join(_cell(c) for c in b.header) + " |")
            out.append("|" + "|".join([" --- "] + [" ---: "] * (ncol - 1)) + "|")
            for r in b.rows:
                cells = [_cell(c) for c in r] + [" "] * (ncol - len(r))
                out.append("| " + " | ".join(cells) + " |")
            out.append("")
        elif isinstance(b, Heatmap):
            continue
    return "\n".join(out).rstrip("\n") + "\n"


def render(trace: Any, **options: Any) -> str:
    """The trace as Markdown (GitHub-flavoured tables).

    Examples
    --------
    >>> import qkv
    >>> md = qkv.explain([2, 1], [[1, 0], [3, 2]], d=4).to_markdown()
    >>> md.splitlines()[0]
    '# Scaled dot-product attention, step by step'
    """
    return render_blocks(build(trace, **options))
