"""Property tests: qkv's fast path equals the float64 reference over shapes, masks and dtypes."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.conftest import bound, tol, within_rule

import qkv
from qkv import reference
from qkv.testing import strategies as qs

TOL = tol("fast path")


@st.composite
def problems(draw):
    """A random attention problem: layout, grouping, dtype, scale, causal, window, mask.

    Shapes, values and masks come from :mod:`qkv.testing.strategies` (values on a grid of
    sixteenths, exact in every dtype, so the reference sees the very inputs the fast path
    does); the layouts it does not draw (a single query vector, plain ``(L, d)`` matrices, K/V
    broadcast over batch and heads) are cut from its arrays here.
    """
    kind = draw(st.sampled_from(["1d", "2d", "heads", "gqa", "batch-broadcast"]))
    s = draw(
        qs.shapes(
            batch=(1, 3),
            heads=(1, 3),
            L=(1, 12),
            S=(1, 12),
            d=(1, 9),
            grouped=kind == "gqa",
            dv_differs=draw(st.booleans()),
        )
    )
    q, k, v = draw(qs.inputs(st.just(s)))
    Lq = 1 if kind == "1d" else s.L
    if kind == "1d":
        q, k, v = q[0, 0, 0], k[0, 0], v[0, 0]
    elif kind == "2d":
        q, k, v = q[0, 0], k[0, 0], v[0, 0]
    elif kind == "batch-broadcast":
        k, v = k[0, 0], v[0, 0]  # k/v broadcast over batch and heads
    dtype = draw(st.sampled_from([np.float64, np.float32, np.float16]))
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    opts = {}
    if draw(st.booleans()):
        opts["scale"] = draw(st.floats(0.05, 4.0))
    opts["causal"] = draw(st.booleans())
    if draw(st.booleans()):
        opts["window"] = draw(qs.windows(max_side=6))
    mask_kind = draw(st.sampled_from([None, "bool", "float", "bool-row"]))
    if mask_kind == "bool":
        opts["mask"] = draw(qs.bool_masks(1, 1, Lq, s.S, every_row_sees=False))[0, 0]
    elif mask_kind == "bool-row":  # broadcast over rows
        opts["mask"] = draw(qs.bool_masks(1, 1, 1, s.S, every_row_sees=False))[0, 0, 0]
    elif mask_kind == "float":
        bias = draw(qs.float_masks(1, 1, Lq, s.S))[0, 0]
        keep = draw(qs.bool_masks(1, 1, Lq, s.S, every_row_sees=False))[0, 0]
        opts["mask"] = np.where(keep, bias, -np.inf).astype(dtype)
    return q, k, v, opts


SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(problems())
def test_attention_equals_reference(problem):
    q, k, v, opts = problem
    out, lse = qkv.attention(q, k, v, return_lse=True, **opts)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **opts)
    assert out.dtype == q.dtype
    assert out.shape == ref.shape
    tol = TOL[q.dtype.type]
    np.testing.assert_allclose(out.astype(np.float64), ref, **tol)
    within_rule(out, q, k, v, expected=ref, **opts)  # and the library's own rule
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], **tol)
    # A row that may attend nothing gives exactly 0, never NaN.
    assert not np.isnan(out).any()
    assert np.all(out[np.isneginf(lse)] == 0)


@SETTINGS
@given(problems())
def test_weights_equal_reference_and_are_distributions(problem):
    q, k, _, opts = problem
    w = qkv.attention_weights(q, k, **opts)
    ref = reference.attention_weights(q, k, **opts)
    np.testing.assert_allclose(w.astype(np.float64), ref, **TOL[q.dtype.type])
    sums = ref.sum(axis=-1)
    assert np.all(np.isclose(sums, 1.0) | (sums == 0.0))


@settings(max_examples=100, deadline=None)
@given(problems())
def test_scores_equal_reference(problem):
    q, k, _, opts = problem
    s = qkv.scores(q, k, scale=opts.get("scale"))
    ref = reference.scores(q, k, scale=opts.get("scale"))
    scale = np.abs(ref).max() if ref.size else 1.0
    np.testing.assert_allclose(
        s.astype(np.float64),
        ref,
        rtol=TOL[q.dtype.type]["rtol"],
        atol=TOL[q.dtype.type]["atol"] * max(1.0, scale),
    )


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 6), st.integers(1, 30))
def test_softmax_matches_reference_and_sums_to_one(seed, rows, n):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, n)) * 50
    x[rng.random((rows, n)) < 0.3] = -np.inf
    got = qkv.softmax(x)
    np.testing.assert_allclose(got, reference.softmax(x), **tol("softmax", np.float64))
    sums = got.sum(-1)
    assert np.all(np.isclose(sums, 1.0) | (sums == 0.0))
    assert np.all(sums[np.all(np.isneginf(x), axis=-1)] == 0.0)


def test_softmax_axis():
    x = np.arange(12.0).reshape(3, 4)
    np.testing.assert_allclose(qkv.softmax(x, axis=0), reference.softmax(x, axis=0))
    assert np.allclose(qkv.softmax(x, axis=0).sum(0), 1.0)


def test_float16_large_dot_products_do_not_overflow():
    # q·k = 256 * 300 * 300 > 65504; in float16 arithmetic this would be inf.
    d = 256
    q = np.full((1, d), 300, np.float16)
    k = np.stack([np.full(d, 300, np.float16), np.full(d, 299, np.float16)])
    v = np.array([[1.0, 0.0], [0.0, 1.0]], np.float16)
    out = qkv.attention(q, k, v, scale=1.0)
    ref = reference.attention(q, k, v, scale=1.0)
    assert out.dtype == np.float16
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=bound("rounded once", np.float16))
    w = qkv.attention_weights(q, k, scale=1 / 16)
    assert np.all(np.isfinite(w))
    np.testing.assert_allclose(
        w.astype(np.float64),
        reference.attention_weights(q, k, scale=1 / 16),
        atol=bound("rounded once", np.float16),
    )


def test_dtype_rules():
    q = np.ones((2, 3), np.float32)
    k = np.ones((4, 3), np.float32)
    assert qkv.attention(q, k, np.ones((4, 2), np.float32)).dtype == np.float32
    assert qkv.attention(q, k, np.ones((4, 2), np.float64)).dtype == np.float64  # result_type
    assert qkv.attention([[1, 2, 3]], [[1, 2, 3]], [[1]]).dtype == np.float64  # lists → float64
    ints = np.arange(6).reshape(2, 3)
    np.testing.assert_allclose(
        qkv.attention(ints, ints, ints), reference.attention(ints, ints, ints)
    )


def test_fully_masked_rows_give_zero_and_neg_inf_lse():
    q = np.ones((3, 2))
    k = np.ones((4, 2))
    v = np.ones((4, 5))
    # L > S with causal: the first L - S rows ... here L=3 < S=4; use a mask that empties row 1.
    mask = np.ones((3, 4), bool)
    mask[1] = False
    out, lse = qkv.attention(q, k, v, mask=mask, return_lse=True)
    assert np.all(out[1] == 0) and lse[1] == -np.inf
    np.testing.assert_allclose(out[[0, 2]], 1.0)
    # Causal with L > S: row i sits at position S - L + i < 0 for the first rows.
    out2, lse2 = qkv.attention(
        np.ones((5, 2)), np.ones((3, 2)), np.ones((3, 1)), causal=True, return_lse=True
    )
    assert np.all(out2[:2] == 0) and np.all(lse2[:2] == -np.inf)
    np.testing.assert_allclose(out2[2:], 1.0)


def test_no_keys_at_all_gives_zeros_in_every_path():
    q = np.ones((2, 3, 4))
    k = np.ones((2, 0, 4))
    v = np.ones((2, 0, 5))
    for impl in (qkv, reference):
        out, lse = impl.attention(q, k, v, return_lse=True)
        assert out.shape == (2, 3, 5) and np.all(out == 0) and np.all(lse == -np.inf)
        assert impl.attention_weights(q, k).shape == (2, 3, 0)
    for kernel in ("dense", "tiled", "decode"):
        out = qkv.attention(q, k, v, kernel=kernel)
        assert out.shape == (2, 3, 5) and np.all(out == 0)
