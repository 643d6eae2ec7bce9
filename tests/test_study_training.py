"""The training study: gradient descent on qkv.attention_vjp, scaled against unscaled."""

from __future__ import annotations

import numpy as np
import pytest
from tests.conftest import tol

import qkv
from qkv.study import training_study
from qkv.study.training import _loss_and_grad


@pytest.fixture(scope="module")
def runs():
    return training_study(d=256, keys=16, steps=30, lr=1.0, seed=0)


def test_scaled_learns_and_unscaled_lags(runs):
    scaled, unscaled = runs
    assert (scaled.mode, unscaled.mode) == ("scaled", "unscaled")
    assert len(scaled.loss) == len(scaled.accuracy) == len(scaled.grad_norm) == 31
    assert scaled.loss[-1] < 0.05 * scaled.loss[0]
    assert scaled.loss[10] < scaled.loss[0]
    assert scaled.accuracy[-1] == 1.0 and scaled.steps_to(1.0) is not None
    # same seed, same start, same learning rate: the unscaled run does not get there
    assert unscaled.loss[-1] > 10 * scaled.loss[-1]
    assert unscaled.accuracy[-1] < 0.5 and unscaled.steps_to(1.0) is None
    assert unscaled.grad_norm[-1] < 1e-2 * unscaled.grad_norm[0]


def test_same_start_for_both_modes(runs):
    scaled, unscaled = runs
    # the start only differs by the scale: the unscaled logits are the scaled ones times sqrt(d)
    assert scaled.accuracy[0] == unscaled.accuracy[0]
    assert unscaled.scale == 1.0 and scaled.scale == pytest.approx(1 / 16)


def test_gradient_matches_finite_differences():
    rng = np.random.default_rng(0)
    d, n = 6, 4
    w = rng.standard_normal((d, d)) / np.sqrt(d)
    x, k = rng.standard_normal((n, d)), rng.standard_normal((n, d))
    for scale in (1 / np.sqrt(d), 1.0):
        loss, _, grad = _loss_and_grad(w, x, k, scale)
        eps = 1e-6
        fd = np.zeros_like(w)
        for idx in np.ndindex(w.shape):
            wp, wm = w.copy(), w.copy()
            wp[idx] += eps
            wm[idx] -= eps
            fd[idx] = (_loss_and_grad(wp, x, k, scale)[0] - _loss_and_grad(wm, x, k, scale)[0]) / (
                2 * eps
            )
        np.testing.assert_allclose(grad, fd, **tol("finite differences", np.float64))
        p = qkv.reference.attention_weights(x @ w.T, k, scale=scale)
        assert loss == pytest.approx(0.5 * np.sum((p - np.eye(n)) ** 2) / n)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(d=0), "d"),
        (dict(keys=1), "keys"),
        (dict(steps=0), "steps"),
        (dict(lr=0.0), "lr"),
        (dict(lr=float("nan")), "lr"),
        (dict(lr="1"), "lr"),
        (dict(modes=["sideways"]), "mode"),
    ],
)
def test_bad_arguments(kw, match):
    with pytest.raises(qkv.InputError, match=match):
        training_study(**{"d": 8, "keys": 4, "steps": 2, **kw})
