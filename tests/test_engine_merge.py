"""qkv.merge: attention over disjoint key sets combines into attention over their union."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.conftest import bound

import qkv
from qkv import reference


@settings(max_examples=60, deadline=None)
@given(
    S=st.integers(1, 30),
    n_cuts=st.integers(0, 5),
    seed=st.integers(0, 2**16),
    masked=st.booleans(),
)
def test_merge_over_random_splits_equals_whole(S, n_cuts, seed, masked):
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((3, 4)), rng.standard_normal((S, 4)), rng.standard_normal((S, 2))
    cuts = [0, *sorted(rng.integers(0, S + 1, n_cuts).tolist()), S]  # may repeat: empty parts
    mask = rng.random((3, S)) > 0.5 if masked else None
    parts = []
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        if a == b:
            parts.append((np.zeros((3, 2)), np.full(3, -np.inf)))
        else:
            m = None if mask is None else mask[:, a:b]
            parts.append(reference.attention(q, k[a:b], v[a:b], mask=m, return_lse=True))
    out, lse = qkv.merge(parts)
    ref_out, ref_lse = reference.attention(q, k, v, mask=mask, return_lse=True)
    np.testing.assert_allclose(out, ref_out, atol=bound("float64 path", np.float64))
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=bound("float64 path", np.float64))


def test_fully_masked_part_contributes_nothing_even_with_garbage_output():
    q, k, v = np.array([[1.0, 0.0]]), np.array([[1.0, 0.0], [0.0, 1.0]]), np.eye(2)
    whole = reference.attention(q, k, v, return_lse=True)
    garbage = (np.array([[np.nan, np.inf]]), np.array([-np.inf]))
    out, lse = qkv.merge([garbage, whole, garbage])
    np.testing.assert_allclose(out, whole[0])
    np.testing.assert_allclose(lse, whole[1])


def test_all_parts_empty_give_zero_and_minus_inf():
    empty = (np.ones((2, 3)), np.full(2, -np.inf))
    out, lse = qkv.merge([empty, empty])
    assert np.all(out == 0) and np.all(np.isneginf(lse))


def test_single_part_is_returned_unchanged_and_scalars_work():
    part = (np.array([1.0, 2.0]), np.float64(0.5))
    out, lse = qkv.merge([part])
    assert out.tolist() == [1.0, 2.0] and float(lse) == 0.5


def test_merge_matches_chunked_prefill_with_causal_offsets():
    """Chunked over keys with the kernels themselves, causal rows included."""
    rng = np.random.default_rng(4)
    q, k, v = (
        rng.standard_normal((2, 7, 4)),
        rng.standard_normal((2, 20, 4)),
        rng.standard_normal((2, 20, 3)),
    )
    ok = np.arange(20)[None, :] <= np.arange(13, 20)[:, None]  # bottom-right causal, L=7, S=20
    parts = [
        qkv.attention(q, k[:, a:b], v[:, a:b], mask=ok[:, a:b], return_lse=True, kernel=kern)
        for (a, b), kern in zip(
            [(0, 6), (6, 15), (15, 20)], ["tiled", "decode", "dense"], strict=True
        )
    ]
    out, _ = qkv.merge(parts)
    np.testing.assert_allclose(
        out, reference.attention(q, k, v, causal=True), atol=bound("float64 path", np.float64)
    )


def test_dtypes_follow_the_parts():
    o16, l32 = np.ones((2, 3), np.float16), np.zeros(2, np.float32)
    out, lse = qkv.merge([(o16, l32), (o16 * 3, l32)])
    assert out.dtype == np.float16 and lse.dtype == np.float32
    np.testing.assert_allclose(out.astype(float), 2.0)
    np.testing.assert_allclose(lse, np.log(2.0), rtol=bound("rule floor", np.float32))


@pytest.mark.parametrize(
    "parts, match",
    [
        ([], "at least one"),
        ([(np.ones(2),)], r"parts\[0\]"),
        ([(np.ones((2, 3)), np.ones(3))], r"out \(2, 3\) and lse \(3,\)"),
        ([(np.ones((2, 3)), np.ones(2)), (np.ones((2, 4)), np.ones(2))], r"parts\[1\].*\(2, 4\)"),
    ],
)
def test_bad_parts_raise_input_error(parts, match):
    with pytest.raises(qkv.InputError, match=match):
        qkv.merge(parts)


def test_non_sequence_and_non_numeric_raise_type_errors():
    with pytest.raises(qkv.InputTypeError, match="parts"):
        qkv.merge(None)
    with pytest.raises(qkv.InputTypeError, match="parts"):
        qkv.merge([(np.array(["a"]), np.zeros(()))])


@settings(max_examples=80, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 4), st.integers(1, 5), st.integers(1, 9)),
    dtype=st.sampled_from([np.float32, np.float64]),
    seed=st.integers(0, 2**16),
    zeros=st.sampled_from(["none", "some", "all"]),
    strided=st.booleans(),
)
def test_a_pair_merged_in_its_own_memory_gives_merge_arrays_bits(
    shape, dtype, seed, zeros, strided
):
    # The cascade's merge (merge_pair_into) against merge_arrays, byte for byte: lse -inf
    # (weight 0, whatever the output holds), NaN lse, infinite outputs, and -0 outputs (which
    # merge_arrays sums to +0), with the first part a strided view as the cascade gives it.
    from qkv.engine.kernels.blocks import merge_arrays, merge_pair_into

    rng = np.random.default_rng(seed)
    rows, n = shape[:2], shape[2]
    a, b = (rng.standard_normal((*rows, n)).astype(dtype) for _ in range(2))
    la, lb = (dtype(30) * rng.standard_normal(rows).astype(dtype) for _ in range(2))
    la[rng.random(rows) < 0.3] = -np.inf
    lb[rng.random(rows) < 0.3] = -np.inf
    a[rng.random(a.shape) < 0.1] = np.inf
    if rng.random() < 0.3:
        lb.flat[0] = np.nan
    if zeros != "none":
        where = rng.random(a.shape) < (1.0 if zeros == "all" else 0.3)
        a[where] = -0.0
        b[where] = -0.0
    want_out, want_lse = merge_arrays([(a, la), (b, lb)])
    first = np.swapaxes(np.ascontiguousarray(np.swapaxes(a, 0, 1)), 0, 1) if strided else a.copy()
    got_out, got_lse = merge_pair_into((first, la.copy()), (b.copy(), lb.copy()))
    assert got_out.dtype == want_out.dtype and got_lse.dtype == want_lse.dtype
    assert got_out.tobytes() == want_out.tobytes()
    assert got_lse.tobytes() == want_lse.tobytes()
