"""A page to explore the three readings of the scale: divide by √d, multiply by √d, none.

:func:`explore_page` asks the explanation layer for one trace per reading of the same inputs
(:func:`qkv.explanation.readings.scale_readings`) and embeds every number the page shows,
already formatted (and every heatmap colour), as JSON in a self-contained HTML page; its small
script only swaps which reading is shown and highlights on hover — it does no arithmetic, so
the page shows exactly the library's numbers.

- The toggle (also ``#reading=divide|multiply|none`` in the address) switches the scale.
- Hovering a weight highlights its key, the key's dot-product terms and its share
  ``weight · v`` of the output.
- Keys a query may not attend (causal, window, mask) are greyed and marked ``×`` in the heatmap
  and the tables, with the reason.

Examples
--------
>>> import qkv
>>> page = explore_page(qkv.explain([2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4]], d=4))
>>> page.startswith("<!DOCTYPE html>"), "0.95257" in page, '"16"' in page
(True, True, True)
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import InputError
from ..explanation.display import fmt
from ..explanation.readings import READINGS, scale_readings
from ..explanation.trace import Trace
from .as_html import table_html, weight_color
from .blocks import Cell, Table
from .style import PAGE_CSS

__all__ = ["explore_page"]

#: The most query-key pairs the page embeds (every number of every reading).
MAX_PAIRS = 4096


def _strings(a: np.ndarray) -> list[Any]:
    return [_strings(x) for x in a] if a.ndim > 1 else [fmt(x) for x in a]


def _vec(v: np.ndarray, limit: int = 6) -> str:
    if len(v) <= limit:
        return "[" + ", ".join(fmt(x) for x in v) + "]"
    return "[" + ", ".join([fmt(x) for x in v[:4]] + ["…"] + [fmt(x) for x in v[-1:]]) + "]"


def _reading_data(t: Trace, row: int) -> dict[str, Any]:
    L, S = t.L, t.S
    # explore_page only takes traces that reach the weights
    assert t.scaled is not None and t.excluded is not None and t.weights is not None
    assert t.shifted is not None and t.exps is not None
    assert t.row_max is not None and t.sums is not None
    colors = [
        ["#d9d9d9" if t.excluded[i, j] else weight_color(float(t.weights[i, j])) for j in range(S)]
        for i in range(L)
    ]
    data = {
        "scale": fmt(t.scale.value),
        "describe": t.scale.describe(),
        "note": t.scale.note or "",
        "header": f"× {t.scale.substituted}",
        "scaled": _strings(t.scaled),
        "shifted": _strings(t.shifted),
        "exps": _strings(t.exps),
        "weights": _strings(t.weights),
        "short": [[fmt(round(float(w), 3)) for w in r] for r in t.weights],
        "colors": colors,
        "ink": [
            [
                "#777777" if t.excluded[i, j] else "#ffffff" if t.weights[i, j] > 0.5 else "#111111"
                for j in range(S)
            ]
            for i in range(L)
        ],
        "rowMax": fmt(t.row_max[row]),
        "sum": fmt(t.sums[row]),
    }
    if t.reaches("output"):
        assert t.output is not None
        data["share"] = [_vec(t.weighted_row(row)[j]) for j in range(S)]
        data["output"] = _vec(t.output[row])
    return data


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


CSS = (
    PAGE_CSS
    + """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; color: #1a1a1a;
  max-width: 1200px; margin: 1em auto; padding: 0 1em; line-height: 1.45; }
