"""Why attention divides by ``√d``, measured: what happens to softmax attention without it.

- :mod:`qkv.study.scaling` — Monte Carlo over ``d``: score spread, saturation, entropy, softmax
  Jacobian and the gradient reaching ``q``, for scaled (÷√d), unscaled (×1) and ×√d scores
  (multiplying instead of dividing, a common slip).
- :mod:`qkv.study.training` — a small retrieval task trained by gradient descent on
  :func:`qkv.attention_vjp`, scaled against unscaled.
- :mod:`qkv.study.table` and :mod:`qkv.study.plots` — text/Markdown/CSV/JSON tables and PNG plots
  (matplotlib, imported only when plotting).
"""

from __future__ import annotations

from .scaling import MODES, ScalingRow, ScalingStudy, scaling_study
from .training import TrainingRun, training_study

__all__ = [
    "MODES",
    "ScalingRow",
    "ScalingStudy",
    "TrainingRun",
    "scaling_study",
    "training_study",
]
