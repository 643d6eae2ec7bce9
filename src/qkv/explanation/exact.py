"""Exact arithmetic for a trace, with SymPy (the ``exact`` extra; imported only here).

Integers and rationals stay exact, square roots stay symbolic, and each weight appears in
closed form: for the worked example ``exp(3)/(1 + exp(3))`` rather than ``0.95257``. Float
inputs are read as the decimals they print as (``0.1`` becomes ``1/10``), so the exact trace is
of the numbers the user wrote.

The steps follow the numeric trace one for one (the same maximum is subtracted); the closed
forms of the weights and outputs divide through by the row's *smallest* exponential instead, so
that every exponent is >= 0: ``w_j = exp(s_j - r) / Σ_k exp(s_k - r)`` with ``r = min_k s_k``.

Examples
--------
>>> import qkv
>>> t = qkv.explain([2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4]], d=4, exact=True)
>>> [str(w) for w in t.exact.weights[0]]
['1/(1 + exp(3))', 'exp(3)/(1 + exp(3))']
>>> str(t.exact.output[0][0]), round(t.exact.value(t.exact.output[0][0]), 6)
('(1 + 3*exp(3))/(1 + exp(3))', 2.905148)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InputError
from ..extras import require
from ..validate import as_array

__all__ = ["ExactSteps", "exact_steps", "to_rational"]

#: Refuse exact traces with more cells than this (SymPy is slow on big problems).
MAX_CELLS = 5_000


def _sympy() -> Any:
    return require("sympy", "exact values (exact=True, --exact)")


def to_rational(x: Any) -> Any:
    """A number as the decimal it prints as, exactly: ``0.1 -> 1/10``.

    Examples
    --------
    >>> str(to_rational(0.1)), str(to_rational(np.float32(0.1))), str(to_rational(3))
    ('1/10', '1/10', '3')
    """
    sympy = _sympy()
    if isinstance(x, (int, np.integer)):
        return sympy.Integer(int(x))
    f = np.asarray(x)[()]
    if not np.isfinite(f):
        raise InputError(f"exact: cannot be exact with a non-finite input ({f})")
    if isinstance(f, np.floating):
        text = np.format_float_positional(f, unique=True, trim="-")
    else:
        text = str(f)
    return sympy.Rational(text)


def _matrix(x: Any, name: str, rows: int, cols: int) -> list[list[Any]]:
    a = as_array(x, name).reshape(rows, cols)  # explicit: -1 cannot be inferred when rows = 0
    return [[to_rational(e) for e in row] for row in a]


@dataclass(frozen=True)
class ExactSteps:
    """Exact SymPy values of a trace's steps (lists of rows; ``-oo`` marks excluded keys).

    Attributes mirror :class:`qkv.Trace`: ``q, k, v, scale, raw, scaled, logits, row_max,
    shifted, exps, sums, weights, output``. Fields past the trace's stage are ``None``.
    """

    q: list
    k: list
    v: list | None
    scale: Any
    raw: list | None = None
    scaled: list | None = None
    logits: list | None = None
    row_max: list | None = None
    shifted: list | None = None
    exps: list | None = None
    sums: list | None = None
    weights: list | None = None
    output: list | None = None

    @staticmethod
    def text(e: Any) -> str:
        """SymPy's plain string: ``exp(3)/(1 + exp(3))``."""
        return str(e)

    @staticmethod
    def latex(e: Any) -> str:
        """SymPy's LaTeX: ``\\frac{e^{3}}{1 + e^{3}}``."""
        return _sympy().latex(e)

    @staticmethod
    def value(e: Any) -> float:
        """The numeric value of an exact expression."""
        return float(_sympy().N(e, 30))

    @staticmethod
    def is_number(e: Any) -> bool:
        """Whether ``e`` is a plain rational (nothing symbolic to show besides its value)."""
        return bool(getattr(e, "is_Rational", False))


def exact_steps(trace: Any, q: Any, k: Any, v: Any = None) -> ExactSteps:
    """Recompute ``trace``'s steps in exact arithmetic from the original inputs."""
    sympy = _sympy()
    L, S, d, dv = trace.L, trace.S, trace.d, trace.dv
    if L * S * (d + dv + 1) > MAX_CELLS:
        raise InputError(
            f"exact: too large for exact arithmetic (L={L}, S={S}, d={d}, dv={dv}; at most "
            f"{MAX_CELLS} cells): drop exact or use fewer rows"
        )
    Q, K = _matrix(q, "q", L, d), _matrix(k, "k", S, d)
    V = None if v is None else _matrix(v, "v", S, dv)
    info = trace.scale
    scale = info.expr.sympy(info.d if info.d is not None else 1)
    steps: dict[str, Any] = dict(q=Q, k=K, v=V, scale=scale)
    if not trace.reaches("scores"):
        return ExactSteps(**steps)

    raw = [
        [sum((a * b for a, b in zip(Q[i], K[j], strict=True)), sympy.Integer(0)) for j in range(S)]
        for i in range(L)
    ]
    scaled = [[r * scale for r in row] for row in raw]
    steps.update(raw=raw, scaled=scaled)
    if not trace.reaches("weights"):
        return ExactSteps(**steps)

    ninf = -sympy.oo
    logits, row_max, shifted, exps, sums, weights, output = [], [], [], [], [], [], []
    for i in range(L):
        row = []
        for j in range(S):
            if trace.excluded[i, j]:
                row.append(ninf)
                continue
            x = scaled[i][j]
            if trace.bias is not None:
                x = x + to_rational(trace.bias[i, j])
            row.append(x)
        logits.append(row)
        live = [x for x in row if x != ninf]
        if not live:
            m = sympy.Integer(0)
            shifted.append([ninf] * S)
            exps.append([sympy.Integer(0)] * S)
            sums.append(sympy.Integer(0))
            row_max.append(m)
            weights.append([sympy.Integer(0)] * S)
            if V is not None:
                output.append([sympy.Integer(0)] * dv)
            continue
        m = max(live, key=lambda e: sympy.N(e, 40))
        r = min(live, key=lambda e: sympy.N(e, 40))
        row_max.append(m)
        shifted.append([ninf if x == ninf else x - m for x in row])
        exps.append([sympy.Integer(0) if x == ninf else sympy.exp(x - m) for x in row])
        sums.append(sympy.Add(*[e for e in exps[-1]]))
        num = [sympy.Integer(0) if x == ninf else sympy.exp(x - r) for x in row]
        den = sympy.Add(*num)
        weights.append([n / den for n in num])
        if V is not None:
            output.append(
                [sympy.Add(*[num[j] * V[j][c] for j in range(S)]) / den for c in range(dv)]
            )
    steps.update(
        logits=logits,
        row_max=row_max,
        shifted=shifted,
        exps=exps,
        sums=sums,
        weights=weights,
        output=output if (V is not None and trace.reaches("output")) else None,
    )
    return ExactSteps(**steps)