h1 { font-size: 1.45em; } h2 { font-size: 1.15em; border-bottom: 1px solid #ddd; }
.toggle button { font: inherit; padding: 4px 12px; margin-right: 6px; border: 1px solid #8aa;
  background: #fff; border-radius: 4px; cursor: pointer; }
table { border-collapse: collapse; margin: 0.4em 0 1em; font-size: 0.9em; }
th { background: #f0f3f6; }
td.terms { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 0.85em; }
table.heat td.w { width: 52px; height: 30px; text-align: center; font-size: 0.75em; padding: 0; }
tr.masked { color: #888; background: #f0f0f0; }
tr.masked td.key { text-decoration: line-through; }
.hl { outline: 3px solid #e6550d; outline-offset: -3px; }
.hl:not(.w) { background: #fee6ce; }
.explained { font-weight: 700; }
"""
)

SCRIPT = """
(function () {
  var D = JSON.parse(document.getElementById("qkv-data").textContent);
  var errors = [];
  window.addEventListener("error", function (e) {
    errors.push(String(e.message)); document.body.setAttribute("data-errors", errors.join("|"));
  });
  function all(sel) { return Array.prototype.slice.call(document.querySelectorAll(sel)); }
  function show(name) {
    var R = D.readings[name];
    if (!R) { name = D.initial; R = D.readings[name]; }
    document.body.setAttribute("data-reading", name);
    all(".toggle button").forEach(function (b) {
      b.setAttribute("aria-pressed", b.getAttribute("data-reading") === name ? "true" : "false");
    });
    document.getElementById("describe").textContent = R.describe;
    document.getElementById("note").textContent = R.note;
    document.getElementById("scaled-head").textContent = R.header;
    all("[data-field]").forEach(function (el) {
      var f = el.getAttribute("data-field"), i = el.getAttribute("data-i");
      var j = el.getAttribute("data-j"), v = R[f];
      if (v === undefined) { return; }
      if (i !== null) { v = v[+i]; }
      if (j !== null) { v = v[+j]; }
      var out = el.getAttribute("data-excluded") === "1";
      if (out && (f === "weights" || f === "short")) { v = "×"; }
      el.textContent = v;
    });
    all("td.w").forEach(function (el) {
      var i = +el.getAttribute("data-i"), j = +el.getAttribute("data-j");
      el.style.background = R.colors[i][j];
      el.style.color = R.ink[i][j];
    });
  }
  function highlight(j) {
    all(".hl").forEach(function (el) { el.classList.remove("hl"); });
    if (j === null) { return; }
    all('[data-key="' + j + '"]').forEach(function (el) { el.classList.add("hl"); });
  }
  function fromHash() {
    var h = {}; location.hash.replace(/^#/, "").split("&").forEach(function (kv) {
      var p = kv.split("="); if (p[0]) { h[p[0]] = p[1] || ""; }
    });
    show(h.reading || D.initial);
    highlight(h.hover === undefined ? null : h.hover);
  }
  all(".toggle button").forEach(function (b) {
    b.addEventListener("click", function () {
      location.hash = "reading=" + b.getAttribute("data-reading");
    });
  });
  all("[data-hover]").forEach(function (el) {
    el.addEventListener("mouseenter", function () { highlight(el.getAttribute("data-hover")); });
    el.addEventListener("mouseleave", function () { highlight(null); });
  });
  window.addEventListener("hashchange", fromHash);
  fromHash();
  document.body.setAttribute("data-ready", "1");
})();
"""


def explore_page(
    trace: Trace,
    *,
    row: int | None = None,
    title: str | None = None,
    extra_sections: Sequence[tuple[str, str]] = (),
) -> str:
    """A self-contained HTML page exploring the three readings of the scale for ``trace``.

    Parameters
    ----------
    trace : qkv.Trace
        Inputs, masks and labels to explore; it must reach the weights.
    row : int, optional
        The query row explained key by key (default: the trace's last row).
    title : str, optional
    extra_sections : sequence of (heading, html)
        Trusted HTML appended as sections (the library's own, e.g. a grid of heatmaps).

    Returns
    -------
    str
        The page; it loads nothing (a Content Security Policy forbids it).
    """
    if not trace.reaches("weights"):
        raise InputError("trace: the explore page needs a trace that reaches the weights")
    if trace.L * trace.S > MAX_PAIRS:
        raise InputError(
            f"q, k: the explore page embeds every number, and L·S = {trace.L * trace.S} is more "
            f"than {MAX_PAIRS}; use fewer rows or keys"
        )
    row = trace.L - 1 if row is None else int(row)
    if not 0 <= row < trace.L:
        raise InputError(f"row: expected 0 to {trace.L - 1}, got {row}")
    readings = scale_readings(trace)
    traces, initial, ref = readings.traces, readings.initial, readings.shown
    L, S, i = ref.L, ref.S, row
    data: dict[str, Any] = {
        "initial": initial,
        "row": i,
        "readings": {k: _reading_data(t, i) for k, t in traces.items()},
    }
    title = title or "Explore the scale: divide by √d, multiply by √d, or none"
    qn = ref.query_label(i)
    out = [f"<h1>{_e(title)}</h1>"]
    out.append(
        "<p>The same inputs under three readings of the scale. Every number on this page was "
        "computed by qkv and embedded in it; the buttons only switch which reading is shown. "
        "Hover over a weight to see its key, its dot-product terms and its share of the "
        "output.</p>"
    )
    out.append('<div class="toggle">')
    for key, text, _ in READINGS:
        out.append(f'<button type="button" data-reading="{key}">{_e(text)}</button>')
    out.append("</div>")
    out.append(f'<p class="formula" id="describe">{_e(ref.scale.describe())}</p>')
    out.append(f'<p class="note" id="note">{_e(ref.scale.note or "")}</p>')
    assert ref.excluded is not None  # the trace reaches the weights (checked above)
    if ref.excluded.any():
        rules = sorted({r for a in range(L) for b in range(S) for r in ref.reasons(a, b)})
        out.append(
            f"<p>Excluded pairs ({_e(', '.join(rules))}) are grey and marked × everywhere: "
            "they get weight 0 under every reading.</p>"
        )

    out.append("<h2>Weights of every query (rows) over every key (columns)</h2>")
    out.append(table_html(_heat_table(ref, i, data["readings"][initial]["colors"])))
    out.append(f"<h2>Query {_e(qn)}, key by key</h2>")
    out.append(table_html(_steps_table(ref, i)))
    out.append(
        '<p class="formula">row max = <span data-field="rowMax"></span>; Σ exp = '
        '<span data-field="sum"></span>; weight = exp / Σ'
        + (
            '; output = Σ weight · v = <span data-field="output" id="output"></span>'
            if ref.v is not None
            else ""
        )
        + "</p>"
    )

    out.append("<h2>Inputs</h2>")
    out.append(f'<p class="formula">{_e(qn)}: q = {_e(_vec(ref.q[i]))}</p>')
    out.append(table_html(_inputs_table(ref)))
    for heading, body in extra_sections:
        out.append(f"<h2>{_e(heading)}</h2>{body}")

    blob = json.dumps(data, ensure_ascii=False).replace("<", "\\u003c")
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:\">\n"
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{_e(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n"
        + "\n".join(out)
        + f'\n<script type="application/json" id="qkv-data">{blob}</script>\n'
        f"<script>{SCRIPT}</script>\n</body>\n</html>\n"
    )


# ----- the page's tables, as Table blocks (drawn by as_html.table_html) -----


def _heat_table(t: Trace, row: int, colors: list[list[str]]) -> Table:
    """Every weight (rounded) in a coloured cell; the explained row's cells lead the hover."""
    assert t.excluded is not None and t.weights is not None  # the trace reaches the weights
    header = [Cell("", kind="label")] + [Cell(t.key_label(j), kind="label") for j in range(t.S)]
    rows = []
    for a in range(t.L):
        cells = [Cell(t.query_label(a), kind="head", attrs={"class": "explained" * (a == row)})]
        for b in range(t.S):
            out = bool(t.excluded[a, b])
            tip = f"{t.query_label(a)} → {t.key_label(b)}"
            if out:
                tip += f": excluded ({t.reason_text(a, b)})"
            attrs = {"class": "w", "title": tip, "data-field": "short", "data-i": str(a)}
            attrs.update({"data-j": str(b), "data-excluded": str(int(out))})
            if a == row:
                attrs.update({"data-hover": str(b), "data-key": str(b)})
            attrs["style"] = f"background:{colors[a][b]}"
            text = "×" if out else fmt(round(float(t.weights[a, b]), 3))
            cells.append(Cell(text, attrs=attrs))
        rows.append(cells)
    return Table(header, rows, attrs={"class": "heat"})


def _steps_table(t: Trace, i: int) -> Table:
    """Query row ``i`` key by key; the page's script fills the cells of the chosen reading."""
    names = ["key", "q·k (terms)", "raw", "", "excluded?", "s − max", "exp", "weight"]
    if t.v is not None:
        names.append("weight · v (share of the output)")
    header = [Cell(name, kind="label") for name in names]
    header[3].attrs["id"] = "scaled-head"
    assert t.raw is not None and t.excluded is not None  # the trace reaches the weights

    def filled(field: str, j: int, **more: str) -> Cell:
        return Cell("", attrs={"data-field": field, "data-i": str(i), "data-j": str(j), **more})

    rows = []
    for j in range(t.S):
        out = bool(t.excluded[i, j])
        key = {"data-key": str(j)}
        reason = ("yes — " + t.reason_text(i, j)) if out else "no"
        row = [
            Cell(t.key_label(j), kind="text", style="masked" * out, attrs={"class": "key", **key}),
            Cell(t.dot_terms(i, j), kind="text", attrs={"class": "terms", **key}),
            Cell(fmt(t.raw[i, j])),
            filled("scaled", j),
            Cell(reason, kind="text", attrs={"class": ""}),
            filled("shifted", j),
            filled("exps", j),
            filled("weights", j, **{"class": "num weight"}, **{"data-excluded": str(int(out))}),
        ]
        row[-1].attrs["data-hover"] = str(j)
        if t.v is not None:
            row.append(Cell("", attrs={"data-field": "share", "data-i": str(j), **key}))
        rows.append(row)
    return Table(header, rows, attrs={"class": "steps"})


def _inputs_table(t: Trace) -> Table:
    """Each key's k (and v) vector."""
    header = [Cell("key", kind="label"), Cell("k", kind="label")]
    if t.v is not None:
        header.append(Cell("v", kind="label"))
    rows = []
    for j in range(t.S):
        row = [Cell(t.key_label(j), kind="text", attrs={"class": "key", "data-key": str(j)})]
        row.append(Cell(_vec(t.k[j]), kind="text", attrs={"class": ""}))
        if t.v is not None:
            row.append(Cell(_vec(t.v[j]), kind="text", attrs={"class": ""}))
        rows.append(row)
    return Table(header, rows)
