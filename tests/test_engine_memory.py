"""The tiled kernel's extra memory stays O(tile · S): it never allocates an L x S array."""

from __future__ import annotations

import tracemalloc

import numpy as np
from tests.conftest import tol

from qkv.engine.kernels import tiled
from qkv.validate import make_plan


def test_tiled_never_allocates_the_score_matrix():
    L = S = 8192  # the float32 score matrix alone would be 256 MiB
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((S, 4), dtype=np.float32) for _ in range(3))
    for causal in (True, False):
        plan = make_plan(q, k, v, causal=causal)
        tracemalloc.start()
        try:
            out, _ = tiled.attend(plan)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert out.shape == (L, 4)
        # tiles, per-thread scratch and the output: a few MiB, under 1/16 of the matrix
        assert peak < L * S * 4 // 16, f"peak {peak / 2**20:.1f} MiB"
    # and the answer is right on a few rows
    rows = np.array([0, 1, 4095, 8191])
    s = (q[rows] @ k.T) / np.sqrt(4)
    s[np.arange(S)[None, :] > rows[:, None]] = -np.inf
    w = np.exp(s - s.max(axis=1, keepdims=True))
    want = (w / w.sum(axis=1, keepdims=True)) @ v
    got, _ = tiled.attend(make_plan(q, k, v, causal=True))
    np.testing.assert_allclose(got[rows], want, **tol("float32 path", np.float32))


def test_the_autograd_backward_stays_within_the_forwards_working_set():
    """Issue 33, item 11: ``loss.backward()`` through :func:`qkv.attention` runs the tiled
    backward from the forward's saved ``out`` and ``lse``, not the dense one (the float32
    weights alone would be 256 MiB here, and the dense backward holds several such)."""
    import pytest

    torch = pytest.importorskip("torch")
    import qkv

    L = 8192
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, L, 16, generator=g, requires_grad=True) for _ in range(3))
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        out = qkv.attention(q, k, v, causal=True)
        forward = tracemalloc.get_traced_memory()[1] - base
        loss = (out * out).sum()
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        loss.backward()
        backward = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert backward < forward + 4 * 2**20, (backward / 2**20, forward / 2**20)
    # and the gradients are right on a few rows (the weights' rows recomputed in float64)
    rows = np.array([0, 1, 4095, 8191])
    qa, ka, va, oa = (x.detach().double().numpy()[0] for x in (q, k, v, out))
    s = (qa[rows] @ ka.T) / 4.0
    s[np.arange(L)[None, :] > rows[:, None]] = -np.inf
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    d_out = 2 * oa[rows]  # d(sum out²)/d out
    dp = d_out @ va.T
    dz = p * (dp - np.sum(dp * p, axis=1, keepdims=True))
    np.testing.assert_allclose(
        q.grad[0, rows].numpy(), dz @ ka / 4.0, **tol("backward", np.float32)
    )
