"""The structural masks against their definition, written as loops."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.masks import allowed, key_range


def brute(L, S, causal, window):
    ok = np.ones((L, S), bool)
    for i in range(L):
        p = S - L + i  # bottom-right alignment
        for j in range(S):
            if causal and j > p:
                ok[i, j] = False
            if window is not None:
                left, right = window
                if left is not None and j < p - left:
                    ok[i, j] = False
                if right is not None and j > p + right:
                    ok[i, j] = False
    return ok


windows = st.one_of(
    st.none(),
    st.tuples(st.one_of(st.none(), st.integers(0, 8)), st.one_of(st.none(), st.integers(0, 8))),
)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 14), st.integers(1, 14), st.booleans(), windows, st.data())
def test_allowed_and_key_range_match_definition(L, S, causal, window, data):
    want = brute(L, S, causal, window)
    got = allowed(L, S, causal=causal, window=window)
    got = np.ones((L, S), bool) if got is None else got
    assert np.array_equal(got, want)
    # Any tile equals the same slice of the full matrix.
    r0 = data.draw(st.integers(0, L - 1))
    r1 = data.draw(st.integers(r0 + 1, L))
    c0 = data.draw(st.integers(0, S - 1))
    c1 = data.draw(st.integers(c0 + 1, S))
    tile = allowed(L, S, causal=causal, window=window, rows=range(r0, r1), cols=range(c0, c1))
    if tile is not None:
        assert np.array_equal(tile, want[r0:r1, c0:c1])
    # key_range is the contiguous run of allowed keys.
    for i in range(L):
        lo, hi = key_range(S - L + i, S, causal, window)
        row = np.zeros(S, bool)
        row[lo:hi] = True
        assert np.array_equal(row, want[i])


def test_square_causal_is_lower_triangle_and_single_query_sees_all():
    assert np.array_equal(allowed(4, 4, causal=True), np.tril(np.ones((4, 4), bool)))
    assert allowed(1, 7, causal=True).all()
    # L < S: bottom-right alignment (torch's causal_lower_right), not top-left (tril).
    assert np.array_equal(allowed(2, 4, causal=True), np.tril(np.ones((2, 4), bool), k=2))
