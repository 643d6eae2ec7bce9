"""Parse command-line values: matrices, windows, ``d`` and scale expressions.

Matrices come inline (``"1,0;3,2"``: rows split by ``;``, entries by ``,`` or spaces), as JSON
(``"[[1,0],[3,2]]"``), or from a file as ``@path``: ``.npy`` (loaded with
``allow_pickle=False``), ``.json``, or ``.csv``/``.txt`` (one row per line). Every problem
raises :class:`qkv.InputError` naming the option.

Examples
--------
>>> matrix("1,0;3,2", "--k").tolist()
[[1.0, 0.0], [3.0, 2.0]]
>>> matrix("2 1", "--q").tolist()
[2.0, 1.0]
>>> matrix("[[1, 0], [3, 2]]", "--k", min_ndim=2).shape
(2, 2)
>>> window("2,0"), window(",3"), window("none,1")
((2, 0), (None, 3), (None, 1))
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from ..checks import not_rectangular, parse_int, parse_window
from ..errors import InputError
from ..explanation.scale import ScaleExpr, parse_scale

__all__ = ["d_value", "matrix", "scale", "window"]

_SPLIT = re.compile(r"[,\s]+")


def _number(tok: str, name: str, where: str) -> float:
    try:
        x = float(tok.replace("\u2212", "-"))  # the typographic minus sign, as in "−2"
    except ValueError:
        why = ""
        odd = sorted({c for c in tok if not c.isascii()})
        if odd:
            why = f"; it holds {', '.join(f'U+{ord(c):04X}' for c in odd)}: write numbers in ASCII"
        raise InputError(f"{name}: {tok!r} is not a number ({where}{why})") from None
    if not math.isfinite(x):
        raise InputError(f"{name}: {tok!r} is not a finite number ({where})")
    return x


def _entries(line: str, name: str, n: int) -> list[str]:
    """The entries of one row: split by commas (with any spaces around them) or by spaces.

    An empty entry — two commas in a row, or a comma at either end — is refused rather than
    skipped: ``"2,,1"`` is a typo, not the vector ``[2, 1]``.
    """
    if not line:
        raise InputError(f"{name}: row {n} is empty")
    parts = [p.strip() for p in line.split(",")]
    for e, p in enumerate(parts, start=1):
        if not p:
            why = (
                "starts with a comma"
                if e == 1
                else "ends with a comma"
                if e == len(parts)
                else f"has an empty entry {e} (two commas in a row)"
            )
            raise InputError(f"{name}: row {n} {why}; write a number between commas")
    return [t for p in parts for t in p.split()]


def _rows_text(text: str, name: str, row_sep: str) -> np.ndarray:
    lines = [r.strip() for r in text.strip().split(row_sep)]
    if row_sep == ";" and len(lines) > 1 and not lines[-1]:
        raise InputError(f"{name}: ends with ';' and no row after it (stray semicolon?)")
    rows = []
    for n, line in enumerate(lines, start=1):
        toks = _entries(line, name, n)
        rows.append([_number(t, name, f"row {n}, entry {e}") for e, t in enumerate(toks, 1)])
    if not rows:
        raise InputError(f"{name}: no numbers given")
    ragged = not_rectangular(rows, name)
    if ragged is not None:
        raise ragged
    a = np.array(rows, dtype=np.float64)
    return a[0] if len(rows) == 1 and row_sep == ";" and ";" not in text else a


def _from_json(data: Any, name: str) -> np.ndarray:
    def check(x: Any, depth: int) -> None:
        if isinstance(x, list):
            if depth > 4 or not x:
                raise InputError(f"{name}: expected a non-empty list of numbers or of rows")
            for e in x:
                check(e, depth + 1)
        elif isinstance(x, bool) or not isinstance(x, (int, float)):
            raise InputError(f"{name}: {json.dumps(x)[:20]} is not a number")
        else:
            try:
                finite = math.isfinite(x)
            except OverflowError:  # an integer beyond the float range
                finite = False
            if not finite:
                shown = str(x) if isinstance(x, float) else "an integer of 309 or more digits"
                raise InputError(f"{name}: {shown} is not a finite number (too large for float64)")

    check(data, 0)
    try:
        a = np.array(data, dtype=np.float64)
    except ValueError:
        raise not_rectangular(data, name) or InputError(
            f"{name}: cannot be read as a rectangular array"
        ) from None
    if a.ndim == 0:
        a = a.reshape(1)
    return a


def _loads(text: str, name: str, where: str) -> Any:
    """``json.loads``, with every way it can fail as an :class:`InputError` naming ``name``."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(
            f"{name}: {where}not valid JSON ({exc.msg}, line {exc.lineno} column {exc.colno})"
        ) from None
    except RecursionError:
        raise InputError(f"{name}: {where}JSON nested too deeply for a matrix") from None
    except ValueError:  # an integer longer than Python converts from text (4300 digits)
        raise InputError(
            f"{name}: {where}not a usable JSON matrix: a number has thousands of digits"
        ) from None


