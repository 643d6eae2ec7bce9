"""HTML: a self-contained page (or a fragment for Jupyter) with a heatmap of the weights.

No external resources: styles are inline, the heatmap is inline SVG, and a Content Security
Policy forbids the page from loading anything. Every text is escaped.
"""

from __future__ import annotations

import html
from typing import Any

import numpy as np

from ..explanation.display import fmt
from ..explanation.trace import Trace
from .blocks import Cell, Heading, Heatmap, Para, Table, build

__all__ = ["heatmap_grid", "heatmap_svg", "render", "render_blocks", "table_html"]

CSS = """
.qkv-trace { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; color: #1a1a1a;
  line-height: 1.45; max-width: 1100px; }
.qkv-trace h1 { font-size: 1.5em; margin: 0.4em 0; }
.qkv-trace h2 { font-size: 1.2em; margin: 1.2em 0 0.4em; border-bottom: 1px solid #ddd; }
.qkv-trace h3 { font-size: 1.05em; margin: 1em 0 0.3em; }
.qkv-trace p.formula { font-family: ui-monospace, "DejaVu Sans Mono", monospace;
  background: #f6f8fa; padding: 4px 8px; border-radius: 4px; }
.qkv-trace p.note { background: #fff8e1; border-left: 4px solid #f0b400; padding: 4px 8px; }
.qkv-trace table { border-collapse: collapse; margin: 0.4em 0 0.8em; font-size: 0.92em; }
.qkv-trace caption { caption-side: top; text-align: left; font-style: italic; color: #555;
  white-space: nowrap; }
.qkv-trace th, .qkv-trace td { border: 1px solid #d0d7de; padding: 3px 8px; }
.qkv-trace th { background: #f0f3f6; font-weight: 600; }
.qkv-trace td.num { text-align: right; font-family: ui-monospace, "DejaVu Sans Mono", monospace; }
.qkv-trace td.label { font-weight: 600; background: #fafbfc; }
.qkv-trace td.gap { color: #777; font-style: italic; text-align: center; }
.qkv-trace .masked { color: #9a9a9a; background: #f3f3f3; }
.qkv-trace td.label.masked { text-decoration: line-through; }
.qkv-trace .strong { font-weight: 700; color: #08306b; }
.qkv-trace .total { border-top: 2px solid #555; font-weight: 700; }
.qkv-trace div.side { display: flex; flex-wrap: wrap; gap: 0 28px; align-items: flex-start; }
.qkv-trace figure { margin: 0.5em 0 1em; }
.qkv-trace figcaption { color: #555; font-size: 0.9em; }
"""

_LOW, _HIGH = np.array([247, 251, 255]), np.array([8, 48, 107])


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def weight_color(w: float) -> str:
    """The fill for an attention weight: a colour scale from 0 (light) to 1 (dark)."""
    w = 0.0 if not np.isfinite(w) else min(max(w, 0.0), 1.0)
    r, g, b = (_LOW + (_HIGH - _LOW) * w).round().astype(int)
    return f"#{r:02x}{g:02x}{b:02x}"


