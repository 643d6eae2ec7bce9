"""One document model for every format: a trace becomes a list of blocks.

Headings, paragraphs, tables and a heatmap; the text, Markdown, LaTeX and HTML renderers only
decide how each block looks, so all formats show the same steps and the same numbers. Large
inputs are summarised here, once: the first and last rows and keys, with counts of the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InputError
from ..explanation.display import fmt
from ..explanation.trace import SECTIONS, Trace

__all__ = [
    "Cell",
    "Heading",
    "Heatmap",
    "Para",
    "Table",
    "build",
    "pick",
]

#: Default summary limits: rows (queries), keys and vector entries shown before eliding.
MAX_ROWS, MAX_KEYS, MAX_DIMS = 8, 10, 6


@dataclass
class Cell:
    """A table cell: ``text`` (Unicode), optional ``latex`` (math-mode body) and a style.

    ``attrs`` are HTML attributes (``data-*``, ``title``, ``id``; a ``class`` replaces the
    classes of ``kind`` and ``style``) for pages that script their tables; other formats
    ignore them. A ``"head"`` cell is a row's heading (``<th>`` in HTML).
    """

    text: str
    latex: str | None = None
    kind: str = "num"  # "num" (math), "text", "label", "gap", "head"
    style: str = ""  # "", "masked", "total", "strong"
    attrs: dict[str, str] = field(default_factory=dict)


@dataclass
class Heading:
    level: int
    text: str


@dataclass
class Para:
    text: str
    style: str = ""  # "", "note", "formula"
    latex: str | None = None  # a LaTeX version (text mode) when the text has math in it


@dataclass
class Table:
    header: list[Cell]
    rows: list[list[Cell]]
    caption: str = ""
    attrs: dict[str, str] = field(default_factory=dict)  # HTML attributes of the table


@dataclass
class Heatmap:
    """The weights matrix, summarised: ``rows``/``cols`` are indices with ``None`` for gaps."""

    weights: np.ndarray
    excluded: np.ndarray
    rows: list[int | None]
    cols: list[int | None]
    title: str = "Weights at a glance"
    row_label: str = "query"
    col_label: str = "key"
    counts: dict[str, int] = field(default_factory=dict)
    row_names: list[str] | None = None  # one per query row (default q0, q1, …)
    col_names: list[str] | None = None  # one per key (default k0, k1, …)
    cell: int | None = None  # pixels per cell in HTML (default: fit about 520 px)

    def row_name(self, i: int) -> str:
        return f"q{i}" if self.row_names is None else self.row_names[i]

    def col_name(self, j: int) -> str:
        return f"k{j}" if self.col_names is None else self.col_names[j]


def pick(n: int, limit: int, tail: int = 2) -> list[int | None]:
    """Indices to show out of ``n``: all if ``n <= limit``, else head, ``None``, tail.

    Examples
    --------
    >>> pick(3, 8)
    [0, 1, 2]
    >>> pick(100, 8)
    [0, 1, 2, 3, 4, 5, None, 98, 99]
    """
    if n <= limit:
        return list(range(n))
    head = max(1, limit - tail)
    return list(range(head)) + [None] + list(range(n - tail, n))


def gap_text(n_hidden: int, what: str) -> str:
    return f"… {n_hidden} more {what} …"


def _num(x: Any, style: str = "") -> Cell:
    """A table cell holding a number, written by the one formatter (:func:`fmt`)."""
    return Cell(fmt(x), style=style)


def _exact_cell(ex: Any, e: Any, style: str = "") -> Cell:
    """An exact value with its numeric value: ``exp(3)/(1 + exp(3)) ≈ 0.95257``."""
    text, tex = ex.text(e), ex.latex(e)
    if str(e) in ("-oo", "oo"):
        return Cell("-inf" if str(e) == "-oo" else "inf", r"-\infty", style=style)
    val = ex.value(e)
    if ex.is_number(e) and getattr(e, "is_Integer", False):
        return Cell(text, tex, style=style)
    sign = "=" if ex.is_number(e) and float(fmt(val)) == val else "≈"
    tex_sign = "=" if sign == "=" else r"\approx"
    return Cell(f"{text} {sign} {fmt(val)}", f"{tex} {tex_sign} {fmt(val)}", style=style)


def _vec_text(v: np.ndarray, limit: int = MAX_DIMS) -> str:
    idx = pick(len(v), limit)
    parts = ["…" if i is None else fmt(v[i]) for i in idx]
    return "[" + ", ".join(parts) + "]"


def _matrix_table(
    a: np.ndarray,
    row_name: str,
    col_name: str,
    max_rows: int,
    max_cols: int,
    caption: str = "",
    row_names: Any = None,
    col_names: Any = None,
    masked: np.ndarray | None = None,
) -> Table:
    """``a`` as a table of at most ``max_rows × max_cols`` shown entries; entries where
    ``masked`` is True (pairs a query may not see) are styled ``"masked"``."""
    rows_i, cols_j = pick(a.shape[0], max_rows), pick(a.shape[1], max_cols)
    header = [Cell("", kind="label")] + [
        Cell("…", kind="gap")
        if j is None
        else Cell(
            col_names[j] if col_names else f"{col_name}{j}" if col_name else f"[{j}]",
            kind="label",
        )
        for j in cols_j
    ]
    rows = []
    for i in rows_i:
        if i is None:
            hidden = a.shape[0] - (len(rows_i) - 1)
            rows.append(
                [Cell(gap_text(hidden, "rows"), kind="gap")] + [Cell("⋮", kind="gap")] * len(cols_j)
            )
            continue
        name = row_names[i] if row_names else f"{row_name}{i}" if row_name else ""
        row = [Cell(name, kind="label")]
        for j in cols_j:
            hidden = masked is not None and j is not None and bool(masked[i, j])
            row.append(
                Cell("…", kind="gap") if j is None else _num(a[i, j], "masked" if hidden else "")
            )
        rows.append(row)
    if a.shape[1] > max_cols:
        caption = (
            caption + " " if caption else ""
        ) + f"({a.shape[1]} columns, {a.shape[1] - len(cols_j) + 1} not shown)"
    return Table(header, rows, caption)


def _overview(t: Trace) -> list[Any]:
    L, S = t.L, t.S
    qs = "1 query" if t.squeeze else f"L = {L} queries"
    parts = [f"{qs} of size {t.d}", f"S = {S} key" + ("" if S == 1 else "s")]
    if t.v is not None:
        parts.append(f"values of size dv = {t.dv}")
    facts = ", ".join(parts) + "."
    tex = r"$\mathrm{Attention}(q, K, V) = \mathrm{softmax}(q K^\top \cdot \mathrm{scale})\, V$"
    blocks: list[Any] = [
        Para(
            "Attention(q, K, V) = softmax(q·Kᵀ · scale) · V, row by row. " + facts,
            latex=tex + ", row by row. " + facts.replace("dv", "$d_v$"),
        )
    ]
    rules = []
    if t.causal:
        rules.append(
            f"causal (bottom-right aligned: query row i sits at position S − L + i = {S - L} + i "
            "and sees keys j ≤ its position)"
        )
    if t.window is not None:
        left, right = t.window
        lo = None if left is None else (f"p − {left}" if left else "p")
        hi = None if right is None else (f"p + {right}" if right else "p")
        span = " ≤ ".join(x for x in (lo, "j", hi) if x is not None)
        rules.append(f"window ({left}, {right}): position p sees keys {span}")
    if t.mask is not None:
        rules.append("a boolean mask (True = may attend)")
    if t.bias is not None:
        rules.append("a float mask added to the scaled scores as a bias")
    if t.exclusions and "mask_mod" in t.exclusions:
        rules.append("a mask_mod function (True = may attend)")
    if t.stage == "scores":
        return blocks
    blocks.append(
        Para(
            "Which keys each query sees: "
            + ("; ".join(rules) if rules else "all of them (no mask)")
            + "."
        )
    )
    return blocks


def _inputs(t: Trace, max_rows: int, max_dims: int) -> list[Any]:
    out: list[Any] = [Heading(2, "Inputs")]
    out.append(
        _matrix_table(
            t.q,
            "" if t.squeeze else "q",
            "",
            max_rows,
            max_dims,
            caption="q (queries, one per row)" if not t.squeeze else "q (the query)",
            row_names=None if t.query_labels is None else list(t.query_labels),
        )
    )
    keys = None if t.key_labels is None else list(t.key_labels)
    out.append(
        _matrix_table(
            t.k, "k", "", max_rows, max_dims, caption="K (keys, one per row)", row_names=keys
        )
    )
    if t.v is not None:
        out.append(
            _matrix_table(
                t.v, "v", "", max_rows, max_dims, caption="V (values, one per row)", row_names=keys
            )
        )
    if t.causal or t.window is not None:
        out.append(Para("Query positions: " + _vec_text(t.positions, max_rows) + "."))
    return out


def _scale(t: Trace) -> list[Any]:
    out: list[Any] = [Heading(2, "Scale"), Para(t.scale.describe(), style="formula")]
    if t.exact is not None and not t.exact.is_number(t.exact.scale):
        out.append(Para(f"Exact: scale = {t.exact.text(t.exact.scale)}", style="formula"))
    if t.scale.note:
        out.append(Para("Note: " + t.scale.note + ".", style="note"))
    return out


def _row_label(t: Trace, i: int) -> str:
    if t.squeeze:
        return "The query"
    text = f"Query row {i}"
    if t.query_labels is not None:
        text += f" ({t.query_labels[i]})"
    if t.causal or t.window is not None:
        text += f" (position {int(t.positions[i])})"
    return text


def _labels(*names: str) -> list[Cell]:
    """A table's column headings, one label cell each."""
    return [Cell(name, kind="label") for name in names]


