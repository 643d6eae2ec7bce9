"""Robustness around the numbers: processes, threads, cache growth, non-finite inputs, ranges."""

from __future__ import annotations

import multiprocessing
import threading
import warnings

import numpy as np
import pytest

import qkv
from qkv import reference

threadpoolctl = pytest.importorskip("threadpoolctl")


# ----- processes and threads -----


def _fork_child_attention(q: np.ndarray) -> np.ndarray:
    return qkv.attention(q, q, q, causal=True)


@pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="needs the fork start method"
)
def test_forked_child_runs_threaded_kernels():
    """A child forked after the parent used the worker pool must not wait on dead threads."""
    q = np.random.default_rng(0).standard_normal((2, 4, 300, 32)).astype(np.float32)
    parent = qkv.attention(q, q, q, causal=True)  # starts the pool in the parent
    with multiprocessing.get_context("fork").Pool(1) as pool:
        child = pool.apply_async(_fork_child_attention, (q,)).get(timeout=60)
    ref = reference.attention(q, q, q, causal=True)
    np.testing.assert_allclose(child, ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(child, parent)


def _blas_threads() -> list[int]:
    return [m["num_threads"] for m in threadpoolctl.threadpool_info() if m["user_api"] == "blas"]


def test_concurrent_calls_leave_blas_threads_as_found():
    """Limits are process-wide: threads racing on them must not leave BLAS at one thread."""
    before = _blas_threads()
    if not before or max(before) < 2:
        pytest.skip("BLAS already runs one thread here")
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2, 40, 16)).astype(np.float32)  # short calls: many races
    ref = reference.attention(q, q, q, causal=True)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(200):
                out = qkv.attention(q, q, q, causal=True, kernel="tiled")
            np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    assert _blas_threads() == before


# ----- KVCache growth is all or nothing -----


def test_failed_cache_growth_leaves_cache_unchanged(monkeypatch):
    rng = np.random.default_rng(2)
    k, v = rng.standard_normal((2, 1, 2, 20, 4)).astype(np.float32)
    cache = qkv.KVCache(1, 2, 4, value_dim=4)
    cache.append(k[:, :, :16], v[:, :, :16])  # exactly the first capacity (16)
    before = (cache.lengths, cache.capacity, cache.keys(0).copy(), cache.values(0).copy())
    real_empty = np.empty
    calls = []

    def failing_empty(shape, *args, **kwargs):
        calls.append(shape)
        if len(calls) == 2:  # the second buffer of the growth (k grew already, before the fix)
            raise MemoryError("simulated")
        return real_empty(shape, *args, **kwargs)

    monkeypatch.setattr(np, "empty", failing_empty)
    with pytest.raises(MemoryError):
        cache.append(k[:, :, 16:], v[:, :, 16:])
    monkeypatch.undo()
    assert cache.lengths.tolist() == before[0].tolist() and cache.capacity == before[1]
    np.testing.assert_array_equal(cache.keys(0), before[2])
    np.testing.assert_array_equal(cache.values(0), before[3])
    # and it goes on working: the retried append and attention equal the reference
    cache.append(k[:, :, 16:], v[:, :, 16:])
    q = rng.standard_normal((1, 2, 3, 4)).astype(np.float32)
    np.testing.assert_allclose(
        cache.attend(q), reference.attention(q, k, v, causal=True), rtol=1e-4, atol=1e-5
    )
