"""The scale rule: a number, or an expression in ``d`` (``"1/sqrt(d)"``, ``"sqrt(d)"``).

:func:`resolve_scale` is the one place that decides the scale of :func:`qkv.explain` and the
``qkv`` command: ``d`` defaults to ``len(q)``, an expression is evaluated at it, and a ``d``
given with a scale that does not use it is refused (:func:`check_d_and_scale`). Plain numbers
are checked by :func:`qkv.validate.check_scale`, as for :func:`qkv.attention`.

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
import numbers
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, cast

from ..errors import InputError, InputTypeError
from ..extras import require
from ..validate import check_scale
from .display import fmt

__all__ = [
    "MAX_D",
    "ScaleExpr",
    "ScaleInfo",
    "check_d",
    "check_d_and_scale",
    "parse_scale",
    "read_number",
    "resolve_scale",
]

_MAX_LEN = 100
#: Exact values (fractions) larger than this many bits, numerator and denominator together, are
#: not computed: nested powers such as ``(1.001**64)**64`` would otherwise grow without bound.
MAX_EXACT_BITS = 256
_NUMBER = re.compile(r"(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d{1,3})?")
_BINARY = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.Pow: "**"}

# A node is a tuple: ("num", text) | (name,) | (function, x) | ("neg", x) | (op, a, b), where
# name is "d" in a scale ("e" in a number) and function is "sqrt" (also "exp", "log" in a number).
Node = tuple


@dataclass(frozen=True)
class _Grammar:
    """What an expression may use: the scale's grammar, or a number's (:func:`read_number`)."""

    label: str
    functions: tuple[str, ...]
    names: tuple[str, ...]
    allowed: str
    invalid: str


_SCALE = _Grammar(
    "scale",
    ("sqrt",),
    ("d",),
    "numbers, d, sqrt( ), + - * / ** only",
    "is not a valid expression in d",
)
_ANSWER = _Grammar(
    "",
    ("sqrt", "exp", "log"),
    ("e",),
    "numbers, e, sqrt( ), exp( ), log( ), + - * / ** only",
    "is not a number or an expression such as 9/2 or exp(-1.5)",
)


def _tree(node: ast.AST, text: str, g: _Grammar = _SCALE) -> Node:
    """Python's own parser did the grammar; keep only the node types ``g`` allows."""
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return (_BINARY[type(node.op)], _tree(node.left, text, g), _tree(node.right, text, g))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _tree(node.operand, text, g)
        return ("neg", inner) if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.Name) and node.id in g.names:
        return (node.id,)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in g.functions
        and len(node.args) == 1
        and not node.keywords
    ):
        return (node.func.id, _tree(node.args[0], text, g))
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        literal = ast.get_source_segment(text, node) or ""
        if _NUMBER.fullmatch(literal):  # plain decimals: no 0x, 1_000, or 1e9999
            return ("num", literal)
    part = ast.get_source_segment(text, node) or type(node).__name__
    label = f"{g.label}: " if g.label else ""
    where = f" in {text!r}" if part != text else ""
    raise InputError(f"{label}{part!r} is not allowed{where} ({g.allowed})")


def _parse(text: str, g: _Grammar = _SCALE) -> Node:
    source = text.replace("^", "**")  # the usual written power; Python's ^ is xor
    try:
        body = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        label = f"{g.label}: " if g.label else ""
        raise InputError(f"{label}{text!r} {g.invalid}") from None
    return _tree(body, source, g)


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


