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
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from ..errors import InputError
from . import exercise, explain, explain_model, explore, scores, study
from .options import OutputError

__all__ = ["COMMANDS", "UsageError", "build_parser", "main"]

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
    from .. import __version__

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
    """Codec error handler: characters the output cannot encode become ``\\uXXXX``.

    The same escapes as JSON's, so a JSON document stays valid (and equal once loaded).
    """
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    out = []
    for ch in exc.object[exc.start : exc.end]:
        n = ord(ch)
        if n > 0xFFFF:  # a UTF-16 surrogate pair, as JSON writes it
            n -= 0x10000
            out.append(f"\\u{0xD800 + (n >> 10):04x}\\u{0xDC00 + (n & 0x3FF):04x}")
        else:
            out.append(f"\\u{n:04x}")
    return "".join(out), exc.end


ESCAPE = "qkv-escape"
codecs.register_error(ESCAPE, _escape)


def _encodable_stdout() -> Callable[[], None]:
    """Let standard output escape what its encoding cannot hold (·, √, ᵀ on ASCII); undo."""
    out = sys.stdout
    encoding, errors = getattr(out, "encoding", None), getattr(out, "errors", None)
    if not encoding or errors != "strict" or not hasattr(out, "reconfigure"):
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


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = None
    try:
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
        print(f"qkv {args.command}: error: {_one_line(exc)}", file=sys.stderr)
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
