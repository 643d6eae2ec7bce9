"""Values at the limits: rows with NaN, scores and values near the float32 maximum, and window
sides beyond any sequence length; each is checked against the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
from tests.conftest import bound

import qkv
from qkv import reference

KERNELS = ["dense", "tiled", "decode"]


def test_reference_keeps_nan_rows_nan_like_the_kernels_and_torch():
    q = np.array([[1.0, 0], [np.nan, 1]])
    k, v = np.eye(2), np.array([[1.0, 2], [3, 4]])
    ref, lse = reference.attention(q, k, v, return_lse=True)
    assert np.isnan(ref[1]).all() and np.isnan(lse[1])
    assert np.isfinite(ref[0]).all()
    np.testing.assert_allclose(
        ref[0], qkv.attention(q, k, v)[0], rtol=bound("closed form", np.float64)
    )
    assert np.isnan(reference.softmax([np.nan, 1.0])).all()
    assert np.isnan(reference.attention_weights(q, k)[1]).all()


# Scores near the float32 limit: shifting by the row max passes through -inf (weight 0), and
# tiled's first try overflows before dispatch rescales v; the answers are finite, so no warning.
@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_dense_folds_the_scale_before_the_product():
    # q·k = ±4e38 overflows float32, but the scaled scores ±2e38 fit.
    q = np.full((1, 4), 1e19, np.float32)
    k = np.array([[1e19] * 4, [-1e19] * 4], np.float32)
    v = np.array([[1, 2], [3, 4]], np.float32)
    want = reference.attention(q, k, v)
    for kernel in KERNELS:
        np.testing.assert_allclose(
            qkv.attention(q, k, v, kernel=kernel), want, rtol=bound("rule floor", np.float32)
        )
    s = qkv.scores(q, k)
    assert np.isfinite(s).all()
    np.testing.assert_allclose(s, reference.scores(q, k), rtol=bound("rule floor", np.float32))


@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("kernel", KERNELS)
def test_values_near_the_float32_maximum_do_not_overflow(kernel):
    q = np.zeros((2, 4), np.float32)
    k = np.zeros((4, 4), np.float32)
    v = np.full((4, 2), 3e38, np.float32)
    out = qkv.attention(q, k, v, kernel=kernel)
    np.testing.assert_allclose(out, 3e38, rtol=bound("rule floor", np.float32))
    parts = [qkv.attention(q, k[i : i + 2], v[i : i + 2], return_lse=True) for i in (0, 2)]
    merged, lse = qkv.merge(parts)
    np.testing.assert_allclose(merged, 3e38, rtol=bound("rule floor", np.float32))
    np.testing.assert_allclose(lse, np.log(4.0), rtol=bound("rule floor", np.float32))


@pytest.mark.parametrize("window", [(0, 2**63 - 1), (None, 2**63 - 1), (10**30, 0), (2**64, None)])
@pytest.mark.parametrize("kernel", KERNELS)
def test_huge_window_sides_mean_unbounded(window, kernel):
    q, k = np.zeros((3, 2)), np.zeros((5, 2))
    v = np.arange(5.0)[:, None]
    unbounded = tuple(None if w is not None and w > 100 else w for w in window)
    want = reference.attention(q, k, v, window=unbounded if unbounded != (None, None) else None)
    np.testing.assert_allclose(qkv.attention(q, k, v, window=window, kernel=kernel), want)
    np.testing.assert_allclose(reference.attention(q, k, v, window=window), want)
