"""LaTeX: a standalone document (``amsmath`` only), its body, or a math display for Jupyter.

The document compiles with ``pdflatex``; every character outside ASCII is turned into a LaTeX
command, and all text (including a user's title) is escaped.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from ..explanation.display import fmt
from ..explanation.trace import Trace
from .blocks import Cell, Heading, Heatmap, Para, Table, build, pick

__all__ = ["escape", "math", "math_display", "render", "render_blocks"]

_TEXT_SPECIAL = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "<": r"\textless{}",
    ">": r"\textgreater{}",
}
_MATH_CHARS = {
    "·": r"\cdot",
    "≈": r"\approx",
    "Σ": r"\Sigma",
    "×": r"\times",
    "−": "-",
    "≤": r"\leq",
    "≥": r"\geq",
    "∞": r"\infty",
    "⋮": r"\vdots",
    "ᵀ": r"^{\top}",
}
_TEXT_CHARS = {"…": r"\dots{}", "—": "---", "–": "--", "→": r"$\to$"}
_TOKEN = re.compile(r"√(\([^)]*\)|[\w.]+)|.", re.S)


def escape(text: str) -> str:
    """Text-mode LaTeX for a Unicode string; math symbols become inline math.

    Examples
    --------
    >>> escape("1/√4 = 1/2 ≈ 0.5 & 50% #1")
    '1/$\\\\sqrt{4}$ = 1/2 $\\\\approx$ 0.5 \\\\& 50\\\\% \\\\#1'
    """
    out = []
    for m in _TOKEN.finditer(text):
        tok = m.group(0)
        if m.group(1) is not None:
            inner = m.group(1)
            if inner.startswith("("):
                inner = inner[1:-1]
            out.append(r"$\sqrt{" + escape(inner).replace("$", "") + "}$")
        elif tok in _TEXT_SPECIAL:
            out.append(_TEXT_SPECIAL[tok])
        elif tok in _MATH_CHARS:
            out.append(f"${_MATH_CHARS[tok]}$")
        elif tok in _TEXT_CHARS:
            out.append(_TEXT_CHARS[tok])
        elif ord(tok) > 126:
            out.append("?")
        else:
            out.append(tok)
    return "".join(out).replace("$$", "")


def math(text: str) -> str:
    """Math-mode LaTeX for a formatted number or vector: ``-inf`` becomes ``-\\infty``."""
    text = re.sub(r"(?<![\w.])inf\b", r"\\infty", text)
    text = text.replace("nan", r"\mathrm{NaN}").replace("…", r"\dots")
    return "".join(_MATH_CHARS.get(ch, ch) + (" " if ch in _MATH_CHARS else "") for ch in text)


def _cell(c: Cell) -> str:
    if c.kind == "gap":
        return r"$\vdots$" if c.text == "⋮" else escape(c.text)
    if c.latex is not None:
        body = f"${c.latex}$"
    elif c.kind == "num" and c.text:
        body = f"${math(c.text)}$"
    else:
        body = escape(c.text)
    if c.kind == "label" and c.text:
        body = r"\textbf{" + body + "}"
        if c.style == "masked":
            body += r" $\times$"
    return body


def _table(t: Table) -> list[str]:
    ncol = len(t.header)
    out = [r"\begin{center}\footnotesize"]
    if t.caption:
        out.append(r"\textit{" + escape(t.caption) + r"}\\[2pt]")
    out.append(r"\begin{tabular}{l" + "r" * (ncol - 1) + "}")
    out.append(r"\hline")
    out.append(" & ".join(_cell(c) for c in t.header) + r" \\")
    out.append(r"\hline")
    for r in t.rows:
        if r and r[0].kind == "gap" and r[0].text != "…":
            out.append(r"\multicolumn{" + str(ncol) + "}{l}{" + escape(r[0].text) + r"} \\")
            continue
        cells = [_cell(c) for c in r] + [""] * (ncol - len(r))
        if r and r[0].style == "total":
            out.append(r"\hline")
        out.append(" & ".join(cells) + r" \\")
    out.append(r"\hline")
    out.append(r"\end{tabular}")
    out.append(r"\end{center}")
    return out


def _body(blocks: list[Any]) -> list[str]:
    out: list[str] = []
    for b in blocks:
        if isinstance(b, Heading):
            cmd = {1: "section", 2: "subsection"}.get(b.level, "subsubsection")
            out.append(f"\\{cmd}*{{{escape(b.text)}}}")
        elif isinstance(b, Para):
            text = b.latex if b.latex is not None else escape(b.text)
            if b.style == "note":
                text = r"\textit{" + text + "}"
            out += [text, ""]
        elif isinstance(b, Table):
            out += _table(b)
        elif isinstance(b, Heatmap):
            continue
    return out


def _bmatrix(a: np.ndarray, max_rows: int = 8, max_cols: int = 10) -> str:
    rows, cols = pick(a.shape[0], max_rows), pick(a.shape[1], max_cols)
    lines = []
    for i in rows:
        if i is None:
            lines.append(" & ".join(r"\vdots" for _ in cols))
            continue
        cells = []
        for j in cols:
            if j is None:
                cells.append(r"\cdots")
            else:
                cells.append(math(fmt(a[i, j])))
        lines.append(" & ".join(cells))
    return r"\begin{bmatrix}" + r" \\ ".join(lines) + r"\end{bmatrix}"


def math_display(t: Trace) -> str:
    """A ``$$…$$`` display of the main steps (what Jupyter shows for ``_repr_latex_``)."""
    s = t.scale
    scale_tex = s.expr.latex(s.d) if s.expr.uses_d else s.expr.latex()
    lines = [r"\text{scale} &= " + scale_tex + " = " + math(fmt(s.value))]
    if t.reaches("scores"):
        assert t.raw is not None and t.scaled is not None
        lines.append(r"q K^\top &= " + _bmatrix(t.raw))
        lines.append(r"S = q K^\top \cdot \text{scale} &= " + _bmatrix(t.scaled))
    if t.reaches("weights"):
        assert t.weights is not None
        lines.append(r"W = \mathrm{softmax}(S) &= " + _bmatrix(t.weights))
        if t.exact is not None:
            ex = t.exact
            rows, cols = pick(t.L, 8), pick(t.S, 10)
            body = []
            for i in rows:
                if i is None:
                    body.append(" & ".join(r"\vdots" for _ in cols))
                    continue
                body.append(
                    " & ".join(r"\cdots" if j is None else ex.latex(ex.weights[i][j]) for j in cols)
                )
            lines.append(r"&= \begin{bmatrix}" + r" \\ ".join(body) + r"\end{bmatrix}")
    if t.reaches("output"):
        assert t.output is not None
        lines.append(r"O = W V &= " + _bmatrix(t.output))
    return "$$\\begin{aligned}\n" + " \\\\\n".join(lines) + "\n\\end{aligned}$$"


PREAMBLE = r"""\documentclass{article}
\usepackage[T1]{fontenc}
\usepackage{amsmath}
\setlength{\parindent}{0pt}
\setlength{\parskip}{4pt}
\begin{document}"""


def render(
    trace: Trace, *, standalone: bool = True, math_only: bool = False, **options: Any
) -> str:
    """The trace as LaTeX.

    Parameters
    ----------
    standalone : bool
        A complete document (``\\documentclass`` … ``\\end{document}``) that compiles on its
        own; otherwise only the body, for ``\\input`` (needs ``amsmath``).
    math_only : bool
        Only a ``$$…$$`` display of the main matrices (for Jupyter's ``_repr_latex_``).

    Examples
    --------
    >>> import qkv
    >>> tex = qkv.explain([2, 1], [[1, 0], [3, 2]], d=4).to_latex()
    >>> tex.startswith("\\\\documentclass") and tex.rstrip().endswith("\\\\end{document}")
    True
    """
    if math_only:
        return math_display(trace)
    return render_blocks(build(trace, heatmap=False, **options), standalone=standalone)


def render_blocks(blocks: list[Any], *, standalone: bool = True) -> str:
    """Blocks as a LaTeX document (or only its body)."""
    body = "\n".join(_body(blocks))
    if not standalone:
        return body + "\n"
    return PREAMBLE + "\n" + body + "\n\\end{document}\n"
