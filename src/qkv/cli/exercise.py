"""``qkv exercise``: a practice problem with small integers, with its worked solution."""

from __future__ import annotations

import argparse
from typing import Any

from ..checks import parse_int
from ..errors import InputError
from ..explanation.exercise import LIMIT, make_exercise
from .options import add_command, add_format, arg_type, emit, write_stdout

NAME = "exercise"
HELP = "a practice problem with small integers (same seed, same problem)"
EPILOG = f"""examples:
  qkv exercise --seed 7
  qkv exercise --seed 7 --answers
  qkv exercise --seed 3 --queries 3 --keys 3 --causal --answers --format html --output ex.html
  qkv exercise --seed 7 --practice                  # asks for each step and checks your answer
  qkv exercise --seed 7 --practice --answers my-answers.txt   # one answer per line ("-": stdin)

In --practice mode each answer is a list of numbers ("1, 4" or "1 4"; rows of several queries
split by ";"); a wrong one is checked against the common slips (forgot to scale, multiplied by
√d, used len(q) for d, forgot to subtract the max, summed the wrong axis) before the worked step.

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
    emit(ex.render(args.format, answers=args.answers, exact=args.exact), args.output)
    return 0


def _answer(line: str, name: str) -> Any:
    from .parse import matrix

    if line.strip().startswith("@"):
        raise InputError(f"{name}: type the numbers themselves")
    return matrix(line, name)


def _practice(ex: Any, answers: bool | str) -> int:
    """Ask for each step, read one answer per line, say right or which slip, show the step."""
    import sys

    from ..explanation.practice import Practice

    source = sys.stdin
    if isinstance(answers, str) and answers != "-":
        try:
            source = open(answers, encoding="utf-8")  # noqa: SIM115 - closed below
        except OSError as exc:
            raise InputError(f"--answers: cannot read {answers!r}: {exc.strerror}") from None
    interactive = source is sys.stdin and sys.stdin.isatty()
    practice = Practice(ex)
    say = write_stdout
    say(ex.render("text", hint=False))
    right = 0
    try:
        for n, step in enumerate(practice.steps, 1):
            say(f"\nStep {n} of {len(practice.steps)}: {step.prompt}\n> ")
            line = source.readline()
            if not line:
                say("(no answer)\n")
                say("\n".join("  " + w for w in step.worked) + "\n")
                continue
            if not interactive:
                say(line.rstrip("\n") + "\n")
            try:
                fb = practice.check(step.key, _answer(line, f"step {n}"))
            except InputError as exc:
                say(f"could not read that answer ({exc})\n")
                fb = None
            if fb is not None and fb.correct:
                right += 1
                say("right\n")
                continue
            if fb is not None:
                label = f"slip: {fb.slip} — " if fb.slip else ""
                say(f"{label}{fb.message}\n")
            say("worked step:\n" + "\n".join("  " + w for w in step.worked) + "\n")
    finally:
        if source is not sys.stdin:
            source.close()
    say(f"\n{right} of {len(practice.steps)} steps right.\n")
    return 0
