"""PNG plots of the scaling and training studies (matplotlib, the ``plot`` extra).

matplotlib is imported only here and only when a plot is made; figures are drawn on the Agg
canvas directly, so no global backend is switched and no window opens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..extras import require
from .scaling import MODES, ScalingStudy
from .training import TrainingRun

__all__ = ["plot_scaling", "plot_training"]

COLORS = {"scaled": "#1b7837", "unscaled": "#c51b7d", "times_sqrt_d": "#2166ac"}
LABELS = {"scaled": "scaled  (÷√d)", "unscaled": "unscaled (×1)", "times_sqrt_d": "×√d (a slip)"}


def _figure(ncols: int, width: float = 4.2, height: float = 3.4) -> tuple[Any, Any]:
    what = "the study's plots (leave out --output to skip them)"
    FigureCanvasAgg = require("matplotlib.backends.backend_agg", what).FigureCanvasAgg
    Figure = require("matplotlib.figure", what).Figure
    fig = Figure(figsize=(width * ncols, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, axes


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, format="png")
    return path


def _series(study: ScalingStudy, mode: str, key: str) -> tuple[np.ndarray, np.ndarray]:
    rows = [r for r in study.rows if r.mode == mode]
    return np.array([r.d for r in rows]), np.array([getattr(r, key) for r in rows], dtype=float)


def _modes(study: ScalingStudy) -> list[str]:
    present = {r.mode for r in study.rows}
    return [m for m in MODES if m in present]


def _log2_x(ax: Any) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xlabel("d (feature size)")
    ax.grid(True, which="major", alpha=0.3)


def plot_scaling(study: ScalingStudy, outdir: str | Path) -> list[Path]:
    """Write ``scaling_saturation.png``, ``scaling_gradients.png`` and ``scaling_weights.png``.

    Returns the paths written. The gradient plots are on a log scale cut at ``1e-10``; zeros (a
    gradient that underflowed to exactly 0) and smaller values run off the bottom.
    """
    out = Path(outdir)
    keys = study.rows[0].keys
    modes = _modes(study)
    paths = []

    fig, (ax_e, ax_m) = _figure(2)
    panels = ((ax_e, "entropy", "entropy_se"), (ax_m, "mean_max_weight", "max_weight_se"))
    for m in modes:
        for ax, key, se_key in panels:
            d, y = _series(study, m, key)
            _, se = _series(study, m, se_key)
            ax.errorbar(
                d,
                y,
                yerr=np.nan_to_num(se),
                color=COLORS[m],
                marker="o",
                ms=3,
                label=LABELS[m],
                capsize=2,
            )
    ax_e.axhline(math.log(keys), color="grey", ls=":", label=f"uniform: log {keys}")
    ax_e.set_ylabel("mean entropy of the weights (nats)")
    ax_e.set_title(f"Entropy, {keys} keys")
    ax_m.axhline(1 / keys, color="grey", ls=":", label=f"uniform: 1/{keys}")
    ax_m.set_ylabel("mean largest weight")
    ax_m.set_ylim(0, 1.02)
    ax_m.set_title("Saturation towards one-hot")
    for ax in (ax_e, ax_m):
        _log2_x(ax)
        ax.legend(fontsize=8)
    paths.append(_save(fig, out / "scaling_saturation.png"))

    fig, (ax_j, ax_g) = _figure(2)
    for m in modes:
        for key, ax in (("jacobian", ax_j), ("grad_q", ax_g)):
            d, mean = _series(study, m, f"{key}_norm")
            _, med = _series(study, m, f"{key}_median")
            ax.plot(
                d,
                np.where(mean > 0, mean, np.nan),
                color=COLORS[m],
                marker="o",
                ms=3,
                label=f"{LABELS[m]} mean",
            )
            ax.plot(
                d,
                np.where(med > 0, med, np.nan),
                color=COLORS[m],
                ls="--",
                marker="x",
                ms=4,
                label=f"{LABELS[m]} median",
            )
    floor = 1e-10
    ax_j.set_ylabel("‖diag(p) − p pᵀ‖_F")
    ax_j.set_title("Softmax Jacobian (solid: mean, dashed: median)", fontsize=10)
    ax_g.set_ylabel("‖∂loss/∂q‖  (qkv.attention_vjp)")
    ax_g.set_title("Gradient reaching q (solid: mean, dashed: median)", fontsize=10)
    for ax in (ax_j, ax_g):
        _log2_x(ax)
        ax.set_yscale("log")
        ax.set_ylim(bottom=floor)
        ax.legend(fontsize=7, loc="lower left")

    paths.append(_save(fig, out / "scaling_gradients.png"))

    fig, axes = _figure(len(modes), width=3.4)
    rank = np.arange(1, keys + 1)
    for ax, m in zip(axes, modes, strict=True):
        prof = study.profiles[m]
        floor = 1e-12
        ax.fill_between(
            rank,
            np.maximum(prof["q10"], floor),
            np.maximum(prof["q90"], floor),
            color=COLORS[m],
            alpha=0.25,
            label="10–90 %",
        )
        ax.plot(rank, np.maximum(prof["mean"], floor), color=COLORS[m], marker=".", label="mean")
        ax.axhline(1 / keys, color="grey", ls=":", label=f"1/{keys}")
        ax.set_yscale("log")
        ax.set_ylim(floor, 1.5)
        ax.set_xlabel("rank of the key (largest weight first)")
        ax.set_title(f"{LABELS[m]}, d = {study.panel_d}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    axes[0].set_ylabel("attention weight")
    paths.append(_save(fig, out / "scaling_weights.png"))
    return paths


def plot_training(runs: Sequence[TrainingRun], outdir: str | Path) -> Path:
    """Write ``training_loss.png``: loss, accuracy and gradient norm against step for each run."""
    fig, (ax_l, ax_a, ax_g) = _figure(3, width=3.8)
    for r in runs:
        color = COLORS.get(r.mode, None)
        steps = np.arange(len(r.loss))
        label = LABELS.get(r.mode, r.mode)
        ax_l.plot(steps, r.loss, color=color, label=label)
        ax_a.plot(steps, r.accuracy, color=color, label=label)
        g = np.asarray(r.grad_norm, dtype=float)
        ax_g.plot(steps, np.where(g > 0, g, np.nan), color=color, label=label)
    first = runs[0]
    fig.suptitle(f"Retrieval: d = {first.d}, {first.keys} keys, lr = {first.lr:g}, same seed")
    ax_l.set_ylabel("loss  (mean ½‖p − e‖²)")
    ax_a.set_ylabel("accuracy (top weight on the right key)")
    ax_a.set_ylim(-0.02, 1.02)
    ax_g.set_yscale("log")
    ax_g.set_ylabel("‖∂loss/∂W‖ (via qkv.attention_vjp)")
    for ax in (ax_l, ax_a, ax_g):
        ax.set_xlabel("gradient-descent step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, Path(outdir) / "training_loss.png")
