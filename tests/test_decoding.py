"""Decoding consistency: causal prefill row i equals one query attending the prefix 0..i."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.conftest import bound

import qkv
from qkv import reference


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    N=st.integers(1, 16),
    hkv=st.integers(1, 2),
    group=st.integers(1, 3),
    left=st.one_of(st.none(), st.integers(0, 5)),
    dtype=st.sampled_from([np.float32, np.float64]),
)
def test_prefill_row_equals_single_query_on_prefix(seed, N, hkv, group, left, dtype):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, hkv * group, N, 8)).astype(dtype)
    k = rng.standard_normal((2, hkv, N, 8)).astype(dtype)
    v = rng.standard_normal((2, hkv, N, 6)).astype(dtype)
    window = None if left is None else (left, 0)
    full = qkv.attention(q, k, v, causal=True, window=window)
    limit = bound("decoding", dtype)
    for i in range(N):
        # one query at the end of the prefix: bottom-right causal lets it see all i + 1 keys
        step = qkv.attention(
            q[..., i : i + 1, :], k[..., : i + 1, :], v[..., : i + 1, :], causal=True, window=window
        )
        np.testing.assert_allclose(step[..., 0, :], full[..., i, :], rtol=limit, atol=limit)
        # the same without the causal flag: a single query sees everything it is given
        if window is None:
            nc = qkv.attention(q[..., i, :][..., None, :], k[..., : i + 1, :], v[..., : i + 1, :])
            np.testing.assert_allclose(nc[..., 0, :], full[..., i, :], rtol=limit, atol=limit)
    np.testing.assert_allclose(
        full, reference.attention(q, k, v, causal=True, window=window), rtol=limit, atol=limit
    )
