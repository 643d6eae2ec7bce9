"""Terminal plumbing for the ``qkv`` command: what its output can encode, and its argv.

- Standard output and error that cannot encode a character (``·``, ``√``, ``ᵀ`` on an ASCII or
  C-locale terminal) write it as JSON's ``\\uXXXX`` escape instead of failing
  (:func:`encodable_stdout`), so a JSON document stays valid and equal; table rules drawn with
  ``─`` fall back to ``-`` there (:func:`plain_rules`), so columns stay aligned.
- After a failed write, standard output is pointed at the null device (:func:`silence_stdout`).
- A value that starts with ``-`` stays with its option (:func:`attach_values`).

None of this knows about attention; the command table is in :mod:`qkv.cli`.
"""

from __future__ import annotations

import argparse
import codecs
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO, cast

__all__ = ["ESCAPE", "attach_values", "encodable_stdout", "plain_rules", "silence_stdout"]


def _escape(exc: UnicodeError) -> tuple[str, int]:
    """Codec error handler: characters the output cannot encode become JSON's ``\\uXXXX``
    escapes (not ``backslashreplace``'s ``\\xb7``), so a JSON document stays valid and equal."""
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    return json.dumps(exc.object[exc.start : exc.end])[1:-1], exc.end


ESCAPE = "qkv-escape"
codecs.register_error(ESCAPE, _escape)


# Error handlers that fail on a character the encoding lacks ("surrogateescape" is what Python
# picks for the C/POSIX locale); the others (replace, backslashreplace...) never fail.
_FAILING_HANDLERS = ("strict", "surrogateescape", "surrogatepass")

#: Box-drawing characters of the text tables, and the ASCII drawn in their place: one
#: character for one, so the columns stay aligned.
RULES = {"─": "-", "═": "=", "│": "|"}
_RULES = str.maketrans(RULES)


def encodable_stdout() -> Callable[[], None]:
    """Let standard output and error escape what their encoding cannot hold (·, √, ᵀ on
    ASCII); returns a function that undoes it."""
    undo = [_encodable(sys.stdout), _encodable(sys.stderr)]

    def restore() -> None:
        for u in undo:
            u()

    return restore


def _encodable(out: Any) -> Callable[[], None]:
    encoding, errors = getattr(out, "encoding", None), getattr(out, "errors", None)
    if not encoding or errors not in _FAILING_HANDLERS or not hasattr(out, "reconfigure"):
        return lambda: None
    try:
        if codecs.lookup(encoding).name.startswith("utf"):
            return lambda: None
    except LookupError:
        return lambda: None
    out.reconfigure(errors=ESCAPE)

    def restore() -> None:
        try:
            out.reconfigure(errors=errors)
        except (OSError, ValueError):
            pass

    return restore


def plain_rules(text: str, out: Any = None) -> str:
    """``text`` with its table rules in ASCII when ``out`` (default: standard output) cannot
    encode them; unchanged otherwise.

    >>> import io
    >>> ascii_out = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    >>> plain_rules("  ───  ──", ascii_out), plain_rules("  ───", io.StringIO())
    ('  ---  --', '  ───')
    """
    out = sys.stdout if out is None else out
    encoding = getattr(out, "encoding", None)
    if not encoding:
        return text
    try:
        "".join(RULES).encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return text.translate(_RULES)
    return text


def silence_stdout() -> None:
    """After a failed write, point the process's stdout at the null device.

    Python flushes standard output again at exit; without this, the data still buffered would
    fail a second time and print an "Exception ignored" traceback.
    """
    if sys.stdout is not sys.__stdout__:
        return
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        # no stdout at all (None) raises AttributeError, caught below
        os.dup2(fd, cast(TextIO, sys.stdout).fileno())
        os.close(fd)
    except (OSError, ValueError, AttributeError):
        pass


def _value_options(parser: argparse.ArgumentParser) -> tuple[set[str], set[str]]:
    """Option strings that take exactly one value, and all option strings, of every (sub)parser."""
    takes: set[str] = set()
    known: set[str] = set()
    for action in parser._actions:
        known.update(action.option_strings)
        if action.option_strings and action.nargs is None:
            takes.update(action.option_strings)
        subparsers = action.choices if isinstance(action, argparse._SubParsersAction) else {}
        for sub in subparsers.values():
            if isinstance(sub, argparse.ArgumentParser):
                t, k = _value_options(sub)
                takes |= t
                known |= k
    return takes, known


def attach_values(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """Keep a value that starts with ``-`` with its option: ``--q -1,2`` becomes ``--q=-1,2``.

    argparse takes ``-1,2`` for an option of its own and fails with "expected one argument";
    a matrix, window or scale may well start with a minus sign. A token is attached when it
    follows an option that takes one value, starts with a single ``-`` and is no option itself.

    >>> from qkv.cli import build_parser
    >>> attach_values(build_parser(), ["explain", "--q", "-1,2", "--k", "1,0", "--window", "-1,0"])
    ['explain', '--q=-1,2', '--k', '1,0', '--window=-1,0']
    """
    takes, known = _value_options(parser)
    out: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if (
            tok in takes
            and nxt is not None
            and nxt.startswith("-")
            and not nxt.startswith("--")
            and nxt not in known
        ):
            out.append(f"{tok}={nxt}")
            i += 2
            continue
        out.append(tok)
        if tok == "--":
            out.extend(argv[i + 1 :])
            break
        i += 1
    return out
