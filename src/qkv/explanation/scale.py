"""Scale expressions in ``d``: ``"1/sqrt(d)"``, ``"sqrt(d)"``, ``"1"``, ``"d**-0.5"``.

Python's own :mod:`ast` parses the text; only numbers, the name ``d``, ``sqrt(...)``,
parentheses, ``+ - * /`` and ``**`` (or ``^``) are kept, anything else is refused, and nothing
is ever passed to ``eval`` or to SymPy's string parser. A parsed :class:`ScaleExpr` can be
evaluated as a float, as an exact fraction where the value is rational, or (lazily) as a SymPy
expression, and printed as Unicode or LaTeX.

Examples
--------
>>> e = parse_scale("1/sqrt(d)")
>>> e.formula(), e.formula(4), e.value(4), str(e.exact(4))
('1/√d', '1/√4', 0.5, '1/2')
>>> parse_scale("sqrt(d)").value(4)
2.0
>>> parse_scale("2").uses_d
False
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from ..errors import InputError

__all__ = ["ScaleExpr", "parse_scale"]

_MAX_LEN = 100
#: Exact values (fractions) larger than this many bits, numerator and denominator together, are
#: not computed: nested powers such as ``(1.001**64)**64`` would otherwise grow without bound.
MAX_EXACT_BITS = 256
_NUMBER = re.compile(r"(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d{1,3})?")
_BINARY = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.Pow: "**"}

# A node is a tuple: ("num", text) | ("d",) | ("sqrt", x) | ("neg", x) | (op, a, b).
Node = tuple


def _tree(node: ast.AST, text: str) -> Node:
    """Python's own parser did the grammar; keep only the node types a scale may use."""
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return (_BINARY[type(node.op)], _tree(node.left, text), _tree(node.right, text))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _tree(node.operand, text)
        return ("neg", inner) if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.Name) and node.id == "d":
        return ("d",)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "sqrt"
        and len(node.args) == 1
        and not node.keywords
    ):
        return ("sqrt", _tree(node.args[0], text))
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        literal = ast.get_source_segment(text, node) or ""
        if _NUMBER.fullmatch(literal):  # plain decimals: no 0x, 1_000, or 1e9999
            return ("num", literal)
    part = ast.get_source_segment(text, node) or type(node).__name__
    raise InputError(
        f"scale: {part!r} is not allowed in {text!r} (numbers, d, sqrt( ), + - * / ** only)"
    )


def _parse(text: str) -> Node:
    source = text.replace("^", "**")  # the usual written power; Python's ^ is xor
    try:
        body = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise InputError(f"scale: {text!r} is not a valid expression in d") from None
    return _tree(body, source)


def _bits(x: Fraction) -> int:
    return x.numerator.bit_length() + x.denominator.bit_length()


def _bounded(x: Fraction | None) -> Fraction | None:
    """``x``, or ``None`` when it is too large to be worth writing exactly."""
    return x if x is None or _bits(x) <= MAX_EXACT_BITS else None


def _isqrt_exact(x: Fraction) -> Fraction | None:
    if x < 0:
        return None
    n, m = math.isqrt(x.numerator), math.isqrt(x.denominator)
    if n * n == x.numerator and m * m == x.denominator:
        return Fraction(n, m)
    return None


_PREC = {"+": 1, "-": 1, "*": 2, "/": 2, "neg": 3, "**": 4}


def _prec(node: Node) -> int:
    return _PREC.get(node[0], 5)


