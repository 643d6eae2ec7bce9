"""The ``qkv`` command: thin over the library — parse, call, render.

Each command is a module with ``NAME`` and ``register(subparsers)``; adding one is a line in
:data:`COMMANDS`. Every user error prints one line on standard error and exits with status 2,
never a traceback (argparse's own errors included). Terminal plumbing (what standard output
can encode, values that start with ``-``) is in :mod:`qkv.cli.terminal`.

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
from typing import Any, NoReturn

from ..errors import InputError
from ..extras import EXTRAS, hint
from ..keywords import nearest
from . import conform, exercise, explain, explain_model, explore, info, learn, scores, study
from .options import OutputError
from .terminal import attach_values, encodable_stdout, silence_stdout

__all__ = ["COMMANDS", "UsageError", "attach_values", "build_parser", "main"]

#: The command modules, in the order ``qkv --help`` lists them.
COMMANDS = [explain, scores, exercise, study, explore, learn, explain_model, conform, info]

EPILOG = """examples:
  qkv explain --q "2,1" --k "1,0;3,2" --v "1,2;3,4" --d 4
  qkv scores --q "2,1" --k "1,0;3,2" --d 4 --scale "sqrt(d)"
  qkv exercise --seed 7 --answers

Run "qkv COMMAND --help" for each command's options and examples."""


#: Commands people type that are options of another: where to go instead.
POINTERS = {
    "practice": "the practice session is qkv exercise --practice (add --seed N for a given one)",
    "version": "qkv --version prints the version (qkv info: the installation)",
}


class UsageError(Exception):
    """A command-line usage error (argparse's), reported in one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(
            f"{self.prog}: error: {' '.join(message.split())}{_near_command(self, message)} "
            f"(see {self.prog} --help)"
        )

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        try:
            ns, extras = self.parse_known_args(args, namespace)
        except UsageError:  # e.g. a required option missing: a mistyped one is the likelier fix
            _unrecognized(self, None, list(args or []), only_options=True)
            raise
        if extras:
            _unrecognized(self, ns, extras)
        return ns


def _near_command(parser: argparse.ArgumentParser, message: str) -> str:
    """``; did you mean 'explain'?`` for argparse's ``invalid choice: 'explan'``."""
    if not message.startswith("argument COMMAND: invalid choice:"):
        return ""
    given = message.split("'")[1] if message.count("'") >= 2 else ""
    if given in POINTERS:
        return f"; {POINTERS[given]}"
    near = nearest(given.replace("-", "_"), [m.NAME.replace("-", "_") for m in COMMANDS])
    return f"; did you mean {near.replace('_', '-')!r}?" if near else ""


def _chosen(parser: argparse.ArgumentParser, ns: Any, argv: list[str]) -> Any:
    """The (sub)command parser that was chosen: ``qkv study scaling`` has two levels."""
    chosen = parser
    while True:
        subs = [a for a in chosen._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return chosen
        if ns is not None:
            name = getattr(ns, subs[0].dest, None)
        else:
            name = next((t for t in argv if t in subs[0].choices), None)
        if name not in subs[0].choices:
            return chosen
        chosen = subs[0].choices[name]


def _known(parser: argparse.ArgumentParser, option: str) -> bool:
    names = parser._option_string_actions
    return option in names or sum(n.startswith(option) for n in names) == 1


def _unrecognized(
    parser: argparse.ArgumentParser, ns: Any, extras: list[str], only_options: bool = False
) -> None:
    """Refuse options the chosen command does not take, naming the nearest one it does.

    With ``only_options`` (``ns`` is ``None``; ``extras`` is the whole command line), only an
    option the chosen command does not know is refused, and nothing is raised without one.
    """
    chosen = _chosen(parser, ns, extras)
    if only_options and any(isinstance(a, argparse._SubParsersAction) for a in chosen._actions):
        return  # no command was chosen: that is the error to report
    options = [x.split("=")[0] for x in extras if x.startswith("--") and len(x) > 2]
    option = next((o for o in options if not _known(chosen, o)), None)
    if only_options and option is None:
        return
    text = option if only_options else " ".join(extras)
    hint = ""
    if option is not None:
        takes = {o.lstrip("-").replace("-", "_"): o for o in chosen._option_string_actions}
        near = nearest(option.lstrip("-").replace("-", "_"), takes)
        hint = f"; did you mean {takes[near]}?" if near else ""
    raise UsageError(
        f"{chosen.prog}: error: unrecognized arguments: {text}{hint} (see {chosen.prog} --help)"
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
    parser.add_argument(
        "--version",
        action="version",
        version=f"qkv {__version__}",
        help="print the version and exit (with --verbose: the report of qkv info)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for module in COMMANDS:
        module.register(sub)
    return parser


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``qkv`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status.

    0 on success, 2 for a user error (one line on standard error), 1 when standard output
    cannot be written (an environment error, also one line).
    """
    restore = encodable_stdout()
    try:
        return _main(argv)
    finally:
        restore()


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = None
    try:
        argv = attach_values(parser, sys.argv[1:] if argv is None else list(argv))
        if "--verbose" in argv[:2] and "--version" in argv[:2]:  # not an option of its own:
            # a top-level --verbose would make abbreviations such as --v ambiguous
            return info.run(argparse.Namespace(json=False))
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
        # argparse turns a type= reader's InputError (a ValueError) into a usage error
        assert args is not None  # so only a parsed command raises it here
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
        silence_stdout()
        return 0
    except (OutputError, OSError) as exc:  # e.g. a full disk: not a usage error
        silence_stdout()
        what = "qkv" if args is None or args.command is None else f"qkv {args.command}"
        text = str(exc) if isinstance(exc, OutputError) else exc.strerror or str(exc)
        print(f"{what}: error: {_one_line(text)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
