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
import sys
from collections.abc import Sequence
from typing import NoReturn

from ..errors import InputError
from . import exercise, explain, scores, study

__all__ = ["COMMANDS", "UsageError", "build_parser", "main"]

#: The command modules, in the order ``qkv --help`` lists them.
COMMANDS = [explain, scores, exercise, study]

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


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``qkv`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
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
    except BrokenPipeError:  # e.g. piped into head
        return 0
    except KeyboardInterrupt:
        return 130
