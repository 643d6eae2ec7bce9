"""``qkv study scaling`` and ``qkv study training``: why attention divides by √d, measured.

Thin: parse, call :mod:`qkv.study`, render. :func:`register` adds the ``study`` command to the
main parser's subparsers; each leaf sets ``run=handler(args) -> int`` (0 on success, 2 on bad
input with one line on stderr).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import InputError

__all__ = ["NAME", "register"]

NAME = "study"

SCALING_EXAMPLES = """examples:
  qkv study scaling --dims 4 64 1024 --keys 64 --format markdown
  qkv study scaling --output study-out        # CSV and PNG plots"""
TRAINING_EXAMPLES = """examples:
  qkv study training --d 1024 --steps 100
  qkv study training --d 256 --lr 0.5 --format json"""
EXAMPLES = SCALING_EXAMPLES + "\n" + TRAINING_EXAMPLES.removeprefix("examples:\n")

MODE_HELP = (
    "scaled (scores divided by sqrt(d), standard), unscaled (not scaled at all) and "
    "times_sqrt_d (multiplied by sqrt(d) instead of divided, a common slip)"
)

#: What each column of the tables means (printed under text and Markdown tables).
SCALING_LEGEND = {
    "d": "feature size of q and k",
    "mode": MODE_HELP,
    "score_std": "measured standard deviation of the scores that reach the softmax",
    "score_std_theory": "the same in theory: scale * sqrt(d)",
    "mean_max_weight": "mean largest attention weight of a row (1 = one-hot, saturated)",
    "entropy": "mean entropy of a row's weights, in nats (0 = one-hot)",
    "entropy_fraction": "entropy as a fraction of its maximum, log(keys)",
    "jacobian_norm": "mean Frobenius norm of the softmax Jacobian (0 = no gradient flows)",
    "grad_q_norm": "mean norm of the gradient reaching q through attention",
    "grad_q_median": "median of that norm (robust to a few large rows)",
}
TRAINING_LEGEND = {
    "mode": "scaled (divides scores by sqrt(d)) or unscaled",
    "loss_N": "mean 1/2 |weights - target|^2 after N steps (0 = every query on its own key)",
    "accuracy_N": "fraction of queries whose largest weight is on their own key, after N steps",
    "steps_to_100%": "first step at which every query attends its own key",
    "grad_norm_N": "norm of the gradient of the loss with respect to W at step N",
}

SCALING_COLUMNS = [
    "d",
    "mode",
    "score_std",
    "score_std_theory",
    "mean_max_weight",
    "entropy",
    "entropy_fraction",
    "jacobian_norm",
    "grad_q_norm",
    "grad_q_median",
]


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
        help="feature sizes d, e.g. --dims 4 64 1024 or --dims 4,64,1024 (default 4 8 ... 4096)",
    )
    s.add_argument("--keys", default="64", help="keys per query (default 64)")
    s.add_argument("--samples", default="1024", help="query rows per d (default 1024)")
    s.add_argument("--seed", default="0", help="random seed (default 0)")
    s.add_argument(
        "--modes",
        default="scaled,unscaled,times_sqrt_d",
        help="comma-separated subset of: scaled, unscaled, times_sqrt_d (default all three)",
    )
    s.add_argument("--panel-d", default=None, help="d of the weight-distribution panel")
    _common(s)
    s.set_defaults(run=_scaling)

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
    t.add_argument("--d", default="1024", help="feature size d (default 1024)")
    t.add_argument("--keys", default="64", help="number of keys (default 64)")
    t.add_argument("--steps", default="100", help="gradient-descent steps (default 100)")
    t.add_argument("--lr", default="1.0", help="learning rate for both runs (default 1.0)")
    t.add_argument("--seed", default="0", help="random seed (default 0)")
    _common(t)
    t.set_defaults(run=_training)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--format",
        default="text",
        choices=("text", "markdown", "csv", "json"),
        help="output format on stdout (default text)",
    )
    p.add_argument("--output", metavar="DIR", help="also write CSV and PNG plots into DIR")
    p.add_argument("--no-progress", action="store_true", help="never show a progress bar")


def _int(text: Any, name: str) -> int:
    try:
        return int(str(text).strip())
    except ValueError:
        raise InputError(f"{name}: expected an integer, got {text!r}") from None


def _float(text: Any, name: str) -> float:
    try:
        return float(str(text).strip())
    except ValueError:
        raise InputError(f"{name}: expected a number, got {text!r}") from None


