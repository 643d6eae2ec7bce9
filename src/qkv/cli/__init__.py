"""The ``qkv`` command: thin over the library — parse, call, render.

Each command is a module with ``NAME`` and ``register(subparsers)``; adding one is a line in
:data:`COMMANDS`. Every user error prints one line on standard error and exits with status 2,
never a traceback (argparse's own errors included).

Examples
--------
A ragged matrix is a user error: one line on standard error, status 2.

>>> main(["scores", "--q", "2,1", "--k", "1,0;3"])
2
"""

from __future__ import annotations

import argparse
import codecs
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from ..errors import InputError
from ..extras import EXTRAS, hint
from . import exercise, explain, explain_model, explore, scores, study
from .options import OutputError

__all__ = ["COMMANDS", "UsageError", "attach_values", "build_parser", "main"]

#: The command modules, in the order ``qkv --help`` lists them.
COMMANDS = [explain, scores, exercise, study, explore, explain_model]

EPILOG = """examples:
  qkv explain --q "2,1" --k "1,0;3,2" --v "1,2;3,4" --d 4
  qkv scores --q "2,1" --k "1,0;3,2" --d 4 --scale "sqrt(d)"
  qkv exercise --seed 7 --answers

Run "qkv COMMAND --help" for each command's options and examples."""


class UsageError(Exception):
    """A command-line usage error (argparse's), reported in one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(
            f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)"
        )


def build_parser() -> argparse.ArgumentParser:
    """The ``qkv`` argument parser, with one subparser per module in :data:`COMMANDS`."""
    from .._version import __version__

    parser = _Parser(
        prog="qkv",
        description="Scaled dot-product attention, softmax(q·Kᵀ/√d)·V, explained step by step.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"qkv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for module in COMMANDS:
        module.register(sub)
    return parser


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


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


def _encodable_stdout() -> Callable[[], None]:
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


def _silence_stdout() -> None:
    """After a failed write, point the process's stdout at the null device.

    Python flushes standard output again at exit; without this, the data still buffered would
    fail a second time and print an "Exception ignored" traceback.
    """
    if sys.stdout is not sys.__stdout__:
        return
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError, AttributeError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``qkv`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status.

    0 on success, 2 for a user error (one line on standard error), 1 when standard output
    cannot be written (an environment error, also one line).
    """
    restore = _encodable_stdout()
    try:
        return _main(argv)
    finally:
        restore()


def _value_options(parser: argparse.ArgumentParser) -> tuple[set[str], set[str]]:
    """Option strings that take exactly one value, and all option strings, of every (sub)parser."""
    takes, known = set(), set()
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


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = None
    try:
        argv = attach_values(parser, sys.argv[1:] if argv is None else list(argv))
        args = parser.parse_args(argv)
        if args.command is None:
            names = ", ".join(m.NAME for m in COMMANDS)
            raise UsageError(f"qkv: error: choose a command: {names} (see qkv --help)")
        return args.run(args)
    except SystemExit as exc:  # --help and --version exit 0 through argparse
        return exc.code if isinstance(exc.code, int) else 0
    except UsageError as exc:
        print(_one_line(exc), file=sys.stderr)
        return 2
    except InputError as exc:
        name = getattr(args, "command_name", args.command)  # e.g. "study scaling"
        print(f"qkv {name}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # an optional library no require() call named first
        top = (exc.name or "").split(".")[0]
        if top not in EXTRAS or args is None:
            raise
        name = getattr(args, "command_name", args.command)
        print(f"qkv {name}: error: {_one_line(hint(top, f'qkv {name}'))}", file=sys.stderr)
        return 2
    except MemoryError:
        what = "qkv" if args is None or args.command is None else f"qkv {args.command}"
        print(f"{what}: error: out of memory; try smaller inputs", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. piped into head
        _silence_stdout()
        return 0
    except (OutputError, OSError) as exc:  # e.g. a full disk: not a usage error
        _silence_stdout()
        what = "qkv" if args is None or args.command is None else f"qkv {args.command}"
        text = str(exc) if isinstance(exc, OutputError) else exc.strerror or str(exc)
        print(f"{what}: error: {_one_line(text)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
