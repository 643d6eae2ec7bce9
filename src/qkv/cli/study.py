"""``qkv study scaling`` and ``qkv study training``: why attention divides by √d, measured.

Thin: parse, call :mod:`qkv.study`, render with :mod:`qkv.study.summary`. :func:`register` adds
the ``study`` command to the main parser's subparsers.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..checks import parse_int, parse_real
from ..errors import InputError
from ..study.summary import MODE_HELP
from .options import arg_type, write_stdout

__all__ = ["NAME", "register"]

NAME = "study"

SCALING_EXAMPLES = """examples:
  qkv study scaling --dims 4 64 1024 --keys 64 --format markdown
  qkv study scaling --output study-out        # CSV and PNG plots"""
TRAINING_EXAMPLES = """examples:
  qkv study training --d 1024 --steps 100
  qkv study training --d 256 --lr 0.5 --format json"""
EXAMPLES = SCALING_EXAMPLES + "\n" + TRAINING_EXAMPLES.removeprefix("examples:\n")


def _ints(text: str, name: str) -> list[int]:
    """``"4,64 1024"``: integers split by commas or spaces."""
    return [parse_int(p, name) for p in text.replace(",", " ").split()]


def register(subparsers: Any) -> None:
    """Add ``study scaling`` and ``study training`` to ``subparsers``."""
    study = subparsers.add_parser(
        NAME,
        help="measure why attention scales scores by 1/sqrt(d)",
        description=(
            "Measure why attention divides its scores by sqrt(d): what the softmax and its "
            "gradients do without that scaling, and with sqrt(d) multiplied instead."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = study.add_subparsers(dest="study_command", metavar="{scaling,training}")
    sub.required = True

    s = sub.add_parser(
        "scaling",
        help="Monte Carlo over d: score spread, saturation, entropy, gradients",
        description=(
            "Monte Carlo with q, k ~ N(0, I_d) for each d and each mode: " + MODE_HELP + ". "
            "Reports the score std against the sqrt(d) theory, mean max weight, entropy, "
            "softmax Jacobian norm and the gradient reaching q (qkv.attention_vjp); the text "
            "and Markdown tables end with a legend of the columns."
        ),
        epilog=SCALING_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument(
        "--dims",
        nargs="+",
        metavar="D",
        type=arg_type(_ints, "--dims"),
        help="feature sizes d, e.g. --dims 4 64 1024 or --dims 4,64,1024 (default 4 8 ... 4096)",
    )
    integer = {name: arg_type(parse_int, name) for name in ("--keys", "--samples", "--seed")}
    s.add_argument("--keys", default=64, type=integer["--keys"], help="keys per query (default 64)")
    s.add_argument(
        "--samples", default=1024, type=integer["--samples"], help="query rows per d (default 1024)"
    )
    s.add_argument("--seed", default=0, type=integer["--seed"], help="random seed (default 0)")
    s.add_argument(
        "--modes",
        default="scaled,unscaled,times_sqrt_d",
        help="comma-separated subset of: scaled, unscaled, times_sqrt_d (default all three)",
    )
    s.add_argument(
        "--panel-d",
        type=arg_type(parse_int, "--panel-d"),
        help="d of the weight-distribution panel",
    )
    _common(s)
    s.set_defaults(run=_scaling, command_name="study scaling")

    t = sub.add_parser(
        "training",
        help="train a retrieval task scaled vs unscaled with qkv's own gradients",
        description=(
            "Learn a query projection W so that query i attends key i (one-hot values, loss "
            "mean 1/2 |p - e|^2), by plain gradient descent on qkv.attention_vjp; once scaled "
            "and once unscaled, same seed, start and learning rate."
        ),
        epilog=TRAINING_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for name, default, text in (
        ("--d", 1024, "feature size d (default 1024)"),
        ("--keys", 64, "number of keys (default 64)"),
        ("--steps", 100, "gradient-descent steps (default 100)"),
    ):
        t.add_argument(name, default=default, type=arg_type(parse_int, name), help=text)
    t.add_argument(
        "--lr",
        default=1.0,
        type=arg_type(parse_real, "--lr"),
        help="learning rate for both runs (default 1.0)",
    )
    t.add_argument(
        "--seed", default=0, type=arg_type(parse_int, "--seed"), help="random seed (default 0)"
    )
    _common(t)
    t.set_defaults(run=_training, command_name="study training")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--format",
        default="text",
        choices=("text", "markdown", "csv", "json"),
        help="output format on stdout (default text)",
    )
    p.add_argument("--output", metavar="DIR", help="also write CSV and PNG plots into DIR")
    p.add_argument("--no-progress", action="store_true", help="never show a progress bar")


@contextmanager
def _progress(total: int, enabled: bool, desc: str) -> Iterator[Callable[[int], None] | None]:
    """A tqdm bar on stderr that appears only if the run takes more than a moment."""
    if not enabled:
        yield None
        return
    try:
        from tqdm import tqdm
    except ImportError:  # the progress extra is optional
        yield None
        return
    bar = tqdm(total=total, desc=desc, delay=0.5, file=sys.stderr, leave=False, disable=None)
    try:
        yield bar.update
    finally:
        bar.close()


def _output_dir(path: str | None) -> Path | None:
    """``--output``: a directory, created if missing."""
    if path is None:
        return None
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise InputError(f"--output: {path} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"--output: cannot create directory {path}: {exc.strerror}") from None
    return out


def _save(save: Callable[[Any, Path], list[Path]], result: Any, out: Path | None) -> None:
    if out is None:
        return
    try:
        written = save(result, out)
    except OSError as exc:
        raise InputError(f"--output: cannot write into {out}: {exc.strerror or exc}") from None
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)


def _emit(text: str) -> None:
    write_stdout(text if text.endswith("\n") else text + "\n")


def _scaling(args: argparse.Namespace) -> int:
    from ..study import scaling, summary

    dims = scaling.DEFAULT_DIMS if args.dims is None else [d for ds in args.dims for d in ds]
    out = _output_dir(args.output)
    total = scaling.total_work(dims, max(args.samples, 1))
    with _progress(total, not args.no_progress, "qkv study scaling") as bar:
        study = scaling.scaling_study(
            dims,
            keys=args.keys,
            samples=args.samples,
            seed=args.seed,
            modes=[m.strip() for m in args.modes.split(",") if m.strip()],
            panel_d=args.panel_d,
            progress=bar,
        )
    _save(summary.save_scaling, study, out)
    _emit(summary.scaling_report(study, args.format))
    return 0


def _training(args: argparse.Namespace) -> int:
    from ..study import summary
    from ..study.training import training_study

    out = _output_dir(args.output)
    with _progress(2 * max(args.steps, 0), not args.no_progress, "qkv study training") as bar:
        runs = training_study(
            d=args.d, keys=args.keys, steps=args.steps, lr=args.lr, seed=args.seed, progress=bar
        )
    _save(summary.save_training, runs, out)
    _emit(summary.training_report(runs, args.format))
    return 0