def _dims(items: list[str] | None) -> list[int] | None:
    if items is None:
        return None
    parts = [p for item in items for p in item.replace(",", " ").split()]
    return [_int(p, "--dims") for p in parts]


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


def _emit(text: str) -> None:
    """Print ``text`` on stdout, ending in exactly one newline."""
    from .options import write_stdout

    write_stdout(text if text.endswith("\n") else text + "\n")


def _legend(legend: dict[str, str], fmt: str) -> str:
    """What the columns mean, under a text or Markdown table (CSV and JSON stay data only)."""
    if fmt not in ("text", "markdown"):
        return ""
    bullet = "- " if fmt == "markdown" else "  "
    name = (lambda c: f"`{c}`") if fmt == "markdown" else (lambda c: c)
    lines = [f"{bullet}{name(c)}: {text}" for c, text in legend.items()]
    return "\n\ncolumns:\n" + ("\n" if fmt == "markdown" else "") + "\n".join(lines)


def _fail(args: argparse.Namespace, exc: Exception) -> int:
    print(f"qkv study {args.study_command}: error: {exc}", file=sys.stderr)
    return 2


def _prepare_output(path: str | None) -> Path | None:
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


def _scaling(args: argparse.Namespace) -> int:
    from ..study import scaling
    from ..study.table import render_rows, write_csv

    try:
        dims = _dims(args.dims)
        kw = dict(
            dims=scaling.DEFAULT_DIMS if dims is None else dims,
            keys=_int(args.keys, "--keys"),
            samples=_int(args.samples, "--samples"),
            seed=_int(args.seed, "--seed"),
            modes=[m.strip() for m in args.modes.split(",") if m.strip()],
            panel_d=None if args.panel_d is None else _int(args.panel_d, "--panel-d"),
        )
        out = _prepare_output(args.output)
        total = scaling.total_work(kw["dims"], max(kw["samples"], 1))
        with _progress(total, not args.no_progress, "qkv study scaling") as bar:
            study = scaling.scaling_study(**kw, progress=bar)
        rows = [r.as_dict() for r in study.rows]
        if out is not None:
            write_csv(out / "scaling.csv", rows)
            from ..study.plots import plot_scaling

            written = [out / "scaling.csv", *plot_scaling(study, out)]
            print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
        _emit(
            render_rows(rows, args.format, columns=SCALING_COLUMNS)
            + _legend(SCALING_LEGEND, args.format)
        )
    except (InputError, OSError) as exc:
        return _fail(args, exc)
    return 0


def _training(args: argparse.Namespace) -> int:
    from ..study.table import render_rows, write_csv
    from ..study.training import training_study

    try:
        kw = dict(
            d=_int(args.d, "--d"),
            keys=_int(args.keys, "--keys"),
            steps=_int(args.steps, "--steps"),
            lr=_float(args.lr, "--lr"),
            seed=_int(args.seed, "--seed"),
        )
        out = _prepare_output(args.output)
        with _progress(2 * max(kw["steps"], 0), not args.no_progress, "qkv study training") as bar:
            runs = training_study(**kw, progress=bar)
        per_step = [
            dict(mode=r.mode, step=i, loss=loss, accuracy=acc, grad_norm=g)
            for r in runs
            for i, (loss, acc, g) in enumerate(zip(r.loss, r.accuracy, r.grad_norm, strict=True))
        ]
        if out is not None:
            write_csv(out / "training.csv", per_step)
            from ..study.plots import plot_training

            written = [out / "training.csv", plot_training(runs, out)]
            print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
        if args.format == "json":
            _emit(render_rows([r.as_dict() for r in runs], "json", key="runs"))
        elif args.format == "csv":
            _emit(render_rows(per_step, "csv"))
        else:
            _emit(render_rows(_summary(runs), args.format) + _legend(TRAINING_LEGEND, args.format))
    except (InputError, OSError) as exc:
        return _fail(args, exc)
    return 0


def _summary(runs: list[Any]) -> list[dict[str, Any]]:
    rows = []
    for r in runs:
        n = len(r.loss) - 1
        mid = n // 2
        reached = r.steps_to(1.0)
        rows.append(
            {
                "mode": r.mode,
                "d": r.d,
                "keys": r.keys,
                "lr": r.lr,
                "loss_0": r.loss[0],
                f"loss_{mid}": r.loss[mid],
                f"loss_{n}": r.loss[n],
                f"accuracy_{n}": r.accuracy[n],
                "steps_to_100%": "never" if reached is None else str(reached),
                "grad_norm_0": r.grad_norm[0],
                f"grad_norm_{n}": r.grad_norm[n],
            }
        )
    return rows
