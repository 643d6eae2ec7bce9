"""``qkv explore``: a page that switches between the three readings of the scale."""

from __future__ import annotations

import argparse
from typing import Any

from ..checks import parse_int
from ..errors import InputError
from ..explanation.trace import explain
from ..render.explore import explore_page
from .options import add_command, add_inputs, arg_type, emit, trace_kwargs

NAME = "explore"
HELP = "an HTML page: divide by √d, multiply by √d, or no scale, side by side"
EPILOG = """examples:
  qkv explore --q "2,1" --k "1,0;3,2" --v "1,2;3,4" --d 4 --output explore.html
  qkv explore --q "1,0;0,1;2,1" --k "1,0;3,2;0,1" --v "1,2;3,4;5,6" --d 4 --causal --output c.html

The page is self-contained (it loads nothing); every number on it is qkv's, embedded when the
page is written. --row picks the query row shown key by key (default: the last)."""


def register(sub: Any) -> None:
    p = add_command(sub, NAME, HELP, EPILOG)
    add_inputs(p, values=True, masks=True)
    p.add_argument(
        "--row",
        metavar="I",
        type=arg_type(parse_int, "--row", minimum=0),
        help="the query row shown key by key (default: last)",
    )
    p.add_argument("--output", metavar="FILE", help="write to FILE instead of standard output")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    kw = trace_kwargs(args)
    if kw.pop("exact"):
        raise InputError("--exact: the explore page shows numbers; use qkv explain --exact")
    trace = explain(**kw)
    if args.row is not None and args.row >= trace.L:
        raise InputError(f"--row: expected 0 to {trace.L - 1} (one per query row), got {args.row}")
    emit(explore_page(trace, row=args.row), args.output, "html")
    return 0
