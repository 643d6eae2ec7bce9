"""attention_vjp against finite differences of the reference and against PyTorch autograd."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.conftest import bound, tol

import qkv
from qkv import reference
from qkv.engine.grad import reference_attention_vjp


def fd_grads(q, k, v, g, eps=1e-6, **kw):
    """Central finite differences of ``sum(reference.attention(q, k, v) * g)``."""
    arrays = [np.array(a, dtype=np.float64) for a in (q, k, v)]

    def loss() -> float:
        return float(np.sum(reference.attention(*arrays, **kw) * g))

    grads = []
    for a in arrays:
        ga = np.zeros_like(a)
        for idx in np.ndindex(a.shape):
            old = a[idx]
            a[idx] = old + eps
            up = loss()
            a[idx] = old - eps
            down = loss()
            a[idx] = old
            ga[idx] = (up - down) / (2 * eps)
        grads.append(ga)
    return grads


def rand(rng, *shape):
    return rng.standard_normal(shape)


CASES = {
    "plain": dict(q=(3, 4), k=(5, 4), v=(5, 4), kw={}),
    "dv!=d": dict(q=(3, 4), k=(5, 4), v=(5, 2), kw={}),
    "causal L<S": dict(q=(2, 3), k=(5, 3), v=(5, 2), kw=dict(causal=True)),
    "causal L>S (empty rows)": dict(q=(4, 3), k=(2, 3), v=(2, 2), kw=dict(causal=True)),
    "window": dict(q=(4, 3), k=(6, 3), v=(6, 3), kw=dict(window=(1, 2))),
    "causal+window": dict(q=(5, 3), k=(5, 3), v=(5, 2), kw=dict(causal=True, window=(2, None))),
    "scale=1": dict(q=(2, 3), k=(4, 3), v=(4, 3), kw=dict(scale=1.0)),
    "grouped heads": dict(q=(2, 4, 3, 2), k=(2, 2, 5, 2), v=(2, 2, 5, 3), kw=dict(causal=True)),
    "broadcast batch": dict(q=(2, 1, 3, 2), k=(1, 3, 4, 2), v=(4, 3), kw={}),
    "1-D q": dict(q=(3,), k=(4, 3), v=(4, 2), kw={}),
    "1-D q, heads": dict(q=(3,), k=(2, 4, 3), v=(2, 4, 2), kw={}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_finite_differences(name):
    c = CASES[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    q, k, v = rand(rng, *c["q"]), rand(rng, *c["k"]), rand(rng, *c["v"])
    out = reference.attention(q, k, v, **c["kw"])
    g = rand(rng, *out.shape)
    want = fd_grads(q, k, v, g, **c["kw"])
    for fn in (qkv.attention_vjp, reference_attention_vjp):
        got = fn(q, k, v, g, **c["kw"])
        for a, x, w in zip((q, k, v), got, want, strict=True):
            assert x.shape == a.shape and x.dtype == np.float64
            np.testing.assert_allclose(x, w, **tol("finite differences", np.float64))


def test_masks_bool_and_float():
    rng = np.random.default_rng(1)
    q, k, v = rand(rng, 2, 3, 4), rand(rng, 2, 5, 4), rand(rng, 2, 5, 3)
    bmask = rng.random((1, 3, 5)) < 0.6
    bmask[0, 0, :] = False  # a row that may attend nothing
    bias = rand(rng, 3, 5)
    for mask in (bmask, bias):
        out = reference.attention(q, k, v, mask=mask)
        g = rand(rng, *out.shape)
        want = fd_grads(q, k, v, g, mask=mask)
        got = qkv.attention_vjp(q, k, v, g, mask=mask)
        for x, w in zip(got, want, strict=True):
            np.testing.assert_allclose(x, w, **tol("finite differences", np.float64))
    # masked keys get no gradient: key 4 is never allowed
    bmask = np.ones((3, 5), dtype=bool)
    bmask[:, 4] = False
    _, dk, dv = qkv.attention_vjp(q, k, v, np.ones((2, 3, 3)), mask=bmask)
    assert np.all(dk[:, 4] == 0) and np.all(dv[:, 4] == 0)
    assert np.all(np.abs(dv[:, :4]) > 0)


def test_empty_rows_contribute_nothing():
    rng = np.random.default_rng(2)
    q, k, v = rand(rng, 4, 3), rand(rng, 2, 3), rand(rng, 2, 2)
    g = rand(rng, 4, 2)
    dq, dk, dv = qkv.attention_vjp(q, k, v, g, causal=True)  # rows 0, 1 see no key
    assert np.all(dq[:2] == 0) and np.all(np.isfinite(dq))
    g2 = g.copy()
    g2[:2] = 1e6  # upstream gradient of empty rows must not leak into k, v
    _, dk2, dv2 = qkv.attention_vjp(q, k, v, g2, causal=True)
    np.testing.assert_array_equal(dk, dk2)
    np.testing.assert_array_equal(dv, dv2)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_dtypes_follow_inputs(dtype):
    rng = np.random.default_rng(3)
    q, k, v = rand(rng, 2, 3, 8), rand(rng, 2, 6, 8), rand(rng, 2, 6, 4)
    g = rand(rng, 2, 3, 4)
    want = reference_attention_vjp(q, k, v, g, causal=True)
    got = qkv.attention_vjp(*(a.astype(dtype) for a in (q, k, v, g)), causal=True)
    for x, w in zip(got, want, strict=True):
        assert x.dtype == dtype
        np.testing.assert_allclose(x, w, **tol("backward", dtype))


def test_int_and_list_inputs_give_float64():
    dq, dk, dv = qkv.attention_vjp([2, 1], [[1, 0], [3, 2]], [[1], [3]], [1], scale=0.5)
    assert dq.dtype == dk.dtype == dv.dtype == np.float64
    # hand-derived: p = softmax([1, 4]), dz = p (v - p·v) / 2
    p = reference.softmax([1.0, 4.0])
    dz = p * (np.array([1.0, 3.0]) - p @ [1.0, 3.0]) * 0.5
    np.testing.assert_allclose(dq, dz @ [[1, 0], [3, 2]], rtol=bound("closed form", np.float64))
    np.testing.assert_allclose(dk, np.outer(dz, [2, 1]), rtol=bound("closed form", np.float64))
    np.testing.assert_allclose(dv[:, 0], p, rtol=bound("closed form", np.float64))


def test_grad_out_broadcasts_and_bad_shape_raises():
    rng = np.random.default_rng(4)
    q, k, v = rand(rng, 3, 4), rand(rng, 5, 4), rand(rng, 5, 2)
    a = qkv.attention_vjp(q, k, v, 1.0)
    b = qkv.attention_vjp(q, k, v, np.ones((3, 2)))
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(qkv.InputError, match=r"grad_out: shape \(3, 3\).*\(3, 2\)"):
        qkv.attention_vjp(q, k, v, np.ones((3, 3)))
    with pytest.raises(TypeError, match="grad_out"):
        qkv.attention_vjp(q, k, v, np.array(["a"]))
    with pytest.raises(ValueError, match="k, v"):
        qkv.attention_vjp(q, k, v[:4], np.ones((3, 2)))


@settings(max_examples=30, deadline=None)
@given(
    L=st.integers(1, 5),
    S=st.integers(1, 6),
    d=st.integers(1, 4),
    dv=st.integers(1, 3),
    hkv=st.integers(1, 2),
    group=st.integers(1, 3),
    causal=st.booleans(),
    left=st.none() | st.integers(0, 3),
    right=st.none() | st.integers(0, 3),
    seed=st.integers(0, 2**31),
)
def test_fast_equals_reference_property(L, S, d, dv, hkv, group, causal, left, right, seed):
    rng = np.random.default_rng(seed)
    q = rand(rng, hkv * group, L, d)
    k, v = rand(rng, hkv, S, d), rand(rng, hkv, S, dv)
    g = rand(rng, hkv * group, L, dv)
    kw = dict(causal=causal, window=(left, right))
    got = qkv.attention_vjp(q, k, v, g, **kw)
    want = reference_attention_vjp(q, k, v, g, **kw)
    for x, w in zip(got, want, strict=True):
        np.testing.assert_allclose(x, w, **tol("backward", np.float64))
    # the gradient of the sum of outputs w.r.t. v is the column sums of the weights
    w8 = reference.attention_weights(q, np.repeat(k, group, 0), **kw)
    col = w8.sum(axis=-2).reshape(hkv, group, S).sum(axis=1)
    np.testing.assert_allclose(
        qkv.attention_vjp(q, k, v, 1.0, **kw)[2], np.repeat(col[..., None], dv, -1)
    )


torch = pytest.importorskip("torch")


def torch_grads(q, k, v, g, *, causal=False, scale=None, gqa=False):
    from torch.nn.attention.bias import causal_lower_right

    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    mask = causal_lower_right(q.shape[-2], k.shape[-2]) if causal else None
    out = torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, attn_mask=mask, scale=scale, enable_gqa=gqa
    )
    out.backward(torch.tensor(g))
    return [t.grad.numpy() for t in (tq, tk, tv)]


@pytest.mark.parametrize(
    "shapes, causal, scale, gqa",
    [
        (((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8)), False, None, False),
        (((2, 2, 3, 8), (2, 2, 7, 8), (2, 2, 7, 5)), True, None, False),  # causal, L < S
        (((1, 3, 6, 4), (1, 3, 6, 4), (1, 3, 6, 4)), True, 1.0, False),  # unscaled
        (((2, 4, 3, 8), (2, 2, 5, 8), (2, 2, 5, 6)), True, 0.3, True),  # grouped heads
    ],
)
def test_matches_torch_autograd(shapes, causal, scale, gqa):
    rng = np.random.default_rng(5)
    q, k, v = (rand(rng, *s) for s in shapes)
    g = rand(rng, *q.shape[:-1], v.shape[-1])
    want = torch_grads(q, k, v, g, causal=causal, scale=scale, gqa=gqa)
    got = qkv.attention_vjp(q, k, v, g, causal=causal, scale=scale)
    for x, w in zip(got, want, strict=True):
        np.testing.assert_allclose(x, w, **tol("backward", np.float64))
    got32 = qkv.attention_vjp(
        *(a.astype(np.float32) for a in (q, k, v, g)), causal=causal, scale=scale
    )
    for x, w in zip(got32, want, strict=True):
        assert x.dtype == np.float32
        np.testing.assert_allclose(x, w, **tol("backward", np.float32))


# --- the tiled (FlashAttention-2 style) backward -------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    L=st.integers(1, 9),
    S=st.integers(1, 9),
    hkv=st.integers(1, 2),
    group=st.integers(1, 2),
    block=st.integers(1, 5),
    causal=st.booleans(),
    left=st.none() | st.integers(0, 3),
    right=st.none() | st.integers(0, 3),
    masking=st.sampled_from(["none", "bool", "bias"]),
    saved=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_tiled_equals_reference_property(
    L, S, hkv, group, block, causal, left, right, masking, saved, seed
):
    rng = np.random.default_rng(seed)
    q = rand(rng, hkv * group, L, 3)
    k, v = rand(rng, hkv, S, 3), rand(rng, hkv, S, 2)
    g = rand(rng, hkv * group, L, 2)
    mask = {"none": None, "bool": rng.random((L, S)) < 0.6, "bias": rand(rng, 1, L, S)}[masking]
    kw = dict(causal=causal, window=(left, right), mask=mask)
    extra = {}
    if saved:
        out, lse = qkv.attention(q, k, v, return_lse=True, **kw)
        extra = dict(out=out, lse=lse)
    got = qkv.attention_vjp(q, k, v, g, block=block, **extra, **kw)
    want = reference_attention_vjp(q, k, v, g, **kw)
    for x, w in zip(got, want, strict=True):
        np.testing.assert_allclose(x, w, **tol("backward", np.float64))


def test_tiled_matches_finite_differences_and_1d_q():
    rng = np.random.default_rng(6)
    for name in ("grouped heads", "causal L>S (empty rows)", "1-D q, heads", "broadcast batch"):
        c = CASES[name]
        q, k, v = rand(rng, *c["q"]), rand(rng, *c["k"]), rand(rng, *c["v"])
        out, lse = qkv.attention(q, k, v, return_lse=True, **c["kw"])
        g = rand(rng, *out.shape)
        want = fd_grads(q, k, v, g, **c["kw"])
        got = qkv.attention_vjp(q, k, v, g, out=out, lse=lse, block=2, **c["kw"])
        for a, x, w in zip((q, k, v), got, want, strict=True):
            assert x.shape == a.shape
            np.testing.assert_allclose(x, w, **tol("finite differences", np.float64))


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_tiled_dtypes(dtype):
    rng = np.random.default_rng(7)
    q, k, v = rand(rng, 2, 20, 8), rand(rng, 2, 30, 8), rand(rng, 2, 30, 4)
    g = rand(rng, 2, 20, 4)
    want = reference_attention_vjp(q, k, v, g, causal=True)
    args = [a.astype(dtype) for a in (q, k, v, g)]
    out, lse = qkv.attention(*args[:3], causal=True, return_lse=True)
    for got in (
        qkv.attention_vjp(*args, causal=True, block=7),
        qkv.attention_vjp(*args, causal=True, out=out, lse=lse),
    ):
        for x, w in zip(got, want, strict=True):
            assert x.dtype == dtype
            np.testing.assert_allclose(x, w, **tol("backward", dtype))


def test_tiled_never_holds_the_score_matrix():
    import tracemalloc

    rng = np.random.default_rng(8)
    n, d = 1024, 8
    q, k, v, g = (rand(rng, n, d) for _ in range(4))
    out, lse = qkv.attention(q, k, v, causal=True, return_lse=True)
    tracemalloc.start()
    try:
        got = qkv.attention_vjp(q, k, v, g, causal=True, out=out, lse=lse, block=64)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < n * n * 8 / 8  # an eighth of one float64 L x S matrix
    want = qkv.attention_vjp(q, k, v, g, causal=True)  # the dense path
    for x, w in zip(got, want, strict=True):
        np.testing.assert_allclose(x, w, **tol("backward", np.float64))


def test_tiled_bad_arguments():
    rng = np.random.default_rng(9)
    q, k, v = rand(rng, 3, 4), rand(rng, 5, 4), rand(rng, 5, 2)
    out, lse = qkv.attention(q, k, v, return_lse=True)
    g = np.ones((3, 2))
    with pytest.raises(qkv.InputError, match="out, lse"):
        qkv.attention_vjp(q, k, v, g, out=out)
    with pytest.raises(qkv.InputError, match=r"lse: expected shape \(3,\)"):
        qkv.attention_vjp(q, k, v, g, out=out, lse=lse[:2])
    with pytest.raises(qkv.InputError, match=r"out: expected shape \(3, 2\)"):
        qkv.attention_vjp(q, k, v, g, out=out.T, lse=lse)
    for block in (0, 2.5, True):
        with pytest.raises(qkv.InputError, match="block"):
            qkv.attention_vjp(q, k, v, g, block=block)
