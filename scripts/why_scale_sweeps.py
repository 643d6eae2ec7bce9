"""Print the sweeps behind docs/why-scale.md: where the missing 1/sqrt(d) starts to bite.

Run from the repository root (about a minute, single-threaded BLAS is fastest on a busy box):

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=src python scripts/why_scale_sweeps.py

1. Saturation over d for several key counts: the first d at which the unscaled softmax is
   more than half one-hot (mean largest weight > 0.5), has lost half its entropy, and at which
   the typical (median) gradient reaching q has fallen below 1/10 and 1/1000 of the scaled one.
2. Training: the retrieval task for several d, each mode at its best learning rate of a grid
   (so that the scaled and unscaled runs are compared fairly), and at d = 1024 the full grid.
"""

from __future__ import annotations

import argparse

from qkv.study import scaling_study, training_study
from qkv.study.table import render_rows

DIMS = [2**i for i in range(1, 13)]


def first_d(rows: list, test) -> str:
    for r in rows:
        if test(r):
            return str(r[0])
    return f"> {DIMS[-1]}"


def saturation(samples: int) -> None:
    out = []
    for keys in (2, 8, 64, 512):
        s = scaling_study(
            dims=DIMS, keys=keys, samples=samples, seed=0, modes=["scaled", "unscaled"]
        )
        pairs = [(d, s.row(d, "scaled"), s.row(d, "unscaled")) for d in DIMS]
        out.append(
            {
                "keys": keys,
                "max weight > 0.5": first_d(pairs, lambda r: r[2].mean_max_weight > 0.5),
                "entropy < half of scaled": first_d(
                    pairs, lambda r: r[2].entropy < 0.5 * r[1].entropy
                ),
                "median grad_q < scaled/10": first_d(
                    pairs, lambda r: r[2].grad_q_median < 0.1 * r[1].grad_q_median
                ),
                "median grad_q < scaled/1000": first_d(
                    pairs, lambda r: r[2].grad_q_median < 1e-3 * r[1].grad_q_median
                ),
            }
        )
    print(render_rows(out, "markdown"))


def training(steps: int) -> None:
    grid = [1e-4, 1e-3, 0.01, 0.1, 1.0, 10.0, 100.0]
    best = []
    for d in (16, 64, 256, 1024):
        runs = {lr: training_study(d=d, keys=64, steps=steps, lr=lr, seed=0) for lr in grid}
        row: dict = {"d": d}
        for i, mode in enumerate(("scaled", "unscaled")):
            lr, r = min(((lr, rs[i]) for lr, rs in runs.items()), key=lambda t: t[1].loss[-1])
            row[f"{mode} best lr"] = lr
            row[f"{mode} loss"] = round(r.loss[-1], 4)
            row[f"{mode} accuracy"] = r.accuracy[-1]
        best.append(row)
        if d == 1024:
            full = [
                {
                    "lr": lr,
                    "scaled loss": round(rs[0].loss[-1], 4),
                    "scaled acc": rs[0].accuracy[-1],
                    "scaled steps to 100%": rs[0].steps_to(1.0) or "never",
                    "unscaled loss": round(rs[1].loss[-1], 4),
                    "unscaled acc": rs[1].accuracy[-1],
                }
                for lr, rs in runs.items()
            ]
    print(render_rows(best, "markdown"))
    print()
    print(render_rows(full, "markdown"))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=100)
    a = ap.parse_args()
    saturation(a.samples)
    print()
    training(a.steps)
