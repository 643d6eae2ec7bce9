"""Options shared by the commands, and writing the result."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..explanation.scale import check_d_and_scale
from ..render import FORMATS
from . import parse
from .terminal import plain_rules

__all__ = [
    "OutputError",
    "add_format",
    "add_inputs",
    "arg_type",
    "emit",
    "trace_kwargs",
    "write_stdout",
]


class OutputError(Exception):
    """Standard output could not be written (disk full, closed): an environment error."""


def arg_type(read: Callable[..., Any], name: str, **limits: Any) -> Callable[[str], Any]:
    """An argparse ``type=`` from one of :mod:`qkv.checks`' readers (or any reader that raises
    :class:`~qkv.InputError` starting with ``name``), so the command reads an option with the
    library's own rule and argparse reports it in one line: ``argument --keys: must be ...``.

    >>> from qkv.checks import parse_int
    >>> arg_type(parse_int, "--keys", minimum=1)("0")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: must be >= 1, got 0
    """

    def read_option(text: str) -> Any:
        try:
            return read(text, name, **limits)
        except InputError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{name}: ")) from None

    return read_option


def add_inputs(p: argparse.ArgumentParser, *, values: bool, masks: bool) -> None:
    p.add_argument(
        "--q", required=True, metavar="Q", help='queries: "2,1", "1,0;0,1", JSON, or @file'
    )
    p.add_argument("--k", required=True, metavar="K", help='keys, one per row: "1,0;3,2"')
    if values:
        p.add_argument("--v", metavar="V", help='values, one per row: "1,2;3,4" (optional)')
    p.add_argument("--d", metavar="D", help="set the scale to 1/sqrt(D); D need not be len(q)")
    p.add_argument(
        "--scale",
        metavar="S",
        help='a number, or an expression in d: "1/sqrt(d)" (default), "sqrt(d)", "1"',
    )
    if masks:
        p.add_argument("--causal", action="store_true", help="causal (bottom-right aligned)")
        p.add_argument("--window", metavar="L,R", help="sliding window: keys p-L .. p+R")
    p.add_argument("--exact", action="store_true", help="exact values and closed forms (SymPy)")


def add_format(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=list(FORMATS), default="text", help="output format (text)")
    p.add_argument("--output", metavar="FILE", help="write to FILE instead of standard output")


def add_command(sub: Any, name: str, help: str, epilog: str) -> argparse.ArgumentParser:
    """A subcommand's parser: ``help`` is also its description, ``epilog`` its examples (kept
    as written)."""
    return sub.add_parser(
        name,
        help=help,
        description=help,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def trace_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Arguments for :func:`qkv.explain` from the parsed options."""
    d = None if args.d is None else parse.d_value(args.d)
    scale = None if args.scale is None else parse.scale(args.scale)
    check_d_and_scale(d, scale, label="--d and --scale")
    kw: dict[str, Any] = dict(
        q=parse.matrix(args.q, "--q"),
        k=parse.matrix(args.k, "--k", min_ndim=2),
        d=d,
        scale=scale,
        exact=args.exact,
    )
    if getattr(args, "v", None) is not None:
        kw["v"] = parse.matrix(args.v, "--v", min_ndim=2)
    if getattr(args, "causal", False):
        kw["causal"] = True
    if getattr(args, "window", None) is not None:
        kw["window"] = parse.window(args.window)
    return kw


def emit(text: str, output: str | None, format: str = "text") -> None:
    """Write ``text`` to standard output, or to the file ``output`` and then say ``wrote FILE``
    on standard error (as ``qkv study`` does: every command that writes a file says so).

    A ``format="text"`` document's table rules fall back to ASCII where standard output
    cannot encode them (:func:`qkv.cli.terminal.plain_rules`).
    """
    if output is None:
        write_stdout(plain_rules(text) if format == "text" else text)
        return
    try:
        Path(output).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise InputError(f"--output: cannot write {output!r}: {exc.strerror or exc}") from None
    print(f"wrote {output}", file=sys.stderr)


def write_stdout(text: str) -> None:
    """Write ``text`` to standard output and flush; a failure raises :class:`OutputError`.

    A closed pipe (``BrokenPipeError``, e.g. piped into ``head``) is let through unchanged.
    """
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise OutputError(
            f"cannot write to standard output: {exc.strerror or exc} (try --output FILE)"
        ) from None