def _row_steps(t: Trace, i: int, keys: list[int | None]) -> list[Any]:
    ex = t.exact
    has_w = t.reaches("weights")
    # the steps section is built from the scores stage on
    assert t.raw is not None and t.scaled is not None
    steps = {"softcap": "c·tanh(s/c)", "alibi": "+ ALiBi", "score_mod": "score_mod"}
    header = _labels("key", "q·k (terms)", "raw", f"× {t.scale.substituted}")
    header += _labels(*(steps[name] for name in t.steps))
    if t.bias is not None and has_w:
        header += _labels("+ bias")
    if has_w:
        header += _labels("excluded?", "s − max", "exp", "weight")
    rows = []
    for j in keys:
        if j is None:
            hidden = t.S - (len(keys) - 1)
            rows.append(
                [Cell(gap_text(hidden, "keys"), kind="gap")]
                + [Cell("⋮", kind="gap")] * (len(header) - 1)
            )
            continue
        masked = has_w and t.excluded is not None and bool(t.excluded[i, j])
        st = "masked" if masked else ""
        row = [
            Cell(t.key_label(j), kind="label", style=st),
            Cell(t.dot_terms(i, j), kind="text", style=st),
            _num(t.raw[i, j], st),
        ]
        row.append(
            _exact_cell(ex, ex.scaled[i][j], st) if ex is not None else _num(t.scaled[i, j], st)
        )
        row += [_num(a[i, j], st) for a in t.steps.values()]
        if t.bias is not None and has_w:
            row.append(_num(t.bias[i, j], st))
        if has_w:
            row.append(
                Cell(("yes — " + t.reason_text(i, j)) if masked else "no", kind="text", style=st)
            )
            # has_w: the softmax steps are set from the weights stage on
            assert t.shifted is not None and t.exps is not None and t.weights is not None
            if ex is not None:
                row += [
                    _exact_cell(ex, ex.shifted[i][j], st),
                    _exact_cell(ex, ex.exps[i][j], st),
                    _exact_cell(ex, ex.weights[i][j], "masked" if masked else "strong"),
                ]
            else:
                row += [
                    _num(t.shifted[i, j], st),
                    _num(t.exps[i, j], st),
                    _num(t.weights[i, j], "masked" if masked else "strong"),
                ]
        rows.append(row)
    out: list[Any] = [Table(header, rows)]
    if has_w:
        # the softmax steps are set from the weights stage on
        assert t.excluded is not None and t.row_max is not None
        assert t.sums is not None and t.lse is not None
        seen = int((~t.excluded[i]).sum())
        if t.sink is not None:
            assert t.sink_share is not None  # set together with the sink
            out.append(
                Para(
                    f"sink = {fmt(t.sink)}: exp(sink − max) joins Σ with no value; its share "
                    f"of the denominator is {fmt(t.sink_share[i])}",
                    style="formula",
                )
            )
        if seen == 0:
            out.append(
                Para("This row may attend no key: its weights and output are 0.", style="note")
            )
        else:
            out.append(
                Para(
                    f"row max = {fmt(t.row_max[i])}; sum of exps Σ = {fmt(t.sums[i])}; "
                    f"log-sum-exp = {fmt(t.lse[i])}; weight = exp / Σ",
                    style="formula",
                )
            )
            if ex is not None:
                out.append(
                    Para(
                        f"Exact: max = {ex.text(ex.row_max[i])}; Σ = {ex.text(ex.sums[i])}",
                        style="formula",
                    )
                )
    if t.reaches("output"):
        out += _weighted(t, i, keys)
    return out


