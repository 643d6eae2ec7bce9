"""Grouped-query decode and ragged KVCache.attend equal the reference (group sizes 1/2/4/8)."""

from __future__ import annotations

import numpy as np
import pytest
from tests.conftest import bound

import qkv
from qkv import reference
from qkv.engine.kernels import decode, dispatch
from qkv.validate import make_plan

TOL = bound("decode step")


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("L", [1, 2, 3])
@pytest.mark.parametrize("window", [None, (100, None)])
def test_grouped_decode_equals_reference_on_sizes_that_do_not_divide(group, L, window):
    rng = np.random.default_rng(group * 10 + L)
    B, H, S, d = 3, 8, 1037, 24  # S and d divide no piece or item size
    q = rng.standard_normal((B, H, L, d))
    k = rng.standard_normal((B, H // group, S, d))
    v = rng.standard_normal((B, H // group, S, 7))
    got, lse = qkv.attention(q, k, v, causal=True, window=window, kernel="decode", return_lse=True)
    want, want_lse = reference.attention(q, k, v, causal=True, window=window, return_lse=True)
    np.testing.assert_allclose(got, want, atol=TOL[np.float64])
    np.testing.assert_allclose(lse, want_lse, atol=TOL[np.float64])


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("S", [0, 1, 2, 5000])
def test_grouped_decode_dtypes_and_lengths_zero_and_one(dtype, S):
    rng = np.random.default_rng(S)
    q = rng.standard_normal((2, 8, 1, 16)).astype(dtype)
    k, v = (rng.standard_normal((2, 2, S, 16)).astype(dtype) for _ in range(2))
    got = qkv.attention(q, k, v, kernel="decode")
    assert got.dtype == dtype
    want = reference.attention(q, k, v)
    np.testing.assert_allclose(got, want, atol=TOL[dtype], rtol=TOL[dtype])


def test_split_keys_on_one_sequence_still_serve_the_whole_group():
    """One sequence, one kv head: the keys split over the threads and merge back."""
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, 4, 1, 32)).astype(np.float32)
    k, v = (rng.standard_normal((1, 1, 70_000, 32)).astype(np.float32) for _ in range(2))
    got = decode.attend(make_plan(q, k, v), threads=2)[0]
    np.testing.assert_allclose(
        got, reference.attention(q, k, v), atol=bound("split keys", np.float32)
    )


def test_attend_many_equals_one_call_per_plan():
    rng = np.random.default_rng(8)
    plans = [
        make_plan(
            rng.standard_normal((2, 4, L, 8)),
            rng.standard_normal((2, 1, S, 8)),
            rng.standard_normal((2, 1, S, 8)),
            causal=True,
        )
        for L, S in ((1, 300), (2, 0), (1, 1), (3, 4100))
    ]
    for (o, s), plan in zip(decode.attend_many(plans), plans, strict=True):
        want, want_lse = reference.attention(plan.q, plan.k, plan.v, causal=True, return_lse=True)
        np.testing.assert_allclose(o, want, atol=TOL[np.float64])
        np.testing.assert_allclose(s, want_lse, atol=TOL[np.float64])


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_ragged_cache_attend_equals_reference_per_sequence(group, dtype, monkeypatch):
    monkeypatch.setattr(dispatch.router, "DECODE_MIN_BYTES", 1)  # auto picks decode for the batch
    rng = np.random.default_rng(group)
    lengths = [0, 1, 517, 2, 1300, 517, 64]
    H, d = 8, 16
    cache = qkv.KVCache(len(lengths), H // group, d, dtype=dtype)
    for b, n in enumerate(lengths):
        if n:
            kv = rng.standard_normal((2, H // group, n, d))
            cache.append(kv[0], kv[1], seq=b)
    q = rng.standard_normal((len(lengths), H, 1, d)).astype(dtype)
    out, lse = cache.attend(q, window=(400, None), return_lse=True)
    for b in range(len(lengths)):
        want, want_lse = reference.attention(
            q[b], cache.keys(b), cache.values(b), causal=True, window=(400, None), return_lse=True
        )
        np.testing.assert_allclose(out[b], want, atol=TOL[dtype], rtol=TOL[dtype])
        np.testing.assert_allclose(lse[b], want_lse, atol=TOL[dtype], rtol=TOL[dtype])


def test_dispatch_many_picks_decode_for_many_small_caches_together(monkeypatch):
    calls = []
    real = decode.attend_many
    monkeypatch.setattr(
        decode, "attend_many", lambda plans: calls.append(len(plans)) or real(plans)
    )
    monkeypatch.setattr(dispatch.router, "DECODE_MIN_BYTES", 5000)  # 2560 + 4608 bytes
    plans = [make_plan(np.ones((4, 1, 8)), np.ones((4, n, 8)), np.ones((4, n, 8))) for n in (5, 9)]
    # alone, each would be dense (or the native step): not the NumPy decode kernel
    assert dispatch.choose(plans[0]).kernel in ("dense", "native decode")
    dispatch.attend_many(plans)
    assert calls == [2]
