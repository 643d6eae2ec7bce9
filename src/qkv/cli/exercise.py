"""``qkv exercise``: a practice problem with small integers, with its worked solution."""

from __future__ import annotations

import argparse
from typing import Any

from ..checks import parse_int
from ..errors import InputError
from ..explanation.exercise import LIMIT, make_exercise
from .options import add_command, add_format, arg_type, emit, write_stdout
from .terminal import plain_rules

NAME = "exercise"
HELP = "a practice problem with small integers (same seed, same problem)"
EPILOG = f"""examples:
  qkv exercise --seed 7
  qkv exercise --seed 7 --answers
  qkv exercise --seed 3 --queries 3 --keys 3 --causal --answers --format html --output ex.html
  qkv exercise --seed 7 --practice                  # asks for each step and checks your answer
  qkv exercise --seed 7 --practice --answers my-answers.txt   # one answer per line ("-": stdin)

In --practice mode each answer is a list of numbers ("1, 4" or "1 4"; rows of several queries
split by ";"), each a decimal, a fraction or a small expression ("9/2", "exp(-1.5)", "e^3").
You get two tries per step; an answer that cannot be read is asked again without using one. A
wrong answer is checked against the common slips (forgot to scale, multiplied by √d, used
len(q) for d, forgot to subtract the max, summed the wrong axis); after the second miss the
worked step is shown. End of input (Ctrl-D) ends the session with its summary.

--queries, --keys and --dim go from 1 to {LIMIT}. The scale uses a d that is a perfect square."""


def register(sub: Any) -> None:
    p = add_command(sub, NAME, HELP, EPILOG)
    p.add_argument(
        "--seed",
        metavar="N",
        type=arg_type(parse_int, "--seed", minimum=0),
        help="the problem's number (default: a random one, shown)",
    )
    for name, meta, default, text in (
        ("--queries", "L", 1, "number of query rows (1)"),
        ("--keys", "S", 3, "number of keys (3)"),
        ("--dim", "d", 2, "size of each vector (2)"),
    ):
        size = arg_type(parse_int, name, minimum=1, maximum=LIMIT)
        p.add_argument(name, metavar=meta, default=default, type=size, help=text)
    p.add_argument("--causal", action="store_true", help="ask for causal attention")
    p.add_argument(
        "--answers",
        nargs="?",
        const=True,
        default=False,
        metavar="FILE",
        help="include the worked solution; with --practice, FILE holds your answers ('-': stdin)",
    )
    p.add_argument(
        "--practice", action="store_true", help="ask for each step and check the answers"
    )
    p.add_argument("--exact", action="store_true", help="exact values in the solution (SymPy)")
    add_format(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if isinstance(args.answers, str) and not args.practice:
        raise InputError("--answers FILE: answers from a file need --practice")
    ex = make_exercise(
        args.seed,
        queries=args.queries,
        keys=args.keys,
        dim=args.dim,
        causal=args.causal,
    )
    if args.practice:
        if args.format != "text" or args.output is not None:
            raise InputError("--practice: a conversation on the terminal; no --format or --output")
        return _practice(ex, args.answers)
    page = ex.render(args.format, answers=args.answers, exact=args.exact)
    emit(page, args.output, args.format)
    return 0


def _practice(ex: Any, answers: bool | str) -> int:
    """A practice session on the terminal: the library asks and checks, this reads and writes."""
    import sys

    from ..explanation.practice import HOW_TO_ANSWER, Practice, run_session

    source = sys.stdin
    if isinstance(answers, str) and answers != "-":
        try:
            source = open(answers, encoding="utf-8")  # noqa: SIM115 - closed below
        except OSError as exc:
            raise InputError(f"--answers: cannot read {answers!r}: {exc.strerror}") from None
    interactive = source is sys.stdin and sys.stdin.isatty()

    def say(text: str) -> None:
        write_stdout(plain_rules(text))

    def ask(prompt: str) -> str | None:
        say(prompt)
        try:
            line = source.readline()
        except UnicodeDecodeError:
            line = "\ufffd\n"  # unreadable bytes: asked again, like any unreadable answer
        if not line:  # end of input (Ctrl-D)
            return None
        if not interactive:  # a file or a pipe: show the answer, as a terminal would
            say(line.rstrip("\n") + "\n")
        return line

    say(ex.render("text", hint=False))
    say("\n" + HOW_TO_ANSWER + "\n")
    try:
        summary = run_session(Practice(ex), ask, say)
    finally:
        if source is not sys.stdin:
            source.close()
    say("\n" + summary.text() + "\n")
    return 0
