"""Agreement with PyTorch's scaled_dot_product_attention (a test-only peer)."""

from __future__ import annotations

import numpy as np
import pytest
from tests.conftest import tol

import qkv

torch = pytest.importorskip("torch")
F = torch.nn.functional
from torch.nn.attention.bias import causal_lower_right  # noqa: E402

TOL = tol("torch peer")


def sdpa(q, k, v, **kw):
    t = [torch.from_numpy(np.ascontiguousarray(x)) for x in (q, k, v)]
    return F.scaled_dot_product_attention(*t, **kw).numpy()


@pytest.fixture(params=[np.float32, np.float64])
def dtype(request):
    return request.param


def rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("L,S", [(7, 7), (3, 11), (1, 9), (1, 1)])
def test_plain_and_scaled(dtype, L, S):
    rng = np.random.default_rng(L * 100 + S)
    q, k, v = (
        rand(rng, (2, 3, L, 16), dtype),
        rand(rng, (2, 3, S, 16), dtype),
        rand(rng, (2, 3, S, 8), dtype),
    )
    np.testing.assert_allclose(qkv.attention(q, k, v), sdpa(q, k, v), **TOL[dtype])
    np.testing.assert_allclose(
        qkv.attention(q, k, v, scale=0.3), sdpa(q, k, v, scale=0.3), **TOL[dtype]
    )


@pytest.mark.parametrize("L,S", [(6, 6), (3, 10), (1, 10)])
def test_causal_lower_right(dtype, L, S):
    rng = np.random.default_rng(L + S)
    q, k, v = (
        rand(rng, (1, 2, L, 8), dtype),
        rand(rng, (1, 2, S, 8), dtype),
        rand(rng, (1, 2, S, 8), dtype),
    )
    bias = causal_lower_right(L, S)
    want = sdpa(q, k, v, attn_mask=bias)
    np.testing.assert_allclose(qkv.attention(q, k, v, causal=True), want, **TOL[dtype])
    if L == S:  # only then does PyTorch's top-left is_causal agree
        np.testing.assert_allclose(sdpa(q, k, v, is_causal=True), want, **TOL[dtype])


def test_causal_differs_from_torch_top_left_when_L_lt_S():
    rng = np.random.default_rng(0)
    q, k, v = (
        rand(rng, (3, 8), np.float64),
        rand(rng, (10, 8), np.float64),
        rand(rng, (10, 8), np.float64),
    )
    assert not np.allclose(qkv.attention(q, k, v, causal=True), sdpa(q, k, v, is_causal=True))


def test_grouped_query_heads(dtype):
    rng = np.random.default_rng(5)
    q = rand(rng, (2, 8, 5, 16), dtype)
    k, v = rand(rng, (2, 2, 9, 16), dtype), rand(rng, (2, 2, 9, 4), dtype)
    want = sdpa(q, k, v, enable_gqa=True)
    np.testing.assert_allclose(qkv.attention(q, k, v), want, **TOL[dtype])
    want_c = sdpa(q, k, v, enable_gqa=True, attn_mask=causal_lower_right(5, 9))
    np.testing.assert_allclose(qkv.attention(q, k, v, causal=True), want_c, **TOL[dtype])


def test_bool_and_float_masks(dtype):
    rng = np.random.default_rng(7)
    q, k, v = (
        rand(rng, (2, 4, 6, 8), dtype),
        rand(rng, (2, 4, 6, 8), dtype),
        rand(rng, (2, 4, 6, 8), dtype),
    )
    m = rng.random((4, 6, 6)) < 0.7
    m[..., 0] = True  # torch gives NaN for rows with nothing to attend; keep every row alive
    tm = torch.from_numpy(m)
    np.testing.assert_allclose(
        qkv.attention(q, k, v, mask=m), sdpa(q, k, v, attn_mask=tm), **TOL[dtype]
    )
    b = rng.standard_normal((6, 6)).astype(dtype)
    np.testing.assert_allclose(
        qkv.attention(q, k, v, mask=b), sdpa(q, k, v, attn_mask=torch.from_numpy(b)), **TOL[dtype]
    )


def test_window_as_mask(dtype):
    rng = np.random.default_rng(11)
    L = S = 12
    q, k, v = (
        rand(rng, (1, 1, L, 8), dtype),
        rand(rng, (1, 1, S, 8), dtype),
        rand(rng, (1, 1, S, 8), dtype),
    )
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    band = (j >= i - 3) & (j <= i)  # causal sliding window of 4 keys
    want = sdpa(q, k, v, attn_mask=torch.from_numpy(band))
    np.testing.assert_allclose(qkv.attention(q, k, v, window=(3, 0)), want, **TOL[dtype])
    np.testing.assert_allclose(
        qkv.attention(q, k, v, causal=True, window=(3, None)), want, **TOL[dtype]
    )
