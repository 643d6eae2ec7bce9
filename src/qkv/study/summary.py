"""What the studies report: their tables in every format, with a legend, and their output files.

:func:`scaling_report` and :func:`training_report` turn a study's result into the text the
``qkv study`` command prints (text and Markdown tables end with a legend of the columns; CSV and
JSON are data only); :func:`save_scaling` and :func:`save_training` write the CSV and PNG files.

Examples
--------
>>> from qkv.study import training_study
>>> runs = training_study(d=16, keys=4, steps=4, lr=1.0)
>>> [(r["mode"], r["steps_to_100%"]) for r in training_summary(runs)][:1]
[('scaled', '4')]
>>> print(training_report(runs, "csv").splitlines()[0])
mode,step,loss,accuracy,grad_norm
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .scaling import ScalingStudy
from .table import legend_text, render_rows, write_csv
from .training import TrainingRun

__all__ = [
    "MODE_HELP",
    "SCALING_COLUMNS",
    "SCALING_LEGEND",
    "TRAINING_LEGEND",
    "save_scaling",
    "save_training",
    "scaling_report",
    "training_report",
    "training_steps",
    "training_summary",
]

MODE_HELP = (
    "scaled (scores divided by sqrt(d), standard), unscaled (not scaled at all) and "
    "times_sqrt_d (multiplied by sqrt(d) instead of divided, a common slip)"
)

#: What each column of the scaling table means (its keys are the table's columns, in order).
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
SCALING_COLUMNS = list(SCALING_LEGEND)

#: What each column of the training summary means (N: a step number).
TRAINING_LEGEND = {
    "mode": "scaled (divides scores by sqrt(d)) or unscaled",
    "loss_N": "mean 1/2 |weights - target|^2 after N steps (0 = every query on its own key)",
    "accuracy_N": "fraction of queries whose largest weight is on their own key, after N steps",
    "steps_to_100%": "first step at which every query attends its own key",
    "grad_norm_N": "norm of the gradient of the loss with respect to W at step N",
}


def scaling_report(study: ScalingStudy, fmt: str) -> str:
    """The scaling study's rows in ``fmt`` (text, markdown, csv or json)."""
    rows = [r.as_dict() for r in study.rows]
    return render_rows(rows, fmt, columns=SCALING_COLUMNS) + legend_text(SCALING_LEGEND, fmt)


def training_steps(runs: Sequence[TrainingRun]) -> list[dict[str, Any]]:
    """One row per run and step: mode, step, loss, accuracy and gradient norm."""
    return [
        dict(mode=r.mode, step=i, loss=loss, accuracy=acc, grad_norm=g)
        for r in runs
        for i, (loss, acc, g) in enumerate(zip(r.loss, r.accuracy, r.grad_norm, strict=True))
    ]


def training_summary(runs: Sequence[TrainingRun]) -> list[dict[str, Any]]:
    """One row per run: the loss at the start, half-way and the end, accuracy, gradient norms."""
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


def training_report(runs: Sequence[TrainingRun], fmt: str) -> str:
    """JSON: every run in full; CSV: every step; text and Markdown: the summary and a legend."""
    if fmt == "json":
        return render_rows([r.as_dict() for r in runs], "json", key="runs")
    if fmt == "csv":
        return render_rows(training_steps(runs), "csv")
    return render_rows(training_summary(runs), fmt) + legend_text(TRAINING_LEGEND, fmt)


def save_scaling(study: ScalingStudy, directory: Path) -> list[Path]:
    """Write ``scaling.csv`` and the PNG plots into ``directory``; returns the paths."""
    from .plots import plot_scaling

    write_csv(directory / "scaling.csv", [r.as_dict() for r in study.rows])
    return [directory / "scaling.csv", *plot_scaling(study, directory)]


def save_training(runs: Sequence[TrainingRun], directory: Path) -> list[Path]:
    """Write ``training.csv`` (every step) and the loss plot into ``directory``."""
    from .plots import plot_training

    write_csv(directory / "training.csv", training_steps(runs))
    return [directory / "training.csv", plot_training(runs, directory)]