@dataclass(frozen=True)
class ScaleExpr:
    """A parsed scale expression; see :func:`parse_scale`."""

    text: str
    tree: Node

    @property
    def uses_d(self) -> bool:
        """Whether the expression mentions ``d``."""

        def walk(n: Node) -> bool:
            return n[0] == "d" or any(walk(c) for c in n[1:] if isinstance(c, tuple))

        return walk(self.tree)

    def value(self, d: float = 1.0) -> float:
        """The scale as a float for this ``d``; raises :class:`InputError` unless finite > 0."""
        try:
            v = self._float(self.tree, float(d))
        except (ZeroDivisionError, OverflowError, ValueError, TypeError):
            v = math.nan
        if isinstance(v, complex) or not math.isfinite(v) or v <= 0:
            where = f" with d = {_num_text(d)}" if self.uses_d else ""
            raise InputError(f"scale: {self.text!r}{where} is not a finite number > 0")
        return float(v)

    def _float(self, n: Node, d: float) -> float:
        kind = n[0]
        if kind == "num":
            return float(n[1])
        if kind == "d":
            return d
        if kind == "sqrt":
            return math.sqrt(self._float(n[1], d))
        if kind == "neg":
            return -self._float(n[1], d)
        a, b = self._float(n[1], d), self._float(n[2], d)
        return (
            {"+": a + b, "-": a - b, "*": a * b}.get(kind)
            if kind in "+-*"
            else (a / b if kind == "/" else a**b)
        )

    def exact(self, d: int | Fraction = 1) -> Fraction | None:
        """The exact value as a :class:`~fractions.Fraction`, or ``None``.

        ``None`` when the value is irrational, or when it (or a step on the way) takes more
        than :data:`MAX_EXACT_BITS` bits to write exactly.

        Examples
        --------
        >>> parse_scale("(1.001**64)**64").exact() is None
        True
        """
        try:
            return self._exact(self.tree, Fraction(d))
        except (ZeroDivisionError, OverflowError, ValueError):
            return None

    def _exact(self, n: Node, d: Fraction) -> Fraction | None:
        kind = n[0]
        if kind == "num":
            return _bounded(Fraction(n[1]))
        if kind == "d":
            return _bounded(d)
        if kind in ("sqrt", "neg"):
            x = self._exact(n[1], d)
            if x is None:
                return None
            return _isqrt_exact(x) if kind == "sqrt" else -x
        a, b = self._exact(n[1], d), self._exact(n[2], d)
        if a is None or b is None:
            return None
        if kind == "+":
            return _bounded(a + b)
        if kind == "-":
            return _bounded(a - b)
        if kind == "*":
            return _bounded(a * b)
        if kind == "/":
            return _bounded(a / b)
        # a ** b: integer powers exactly; halves through an exact square root
        if abs(b.numerator) > 64 or b.denominator not in (1, 2):
            return None
        if _bits(a) * abs(b.numerator) > 2 * MAX_EXACT_BITS + 128:
            return None  # the power alone would be too large: never compute it
        if a == 0 and b < 0:
            raise ZeroDivisionError
        p = a**b.numerator if b.numerator >= 0 else 1 / a ** (-b.numerator)
        return _bounded(p if b.denominator == 1 else _isqrt_exact(p))

    def sympy(self, d: Any) -> Any:
        """The expression in SymPy for this ``d`` (SymPy is imported here, lazily).

        Powers stay exact for small integer or half-integer exponents of numbers of at most
        :data:`MAX_EXACT_BITS` bits; any other power is taken as its float value, so no
        expression can make SymPy compute a huge number.
        """
        import sympy

        def go(n: Node) -> Any:
            kind = n[0]
            if kind == "num":
                return sympy.Rational(n[1])
            if kind == "d":
                return sympy.Rational(str(d))
            if kind == "sqrt":
                return sympy.sqrt(go(n[1]))
            if kind == "neg":
                return -go(n[1])
            a, b = go(n[1]), go(n[2])
            if kind == "**":
                small = b.is_Rational and abs(b.p) <= 64 and b.q <= 2
                if small and a.is_Rational:
                    small = (int(a.p).bit_length() + int(a.q).bit_length()) <= MAX_EXACT_BITS
                if not small:
                    return sympy.Float(self._float(n, float(d)), 30)
                return a**b
            return {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[kind]

        return go(self.tree)

    def formula(self, d: Any = None) -> str:
        """Unicode formula, with ``d`` substituted when given: ``1/√d`` or ``1/√4``."""
        return self._show(self.tree, None if d is None else _num_text(d), latex=False)

    def latex(self, d: Any = None) -> str:
        """LaTeX formula (math mode body), with ``d`` substituted when given."""
        return self._show(self.tree, None if d is None else _num_text(d), latex=True)

    def _show(self, n: Node, d: str | None, latex: bool) -> str:
        kind = n[0]
        if kind == "num":
            return n[1]
        if kind == "d":
            return d if d is not None else "d"
        if kind == "sqrt":
            inner = self._show(n[1], d, latex)
            if latex:
                return rf"\sqrt{{{inner}}}"
            return "√" + (inner if _prec(n[1]) >= 5 else f"({inner})")
        if kind == "neg":
            inner = self._show(n[1], d, latex)
            return "-" + (inner if _prec(n[1]) >= 3 else f"({inner})")
        a, b = self._show(n[1], d, latex), self._show(n[2], d, latex)
        if latex and kind == "/":
            return rf"\frac{{{a}}}{{{b}}}"
        if latex and kind == "**":
            a = a if _prec(n[1]) >= 5 else rf"\left({a}\right)"
            return f"{{{a}}}^{{{b}}}"
        p = _PREC[kind]
        if _prec(n[1]) < p or (kind == "**" and _prec(n[1]) <= p):
            a = rf"\left({a}\right)" if latex else f"({a})"
        if _prec(n[2]) < p or (_prec(n[2]) == p and kind in "-/"):
            b = rf"\left({b}\right)" if latex else f"({b})"
        if kind == "**":
            return f"{a}^{b}"
        op = {"*": r" \cdot " if latex else "·"}.get(kind, kind)
        return f"{a}{op}{b}"


def _num_text(x: Any) -> str:
    f = float(x)
    return str(int(f)) if f.is_integer() else repr(f)


def parse_scale(text: str | ScaleExpr) -> ScaleExpr:
    """Parse a scale expression in ``d``.

    Parameters
    ----------
    text : str
        A number, or an expression of ``d`` using numbers (decimal exponents up to 3 digits),
        ``sqrt(...)``, parentheses, ``+ - * /`` and ``**`` (or ``^``); at most 100 characters.

    Returns
    -------
    ScaleExpr

    Raises
    ------
    InputError
        For anything else, naming the offending part.

    Examples
    --------
    >>> parse_scale("d**-0.5").value(16)
    0.25
    >>> parse_scale("sqrt(d)").formula()
    '√d'
    >>> parse_scale("1/(d+1)").latex(3)
    '\\\\frac{1}{3+1}'
    """
    if isinstance(text, ScaleExpr):
        return text
    if not isinstance(text, str):
        raise InputError(f"scale: expected a number or an expression in d, got {text!r}")
    if len(text) > _MAX_LEN:
        raise InputError(f"scale: expression longer than {_MAX_LEN} characters")
    if not text.strip():
        raise InputError("scale: empty expression")
    return ScaleExpr(text=text.strip(), tree=_parse(text.strip()))
