"""``qkv exercise``: a practice problem with small integers, with its worked solution."""

from __future__ import annotations

import argparse
import re
from typing import Any

from ..errors import InputError
from ..exercise import LIMIT, make_exercise
from .options import add_format, emit

NAME = "exercise"
HELP = "a practice problem with small integers (same seed, same problem)"
EPILOG = f"""examples:
  qkv exercise --seed 7
  qkv exercise --seed 7 --answers
  qkv exercise --seed 3 --queries 3 --keys 3 --causal --answers --format html --output ex.html

--queries, --keys and --dim go from 1 to {LIMIT}. The scale uses a d that is a perfect square."""


def _int(text: str, name: str, lo: int, hi: int | None) -> int:
    if (
        not re.fullmatch(r"\s*\d+\s*", text)
        or int(text) < lo
        or (hi is not None and int(text) > hi)
    ):
        top = f" to {hi}" if hi is not None else " or more"
        raise InputError(f"{name}: expected an integer from {lo}{top}, got {text!r}")
    return int(text)


def register(sub: Any) -> None:
    p = sub.add_parser(
        NAME,
        help=HELP,
        description=HELP,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--seed", metavar="N", help="the problem's number (default: a random one, shown)"
    )
    p.add_argument("--queries", metavar="L", default="1", help="number of query rows (1)")
    p.add_argument("--keys", metavar="S", default="3", help="number of keys (3)")
    p.add_argument("--dim", metavar="d", default="2", help="size of each vector (2)")
    p.add_argument("--causal", action="store_true", help="ask for causal attention")
    p.add_argument("--answers", action="store_true", help="include the worked solution")
    p.add_argument("--exact", action="store_true", help="exact values in the solution (SymPy)")
    add_format(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    ex = make_exercise(
        None if args.seed is None else _int(args.seed, "--seed", 0, None),
        queries=_int(args.queries, "--queries", 1, LIMIT),
        keys=_int(args.keys, "--keys", 1, LIMIT),
        dim=_int(args.dim, "--dim", 1, LIMIT),
        causal=args.causal,
    )
    emit(ex.render(args.format, answers=args.answers, exact=args.exact), args.output)
    return 0