def _weighted(t: Trace, i: int, keys: list[int | None]) -> list[Any]:
    ex = t.exact
    # called only when the trace reaches the output
    assert t.excluded is not None and t.weights is not None
    assert t.v is not None and t.output is not None
    header = _labels("key", "weight", "v", "weight · v")
    rows = []
    for j in keys:
        if j is None:
            rows.append(
                [Cell(gap_text(t.S - (len(keys) - 1), "keys"), kind="gap")]
                + [Cell("⋮", kind="gap")] * 3
            )
            continue
        st = "masked" if t.excluded[i, j] else ""
        rows.append(
            [
                Cell(t.key_label(j), kind="label", style=st),
                _num(t.weights[i, j], st),
                Cell(_vec_text(t.v[j]), style=st),
                Cell(_vec_text(t.weights[i, j] * t.v[j]), style=st),  # only what is shown
            ]
        )
    rows.append(
        [
            Cell("output", kind="label", style="total"),
            Cell("Σ", kind="label", style="total"),
            Cell("", kind="label", style="total"),
            Cell(_vec_text(t.output[i]), style="total"),
        ]
    )
    out: list[Any] = [Table(header, rows)]
    line = f"output = Σ weight · v = {_vec_text(t.output[i])}"
    out.append(Para(line, style="formula"))
    if ex is not None:
        cols = pick(t.dv, MAX_DIMS)
        cells = ["…" if c is None else _exact_cell(ex, ex.output[i][c]).text for c in cols]
        out.append(Para("Exact output: [" + ", ".join(cells) + "]", style="formula"))
    return out