def _from_file(path_text: str, name: str) -> np.ndarray:
    path = Path(path_text)
    suffix = path.suffix.lower()
    if path.is_dir():
        raise InputError(f"{name}: cannot read {path_text!r}: it is a directory, not a file")
    if suffix not in (".npy", ".json", ".csv", ".txt"):
        raise InputError(
            f"{name}: cannot read {path_text!r}: expected a .npy, .json, .csv or .txt file"
        )
    try:
        if suffix == ".npy":
            try:
                a = np.load(path, allow_pickle=False)
            except ValueError as exc:
                if "pickle" in str(exc).lower():
                    raise InputError(
                        f"{name}: {path_text!r} holds pickled objects, which qkv never loads"
                    ) from None
                raise InputError(f"{name}: {path_text!r} is not a valid .npy file") from None
            if not isinstance(a, np.ndarray):
                raise InputError(f"{name}: {path_text!r} is not a single .npy array")
            if a.dtype == bool or not (
                np.issubdtype(a.dtype, np.integer) or np.issubdtype(a.dtype, np.floating)
            ):
                raise InputError(f"{name}: {path_text!r} holds dtype {a.dtype}, not real numbers")
            return a.astype(np.float64) if np.issubdtype(a.dtype, np.integer) else a
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"{name}: cannot read {path_text!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise InputError(f"{name}: {path_text!r} is not UTF-8 text") from None
    if suffix == ".json":
        return _from_json(_loads(text, name, f"{path_text!r} is "), name)
    try:
        a = _rows_text(text, name, "\n")
    except InputError as exc:
        why = str(exc).removeprefix(f"{name}: ")
        line = text.strip().split("\n")[0].strip()
        if "(row 1," in why and not any(_is_number(t) for t in _SPLIT.split(line) if t):
            why = f"row 1 looks like a header ({line[:40]!r}); qkv reads numbers only"
        raise InputError(f"{name}: {path_text!r}: {why}") from None
    return a[0] if a.shape[0] == 1 else a


def _is_number(tok: str) -> bool:
    try:
        float(tok)
    except ValueError:
        return False
    return True


def matrix(text: str, name: str, *, min_ndim: int = 1) -> np.ndarray:
    """A matrix (or vector) from an option's text; ``min_ndim=2`` turns one row into ``(1, n)``."""
    text = _undo_surrogates(text).strip()
    if not text:
        raise InputError(f"{name}: empty")
    if text.startswith("@"):
        a = _from_file(text[1:], name)
    elif text.startswith("["):
        a = _from_json(_loads(text, name, ""), name)
    else:
        a = _rows_text(text, name, ";")
    if a.ndim > 2 and name != "--q":
        raise InputError(f"{name}: expected a matrix, got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise InputError(f"{name}: contains NaN or infinity")
    return a.reshape(1, -1) if a.ndim < min_ndim else a


def _undo_surrogates(text: str) -> str:
    """Arguments Python could not decode (the C locale) as UTF-8, where they are UTF-8."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8")
    except UnicodeError:
        return text


def window(text: str) -> tuple[int | None, int | None]:
    """``"L,R"``: keys from ``p - L`` to ``p + R``; an empty side or ``none`` is unbounded."""
    return parse_window(text, "--window")


def d_value(text: str) -> int:
    """``--d``: a positive integer."""
    try:
        return parse_int(text, "--d", minimum=1, maximum=2**53)
    except InputError:
        shown = text if len(text) <= 30 else text[:20] + "…"
        raise InputError(f"--d: expected a positive integer up to 2**53, got {shown!r}") from None


def scale(text: str) -> ScaleExpr:
    """``--scale``: a number or an expression in d (``1/sqrt(d)``, ``sqrt(d)``, ``1``)."""
    try:
        return parse_scale(text)
    except InputError as exc:
        raise InputError("--" + str(exc)) from None
