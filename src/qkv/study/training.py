"""A small learning problem that needs attention to pick the right key, trained on qkv's gradients.

Retrieval: ``keys`` random keys ``k_i ~ N(0, I_d)`` with one-hot values ``v_i = e_i``, and for
each key a random query input ``x_i ~ N(0, I_d)``. The model learns a query projection ``W``
(``d × d``, initialised ``N(0, 1/d)`` so that ``q = W x`` starts like the ``N(0, I_d)`` queries
of the scaling study) so that ``q_i = W x_i`` attends ``k_i``. Because the values are one-hot,
the attention output of query ``i`` *is* its weight row ``p_i``, and the loss is the mean over
queries of ``½‖p_i − e_i‖²``, whose gradient flows back through the softmax Jacobian exactly as
in a transformer layer (a cross-entropy on the logits would bypass the Jacobian and hide the
effect under study).

Both modes start from the same ``W`` and use the same learning rate and number of steps of plain
gradient descent; the only difference is the score scale (``1/√d`` or 1). ``∂loss/∂q`` comes from
:func:`qkv.attention_vjp`, and ``∂loss/∂W = Σ_i ∂loss/∂q_i x_iᵀ``.

Note on fairness: scale 1 with weights ``W`` is the same model as scale ``1/√d`` with weights
``√d·W``, and gradient descent on ``W`` then takes steps ``d`` times larger in that picture. So
the unscaled run starts saturated *and* effectively uses a ``d`` times larger learning rate. The
study keeps the issue's protocol (same seed and learning rate) and reports what happens.

Examples
--------
>>> from qkv.study import training_study
>>> runs = training_study(d=64, keys=8, steps=30, lr=2.0, seed=0)
>>> [r.mode for r in runs]
['scaled', 'unscaled']
>>> runs[0].loss[-1] < runs[0].loss[0]
True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..checks import check_int, check_real
from ..engine.grad import attention_vjp
from ..errors import InputError
from ..front import attention
from ..keywords import near_keywords
from .scaling import mode_scale

__all__ = ["TrainingRun", "training_study"]


@dataclass
class TrainingRun:
    """One training run: per-step loss, accuracy and gradient norm (``steps + 1`` points each:
    before the first update and after each one, the gradient norm being that of the step taken
    from that point, with the last one computed but not applied)."""

    mode: str
    scale: float
    d: int
    keys: int
    lr: float
    loss: list[float]
    accuracy: list[float]
    grad_norm: list[float]

    def as_dict(self) -> dict[str, Any]:
        """The run as a plain dict (the JSON document)."""
        return asdict(self)

    def steps_to(self, accuracy: float) -> int | None:
        """First step at which the accuracy reaches ``accuracy`` (``None`` if never)."""
        for i, a in enumerate(self.accuracy):
            if a >= accuracy:
                return i
        return None


def _loss_and_grad(
    w: np.ndarray, x: np.ndarray, k: np.ndarray, scale: float
) -> tuple[float, float, np.ndarray]:
    q = x @ w.T  # (N, d)
    v = np.eye(k.shape[0])
    p = attention(q, k, v, scale=scale)  # one-hot values: the output is the weight row
    target = np.eye(k.shape[0])
    n = q.shape[0]
    loss = 0.5 * float(np.sum((p - target) ** 2)) / n
    acc = float(np.mean(np.argmax(p, axis=-1) == np.arange(n)))
    dq, _, _ = attention_vjp(q, k, v, (p - target) / n, scale=scale)
    return loss, acc, dq.T @ x  # ∂loss/∂W


@near_keywords()
def training_study(
    *,
    d: int = 1024,
    keys: int = 64,
    steps: int = 200,
    lr: float = 50.0,
    seed: int = 0,
    modes: Sequence[str] = ("scaled", "unscaled"),
    progress: Callable[[int], None] | None = None,
) -> list[TrainingRun]:
    """Train the retrieval task once per mode with the same seed, start and learning rate.

    Parameters
    ----------
    d : int
        Feature size of queries and keys (default 1024).
    keys : int
        Number of keys, values and query inputs (default 64).
    steps : int
        Gradient-descent steps (default 200).
    lr : float
        Learning rate, the same for every mode (default 50: the loss is a mean over queries of
        squared weight errors, whose gradients are small).
    seed : int
        Seed of the keys, query inputs and initial ``W``.
    modes : sequence of str
        Score scales to compare, as in :func:`qkv.study.scaling.mode_scale`.
    progress : callable, optional
        Called with 1 after each step.

    Returns
    -------
    list of TrainingRun
        One per mode, in the order given.
    """
    d = check_int(d, "d", minimum=1, maximum=1 << 14)
    keys = check_int(keys, "keys", minimum=2, maximum=4096)
    steps = check_int(steps, "steps", minimum=1, maximum=1 << 20)
    seed = check_int(seed, "seed", minimum=0)
    lr = check_real(lr, "lr", positive=True)
    modes = list(dict.fromkeys(modes))
    if not modes:
        raise InputError("modes: expected at least one mode")

    rng = np.random.default_rng(seed)
    k = rng.standard_normal((keys, d))
    x = rng.standard_normal((keys, d))
    w0 = rng.standard_normal((d, d)) / math.sqrt(d)

    runs = []
    for mode in modes:
        run = TrainingRun(
            mode, mode_scale(mode, d), d, keys, lr, loss=[], accuracy=[], grad_norm=[]
        )
        w = w0.copy()
        for step in range(steps + 1):
            loss, acc, grad = _loss_and_grad(w, x, k, run.scale)
            run.loss.append(loss)
            run.accuracy.append(acc)
            run.grad_norm.append(float(np.linalg.norm(grad)))
            if step < steps:
                w -= lr * grad
                if progress is not None:
                    progress(1)
        runs.append(run)
    return runs