def build(
    t: Trace,
    *,
    max_rows: int = MAX_ROWS,
    max_keys: int = MAX_KEYS,
    max_dims: int = MAX_DIMS,
    heatmap: bool = True,
    title: str | None = None,
    rows: list[int] | None = None,
    skip: Collection[str] = (),
) -> list[Any]:
    """The blocks that every document renderer draws, in order.

    ``rows`` picks the query rows explained step by step (default: the first and last few).
    ``skip`` leaves out sections by key (:data:`~qkv.explanation.trace.SECTIONS`).
    """
    unknown = sorted(set(skip) - set(SECTIONS))
    if unknown:
        raise InputError(f"skip: unknown sections {unknown}; known: {', '.join(SECTIONS)}")

    def steps() -> list[Any]:
        shown: list[int | None] = pick(t.L, max_rows) if rows is None else [int(i) for i in rows]
        return _steps(t, shown, pick(t.S, max_keys))

    sections: dict[str, Callable[[], list[Any]]] = {
        "title": lambda: [
            Heading(1, title or t.title or "Scaled dot-product attention, step by step")
        ],
        "overview": lambda: _overview(t),
        "inputs": lambda: _inputs(t, max_rows, max_dims),
        "scale": lambda: _scale(t),
        "heatmap": lambda: _heatmap(t) if heatmap and t.reaches("weights") else [],
        "steps": steps,
        "results": lambda: _results(t, max_rows, max_keys, max_dims),
    }
    shown = SECTIONS if t.reaches("scores") else SECTIONS[: SECTIONS.index("scale") + 1]
    return [b for key in shown if key not in skip for b in sections[key]()]


def _heatmap(t: Trace) -> list[Any]:
    # drawn only when the trace reaches the weights
    assert t.weights is not None and t.excluded is not None
    return [
        Heatmap(
            t.weights,
            t.excluded,
            pick(t.L, 48),
            pick(t.S, 48),
            counts={"L": t.L, "S": t.S},
            row_names=None if t.query_labels is None else list(t.query_labels),
            col_names=None if t.key_labels is None else list(t.key_labels),
        )
    ]


def _steps(t: Trace, rows: list[int | None], keys: list[int | None]) -> list[Any]:
    blocks: list[Any] = [Heading(2, "Step by step, one query row at a time")]
    for i in rows:
        if i is None:
            blocks.append(
                Para(gap_text(t.L - (len(rows) - 1), "query rows (same steps)"), style="note")
            )
            continue
        blocks.append(Heading(3, _row_label(t, i)))
        name = "q" if t.squeeze else f"q{i}"
        if t.query_labels is not None:
            name += f" ({t.query_labels[i]})"
        blocks.append(Para(name + " = " + _vec_text(t.q[i])))
        blocks += _row_steps(t, i, keys)
    return blocks


def _results(t: Trace, max_rows: int, max_keys: int, max_dims: int) -> list[Any]:
    assert t.scaled is not None  # the results section is built from the scores stage on
    rows = None if t.query_labels is None else list(t.query_labels)
    keys = None if t.key_labels is None else list(t.key_labels)

    def per_key(a: np.ndarray, caption: str, **kw: Any) -> Any:
        return _matrix_table(
            a, "q", "k", max_rows, max_keys, caption=caption, row_names=rows, col_names=keys, **kw
        )

    some_excluded = t.excluded is not None and bool(t.excluded.any())
    greyed = " (greyed: pairs the query may not see, weight 0)" if some_excluded else ""
    blocks: list[Any] = [
        Heading(2, "Results"),
        per_key(t.scaled, "scaled scores q·kᵀ · scale" + greyed, masked=t.excluded),
    ]
    if t.reaches("weights"):
        assert t.weights is not None
        blocks.append(per_key(t.weights, "attention weights (each row sums to 1)"))
    if t.reaches("output"):
        assert t.output is not None
        caption = "output = weights · V"
        blocks.append(
            _matrix_table(t.output, "q", "", max_rows, max_dims, caption=caption, row_names=rows)
        )
    return blocks
