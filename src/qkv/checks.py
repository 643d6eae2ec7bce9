"""Argument checks shared by the library and the command line.

One rule for "an integer in a range" and "a real number that is finite (and > 0)": the library
checks its arguments with :func:`check_int` and :func:`check_real`, and the ``qkv`` command reads
its options with :func:`parse_int` and :func:`parse_real`, which read the text and then apply the
same checks. Every failure is an :class:`~qkv.InputError` (an :class:`~qkv.InputTypeError` for a
wrong type) whose message starts with the argument's name.

Examples
--------
>>> check_int(3, "keys", minimum=1)
3
>>> check_int(0, "keys", minimum=1, maximum=8)
Traceback (most recent call last):
...
qkv.errors.InputError: keys: must be in [1, 8], got 0
>>> check_real(0.5, "lr", positive=True)
0.5
>>> parse_int(" 12 ", "--steps"), parse_real("1e-3", "--lr")
(12, 0.001)
>>> parse_int("1.5", "--steps")
Traceback (most recent call last):
...
qkv.errors.InputError: --steps: expected an integer, got '1.5'
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Any

import numpy as np

from .errors import InputError, InputTypeError

__all__ = ["check_int", "check_real", "not_rectangular", "parse_int", "parse_real", "parse_window"]

_INT_TEXT = re.compile(r"[+-]?\d{1,4000}")  # Python converts at most 4300 digits from text


def _shown(value: Any) -> str:
    """``repr(value)`` when short, else its type's name (an array's repr can be megabytes)."""
    text = repr(value)
    return text if len(text) <= 60 else f"a {type(value).__name__}"


def _bounds(minimum: float | None, maximum: float | None) -> str:
    if maximum is None:
        return f">= {minimum}"
    if minimum is None:
        return f"<= {maximum}"
    return f"in [{minimum}, {maximum}]"


def check_int(
    value: Any, name: str, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    """``value`` as an ``int``, if it is an integer (not a bool) within ``[minimum, maximum]``.

    Parameters
    ----------
    value : Any
        The argument; any :class:`numbers.Integral` but ``bool`` (NumPy integers included).
    name : str
        The argument's name, which starts every error message.
    minimum, maximum : int, optional
        Inclusive bounds; ``None`` leaves that side open.

    Raises
    ------
    InputTypeError
        ``value`` is not an integer.
    InputError
        ``value`` is out of bounds.

    Examples
    --------
    >>> import numpy as np
    >>> check_int(np.int64(4), "d", minimum=1)
    4
    >>> check_int(True, "d")
    Traceback (most recent call last):
    ...
    qkv.errors.InputTypeError: d: expected an integer, got True
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InputTypeError(f"{name}: expected an integer, got {_shown(value)}")
    value = int(value)  # an Integral (a NumPy integer too); the same value
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise InputError(f"{name}: must be {_bounds(minimum, maximum)}, got {value}")
    return int(value)