def heatmap_svg(h: Heatmap) -> str:
    """The weights as an inline SVG grid: darker is more weight, grey × is excluded."""
    nr, nc = len(h.rows), len(h.cols)
    cell = h.cell or int(min(76, max(14, 640 // max(nr, nc, 1))))
    left, top = 64, 34
    width, height = left + nc * cell + 8, top + nr * cell + 8
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="qkv-heatmap" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{_e(h.title)}">',
        f'<text x="{left}" y="12" font-size="11" fill="#555">{_e(h.col_label)} →</text>',
        f'<text x="4" y="{top - 4}" font-size="11" fill="#555">{_e(h.row_label)} ↓</text>',
    ]
    every = 1 if cell >= 28 else int(np.ceil(28 / cell))
    for c, j in enumerate(h.cols):
        if j is not None and c % every and c != nc - 1:
            continue
        x = left + c * cell + cell / 2
        label = "…" if j is None else h.col_name(j)
        parts.append(
            f'<text x="{x:.1f}" y="{top - 6}" font-size="10" text-anchor="middle" '
            f'fill="#333">{_e(label)}</text>'
        )
    for r, i in enumerate(h.rows):
        y = top + r * cell
        label = "⋮" if i is None else h.row_name(i)
        if i is None or r % max(1, int(np.ceil(14 / cell))) == 0 or r == nr - 1:
            parts.append(
                f'<text x="{left - 6}" y="{y + cell / 2 + 4:.1f}" font-size="10" '
                f'text-anchor="end" fill="#333">{_e(label)}</text>'
            )
        for c, j in enumerate(h.cols):
            x = left + c * cell
            if i is None or j is None:
                parts.append(
                    f'<rect x="{x}" y="{y}" width="{cell}" height="{cell}" fill="#ffffff" '
                    'stroke="#eeeeee"/>'
                )
                continue
            w = float(h.weights[i, j])
            pair = f"{h.row_name(i)} → {h.col_name(j)}"
            if h.excluded[i, j]:
                fill, tip = "#d9d9d9", f"{pair}: excluded (weight 0)"
            else:
                fill, tip = weight_color(w), f"{pair}: weight {fmt(w)}"
            parts.append(
                f'<rect class="cell" x="{x}" y="{y}" width="{cell}" height="{cell}" '
                f'fill="{fill}" stroke="#ffffff"><title>{_e(tip)}</title></rect>'
            )
            if h.excluded[i, j] and cell >= 18:
                parts.append(
                    f'<text x="{x + cell / 2:.1f}" y="{y + cell / 2 + 4:.1f}" font-size="11" '
                    'text-anchor="middle" fill="#777">×</text>'
                )
            elif cell >= 60:  # the tables' digits (fmt), in cells wide enough for them
                ink = "#ffffff" if w > 0.5 else "#1a1a1a"
                parts.append(
                    f'<text x="{x + cell / 2:.1f}" y="{y + cell / 2 + 4:.1f}" font-size="10" '
                    f'text-anchor="middle" fill="{ink}">{_e(fmt(w))}</text>'
                )
    parts.append("</svg>")
    return "".join(parts)


def heatmap_grid(maps: list[Heatmap], caption: str = "") -> str:
    """Several heatmaps side by side (every head of a layer, say), each titled, as HTML."""
    figures = "".join(
        f'<figure class="qkv-grid-item"><figcaption>{_e(h.title)}</figcaption>'
        f"{heatmap_svg(h)}</figure>"
        for h in maps
    )
    note = f"<figcaption>{_e(caption)}</figcaption>" if caption else ""
    style = "display:flex;flex-wrap:wrap;gap:6px 18px"
    return f'<div class="qkv-grid" style="{style}">{figures}</div>{note}'


def _attrs(attrs: dict[str, str]) -> str:
    return "".join(f' {name}="{_e(value)}"' for name, value in attrs.items() if value != "")


def _cell(c: Cell, tag: str = "td") -> str:
    classes = " ".join([c.kind if c.kind != "text" else "txt"] + ([c.style] if c.style else []))
    attrs = {"class": classes, **c.attrs}
    text = _e(c.text) if c.text else "&nbsp;"
    tag = "th" if c.kind == "head" else tag
    return f"<{tag}{_attrs(attrs)}>{text}</{tag}>"


def table_html(t: Table) -> str:
    """A :class:`Table` block as an HTML ``<table>`` (the one table path of the HTML pages)."""
    out = [f"<table{_attrs(t.attrs)}>"]
    if t.caption:
        out.append(f"<caption>{_e(t.caption)}</caption>")
    out.append("<thead><tr>" + "".join(_cell(c, "th") for c in t.header) + "</tr></thead><tbody>")
    ncol = len(t.header)
    for r in t.rows:
        if r and r[0].kind == "gap" and r[0].text not in ("…", "⋮"):
            out.append(f'<tr><td class="gap" colspan="{ncol}">{_e(r[0].text)}</td></tr>')
            continue
        style = r[0].style if r and r[0].style in ("masked", "total") else ""
        cls = f' class="{style}"' if style else ""
        out.append(f"<tr{cls}>" + "".join(_cell(c) for c in r) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _body(blocks: list[Any]) -> str:
    out = []
    for n, b in enumerate(blocks):
        prev = blocks[n - 1] if n else None
        nxt = blocks[n + 1] if n + 1 < len(blocks) else None
        if isinstance(b, Table) and not isinstance(prev, Table) and isinstance(nxt, Table):
            out.append('<div class="side">')  # consecutive tables sit side by side
        if isinstance(b, Heading):
            out.append(f"<h{b.level}>{_e(b.text)}</h{b.level}>")
        elif isinstance(b, Para):
            cls = f' class="{b.style}"' if b.style else ""
            out.append(f"<p{cls}>{_e(b.text)}</p>")
        elif isinstance(b, Table):
            out.append(table_html(b))
            if isinstance(prev, Table) and not isinstance(nxt, Table):
                out.append("</div>")
        elif isinstance(b, Heatmap):
            shown = ""
            if b.counts and (len(b.rows) < b.counts["L"] or len(b.cols) < b.counts["S"]):
                shown = (
                    f" Showing the first and last rows and keys of {b.counts['L']} × "
                    f"{b.counts['S']}."
                )
            out.append(
                f"<h2>{_e(b.title)}</h2><figure>{heatmap_svg(b)}<figcaption>Attention weights: "
                f"row = query, column = key; darker is more weight, grey × is excluded."
                f"{_e(shown)}</figcaption></figure>"
            )
    return "\n".join(out)


def render(trace: Trace, *, fragment: bool = False, **options: Any) -> str:
    """The trace as HTML: a complete page, or a ``<div>`` fragment for Jupyter.

    Examples
    --------
    >>> import qkv
    >>> page = qkv.explain([2, 1], [[1, 0], [3, 2]], d=4, title="<b>x</b>").to_html()
    >>> page.startswith("<!DOCTYPE html>"), "&lt;b&gt;x&lt;/b&gt;" in page, "<b>x" in page
    (True, True, False)
    """
    return render_blocks(build(trace, **options), fragment=fragment)


def render_blocks(blocks: list[Any], *, fragment: bool = False) -> str:
    """Blocks as a complete HTML page, or a fragment."""
    body = f'<div class="qkv-trace">\n{_body(blocks)}\n</div>'
    if fragment:
        return f"<style>{CSS}</style>\n{body}\n"
    title = next((b.text for b in blocks if isinstance(b, Heading)), "qkv trace")
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "style-src 'unsafe-inline'; img-src data:\">\n"
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{_e(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n{body}\n"
        "</body>\n</html>\n"
    )