_FUNCTIONS = {"sqrt": math.sqrt, "exp": math.exp, "log": math.log}

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
        if kind == "e":
            return math.e
        if kind in _FUNCTIONS:
            return _FUNCTIONS[kind](self._float(n[1], d))
        if kind == "neg":
            return -self._float(n[1], d)
        a, b = self._float(n[1], d), self._float(n[2], d)
        return cast(  # a complex power is refused by value()
            float,
            {"+": a + b, "-": a - b, "*": a * b}.get(kind)
            if kind in "+-*"
            else (a / b if kind == "/" else a**b),
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
        sympy = require("sympy", "exact values (exact=True, --exact)")

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
    """``d`` in a formula, in full: the formula is exact, where :func:`fmt` would round it."""
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


def read_number(text: str) -> float:
    """A finite number written as a decimal or a small expression of numbers.

    The same safe reader as :func:`parse_scale` (Python's :mod:`ast`, nothing evaluated but
    numbers, the constant ``e``, ``sqrt``, ``exp`` and ``log`` of one argument, parentheses,
    ``+ - * /`` and ``**`` or ``^``), for answers worked by hand: halves and exponentials are
    natural with ``d = 4``. At most 100 characters.

    Raises
    ------
    InputError
        For anything else, or a value that is not a finite number.

    Examples
    --------
    >>> read_number("9/2"), read_number("-1.5e1"), read_number("2^-1")
    (4.5, -15.0, 0.5)
    >>> round(read_number("exp(-1.5)"), 6), round(read_number("e^3/(1+e^3)"), 6)
    (0.22313, 0.952574)
    >>> read_number("import os")
    Traceback (most recent call last):
    ...
    qkv.errors.InputError: 'import os' is not a number or an expression such as 9/2 or exp(-1.5)
    """
    text = text.strip().replace("\u2212", "-")  # the typographic minus sign, as in "−1.5"
    if not text:
        raise InputError("empty: expected a number")
    if len(text) > _MAX_LEN:
        raise InputError(f"{text[:20]!r}…: longer than {_MAX_LEN} characters")
    tree = _parse(text, _ANSWER)
    try:
        v = ScaleExpr(text, tree)._float(tree, 1.0)
    except (ZeroDivisionError, OverflowError, ValueError, TypeError):
        v = math.nan
    if isinstance(v, complex) or not math.isfinite(v):
        raise InputError(f"{text!r} is not a finite number")
    return float(v)


@dataclass(frozen=True)
class ScaleInfo:
    """The scale and how it was chosen.

    Attributes
    ----------
    value : float
        The multiplier of the dot products.
    expr : ScaleExpr
        The formula (``1/sqrt(d)`` by default, or a number as given).
    d : int or None
        The ``d`` the formula was evaluated at (``None`` when it does not use ``d``).
    d_given : bool
        Whether ``d`` was given by the caller rather than taken from ``q.shape[-1]``.
    q_dim : int
        ``q.shape[-1]``, to point out when the given ``d`` differs from it.
    """

    value: float
    expr: ScaleExpr
    d: int | None
    d_given: bool
    q_dim: int

    @property
    def exact_text(self) -> str | None:
        """The exact value as a fraction (``"1/2"``), or ``None`` when it is irrational."""
        x = self.expr.exact(self.d if self.d is not None else 1)
        return None if x is None else str(x)

    @property
    def formula(self) -> str:
        return self.expr.formula()

    @property
    def substituted(self) -> str:
        return self.expr.formula(self.d) if self.expr.uses_d else self.expr.formula()

    @property
    def note(self) -> str | None:
        """A warning when the formula in ``d`` multiplies the scores by more than 1.

        Only a formula that is ``√d`` itself (for every ``d``: ``sqrt(d)``, ``d**0.5``...) is
        called the common slip of multiplying by √d; ``2*sqrt(d)`` is not that slip.

        >>> resolve_scale("2*sqrt(d)", 4, 2).note
        'this multiplies the scores by 2·√4 = 4; standard attention divides by √d (scale 1/√d)'
        """
        if not (self.expr.uses_d and self.d is not None and self.d > 1 and self.value > 1):
            return None
        value = "" if self.substituted == fmt(self.value) else f" = {fmt(self.value)}"
        head = f"this multiplies the scores by {self.substituted}{value}"
        tail = "standard attention divides by √d (scale 1/√d)"
        if self._is_sqrt_d():
            return f"{head}: multiplying by √d instead of dividing is a common slip; {tail}"
        return f"{head}; {tail}"

    def _is_sqrt_d(self) -> bool:
        """Whether the formula equals √d at this ``d`` and at two others."""
        try:
            return all(
                math.isclose(self.expr.value(x), math.sqrt(x), rel_tol=1e-12)
                for x in (self.d or 4, 3, 7)
            )
        except InputError:
            return False

    def describe(self) -> str:
        """One line: the formula, where ``d`` came from, and the value."""
        if not self.expr.uses_d:
            return self._describe_constant()
        src = "given" if self.d_given else "len(q)"
        if self.d_given:
            src += f"; len(q) = {self.q_dim}"
        text = f"{self.formula} with d = {self.d} ({src}): {self.substituted}"
        exact = self.exact_text
        if exact is None:
            return text + f" ≈ {fmt(self.value)}"
        if exact != self.substituted:
            text += f" = {exact}"
        if "/" in exact:
            sign = "=" if float(fmt(self.value)) == self.value else "≈"
            text += f" {sign} {fmt(self.value)}"
        return text

    def _describe_constant(self) -> str:
        exact = self.exact_text
        text = f"scale = {self.formula} (given)"
        if exact is not None and "/" in exact and len(exact) < len(self.formula):
            text += f" = {exact}"
        elif exact is None:  # irrational, or too long to write exactly: its float value
            text += f" ≈ {fmt(self.value)}"
        return text


#: The largest ``d`` accepted: every integer up to it is exact in float64.
MAX_D = 2**53


def check_d(d: Any) -> int:
    """``d`` as a positive integer up to :data:`MAX_D`, or :class:`InputError` naming it."""
    if isinstance(d, bool) or not isinstance(d, numbers.Real):
        raise InputTypeError(f"d: expected a positive integer, got {d!r}")
    try:
        f = float(d)
    except OverflowError:  # an integer (or fraction) beyond the float range: never repr it
        raise InputError("d: expected a positive integer up to 2**53, got one > 1e308") from None
    # cast: the numbers.Real stub has no >= nor int(); every Real accepted here has both
    if not (math.isfinite(f) and f.is_integer() and cast(Any, d) >= 1):
        raise InputError(f"d: expected a positive integer up to 2**53, got {d!r}")
    if f > MAX_D:
        raise InputError(f"d: expected a positive integer up to 2**53, got {f:.4g}")
    return int(cast(Any, d))


def check_d_and_scale(d: int | None, expr: ScaleExpr | None, *, label: str = "d, scale") -> None:
    """Refuse a ``d`` given with a scale that does not use it: they are alternatives.

    ``label`` names the two arguments in the message (``"--d and --scale"`` on the command
    line).

    Examples
    --------
    >>> check_d_and_scale(4, parse_scale("sqrt(d)"))  # an expression in d: d is its value
    >>> check_d_and_scale(4, parse_scale("2"))
    Traceback (most recent call last):
    ...
    qkv.errors.InputError: d, scale: give one of them: d = 4 sets the scale to 1/√4, and scale = 2 does not use d (an expression in d such as sqrt(d) uses d)
    """  # noqa: E501
    if d is not None and expr is not None and not expr.uses_d:
        raise InputError(
            f"{label}: give one of them: d = {d} sets the scale to 1/√{d}, and "
            f"scale = {expr.text} does not use d (an expression in d such as sqrt(d) uses d)"
        )


def _scale_expr(scale: Any) -> ScaleExpr:
    """``scale`` as an expression: the default ``1/sqrt(d)``, parsed text, or a number."""
    if scale is None:
        return parse_scale("1/sqrt(d)")
    if isinstance(scale, (str, ScaleExpr)):
        return parse_scale(scale)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise InputTypeError(
            f"scale: expected a number or an expression in d, got {type(scale).__name__}"
        )
    f = check_scale(scale, 1)  # finite and > 0, as for qkv.attention
    return parse_scale(fmt(f) if float(fmt(f)) == f else repr(f))


def resolve_scale(scale: Any, d: Any, q_dim: int) -> ScaleInfo:
    """The scale of a trace from ``scale`` (a number, an expression or ``None``) and ``d``.

    ``d`` defaults to ``q_dim`` (``len(q)``) where the expression uses it; a ``d`` given with a
    scale that does not use it is refused.

    Examples
    --------
    >>> resolve_scale(None, 4, 2).describe()
    '1/√d with d = 4 (given; len(q) = 2): 1/√4 = 1/2 = 0.5'
    >>> resolve_scale("sqrt(d)", None, 9).value
    3.0
    """
    if d is not None:
        d = check_d(d)
    expr = _scale_expr(scale)
    check_d_and_scale(d, expr)
    used_d = (d if d is not None else q_dim) if expr.uses_d else None
    value = expr.value(used_d if used_d is not None else 1)
    return ScaleInfo(value=value, expr=expr, d=used_d, d_given=d is not None, q_dim=q_dim)