def check_real(value: Any, name: str, *, finite: bool = True, positive: bool = False) -> float:
    """``value`` as a ``float``, if it is a real number (not a bool), finite and > 0 as asked.

    Parameters
    ----------
    value : Any
        The argument; any :class:`numbers.Real` but ``bool``.
    name : str
        The argument's name, which starts every error message.
    finite : bool
        Refuse NaN and infinities (and integers beyond the float range), default ``True``.
    positive : bool
        Refuse values ``<= 0``.

    Raises
    ------
    InputTypeError
        ``value`` is not a real number.
    InputError
        ``value`` is not finite or not positive, as asked.

    Examples
    --------
    >>> check_real(2, "softcap", positive=True)
    2.0
    >>> check_real(float("nan"), "softcap", positive=True)
    Traceback (most recent call last):
    ...
    qkv.errors.InputError: softcap: must be finite and > 0, got nan
    >>> check_real(10**400, "scale")
    Traceback (most recent call last):
    ...
    qkv.errors.InputError: scale: must be finite, got a number beyond float range
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputTypeError(f"{name}: expected a real number, got {_shown(value)}")
    want = " and ".join(w for w, on in (("finite", finite), ("> 0", positive)) if on)
    try:
        x = float(value)
    except OverflowError:  # an integer beyond the float range: never print all its digits
        if finite or (positive and value <= 0):
            raise InputError(f"{name}: must be {want}, got a number beyond float range") from None
        x = math.copysign(math.inf, value)
    if (finite and not math.isfinite(x)) or (positive and not x > 0.0):
        raise InputError(f"{name}: must be {want}, got {x}")
    return x


def parse_int(
    text: str, name: str, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    """An integer written as ``text`` (spaces around it allowed), checked by :func:`check_int`.

    Examples
    --------
    >>> parse_int("99", "--keys", minimum=1, maximum=8)
    Traceback (most recent call last):
    ...
    qkv.errors.InputError: --keys: must be in [1, 8], got 99
    """
    stripped = str(text).strip()
    if not _INT_TEXT.fullmatch(stripped):
        shown = text if len(text) <= 30 else text[:20] + "…"
        raise InputError(f"{name}: expected an integer, got {shown!r}")
    return check_int(int(stripped), name, minimum=minimum, maximum=maximum)


def parse_real(text: str, name: str, *, finite: bool = True, positive: bool = False) -> float:
    """A real number written as ``text``, checked by :func:`check_real`.

    Examples
    --------
    >>> parse_real("inf", "--lr")
    Traceback (most recent call last):
    ...
    qkv.errors.InputError: --lr: must be finite, got inf
    """
    try:
        x = float(str(text).strip())
    except ValueError:
        shown = text if len(text) <= 30 else text[:20] + "…"
        raise InputError(f"{name}: expected a number, got {shown!r}") from None
    return check_real(x, name, finite=finite, positive=positive)


def parse_window(text: str, name: str) -> tuple[int | None, int | None]:
    """A sliding window written as ``"L,R"``: keys from ``p - L`` to ``p + R``; an empty side,
    ``none`` or ``inf`` is unbounded.

    Examples
    --------
    >>> parse_window("2,0", "--window"), parse_window(" ,none", "--window")
    ((2, 0), (None, None))
    >>> parse_window("2,-1", "--window")
    Traceback (most recent call last):
    ...
    qkv.errors.InputError: --window: right must be an integer >= 0 or empty, got '-1'
    """
    parts = text.split(",")
    if len(parts) != 2:
        raise InputError(f"{name}: expected L,R (e.g. 2,0), got {text!r}")
    sides: list[int | None] = []
    for side, p in zip(("left", "right"), parts, strict=True):
        p = p.strip().lower()
        if p in ("", "none", "inf"):
            sides.append(None)
            continue
        try:
            sides.append(parse_int(p, name, minimum=0))
        except InputError:
            raise InputError(
                f"{name}: {side} must be an integer >= 0 or empty, got {p!r}"
            ) from None
    return sides[0], sides[1]


def _is_list(x: Any) -> bool:
    return isinstance(x, (list, tuple)) or (isinstance(x, np.ndarray) and x.ndim > 0)


def not_rectangular(x: Any, name: str) -> InputError | None:
    """The error for nested lists that are not a rectangular array, or ``None`` when they are.

    One message for the library (:func:`qkv.validate.as_array`) and the command line: the
    rows' lengths are named, as a learner typing a matrix needs them.

    Examples
    --------
    >>> str(not_rectangular([[1, 0], [3]], "k"))
    'k: rows have different lengths (2, 1); a matrix must be rectangular'
    >>> str(not_rectangular([[1, 2], 3], "q"))
    'q: mixes rows and numbers at depth 1 ([1, 2] and 3); a matrix must be rectangular'
    >>> not_rectangular([[1, 0], [3, 2]], "k") is None
    True
    """
    level, depth = [x], 0
    while True:
        lists = [_is_list(e) for e in level]
        if not any(lists):
            return None
        if not all(lists):
            row = next(e for e in level if _is_list(e))
            number = next(e for e in level if not _is_list(e))
            return InputError(
                f"{name}: mixes rows and numbers at depth {depth} ({_brief(row)} and "
                f"{_brief(number)}); a matrix must be rectangular"
            )
        lengths = [len(e) for e in level]
        if len(set(lengths)) > 1:
            sizes = ", ".join(str(n) for n in lengths[:8]) + (", …" if len(lengths) > 8 else "")
            innermost = not any(_is_list(c) for e in level for c in e)
            what = "rows" if innermost else f"the lists at depth {depth}"
            return InputError(
                f"{name}: {what} have different lengths ({sizes}); "
                f"{'a matrix' if innermost else 'an array'} must be rectangular"
            )
        level, depth = [c for e in level for c in e], depth + 1


def _brief(x: Any) -> str:
    text = repr(x.tolist() if isinstance(x, np.ndarray) else x)
    return text if len(text) <= 20 else text[:19] + "…"
