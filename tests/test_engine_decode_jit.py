"""The decode kernel with and without the compiled (Numba) path equals the reference.

Every test runs twice: ``jit`` on (skipped without Numba) and ``QKV_JIT=0`` (the NumPy kernel),
and checks which of the two actually ran, so both stay tested whatever is installed.
"""

from __future__ import annotations

import numpy as np
import pytest
from tests.conftest import bound

import qkv
from qkv import reference
from qkv.engine.kernels import decode, router
from qkv.validate import make_plan

TOL = bound("decode step")


@pytest.fixture(params=["jit", "numpy"])
def jit(request, monkeypatch) -> bool:
    if request.param == "jit":
        pytest.importorskip("numba")
        monkeypatch.setenv("QKV_JIT", "1")
        return True
    monkeypatch.setenv("QKV_JIT", "0")
    return False


def _data(rng, B, H, hkv, L, S, d, dv, dtype=np.float64):
    q = rng.standard_normal((B, H, L, d)).astype(dtype)
    k = rng.standard_normal((B, hkv, S, d)).astype(dtype)
    v = rng.standard_normal((B, hkv, S, dv)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("L", [1, 2, 3, 4])
@pytest.mark.parametrize(
    ("causal", "window"), [(True, None), (False, None), (True, (100, None)), (False, (3, 40))]
)
def test_decode_equals_reference(jit, group, L, causal, window):
    rng = np.random.default_rng(group * 100 + L * 10 + causal)
    q, k, v = _data(rng, 2, 8, 8 // group, L, 1037, 24, 7)  # 1037 keys: no whole blocks
    plan = make_plan(q, k, v, causal=causal, window=window)
    # one query row per kv head stays on BLAS's matrix-vector product
    assert router.compiled_decode(plan) is (jit and plan.group * L >= 2)
    got, lse = decode.attend(plan)
    want, want_lse = reference.attention(q, k, v, causal=causal, window=window, return_lse=True)
    np.testing.assert_allclose(got, want, atol=TOL[np.float64])
    np.testing.assert_allclose(lse, want_lse, atol=TOL[np.float64])


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("S", [0, 1, 2, 63, 65, 5000])
@pytest.mark.parametrize("group", [1, 4])
def test_dtypes_and_short_caches(jit, dtype, S, group):
    rng = np.random.default_rng(S + group)
    q, k, v = _data(rng, 2, 8, 8 // group, 1, S, 16, 16, dtype)
    got = qkv.attention(q, k, v, kernel="decode", causal=True)
    assert got.dtype == dtype
    want = reference.attention(q, k, v, causal=True)
    np.testing.assert_allclose(got, want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("d", [64, 128])
def test_float32_head_dims_of_real_models(jit, d):
    rng = np.random.default_rng(d)
    q, k, v = _data(rng, 2, 8, 2, 1, 3001, d, d, np.float32)
    got = qkv.attention(q, k, v, kernel="decode")
    np.testing.assert_allclose(got, reference.attention(q, k, v), atol=TOL[np.float32])


def test_keys_split_over_threads_merge_back(jit):
    rng = np.random.default_rng(5)
    q, k, v = _data(rng, 1, 8, 1, 2, 70_001, 32, 16, np.float32)
    got, lse = decode.attend(make_plan(q, k, v, causal=True), threads=2)
    want, want_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_allclose(got, want, atol=TOL[np.float32])
    np.testing.assert_allclose(lse, want_lse, rtol=TOL[np.float32])


def test_masks_and_variants_fall_back_and_stay_exact(jit):
    """A boolean mask, a bias or soft-capping: the NumPy kernel, whatever QKV_JIT says."""
    rng = np.random.default_rng(6)
    q, k, v = _data(rng, 2, 8, 2, 2, 999, 16, 16)
    mask = rng.random((2, 8, 2, 999)) > 0.3
    for kwargs in ({"mask": mask}, {"mask": mask.astype(float) - 1.0}, {"softcap": 5.0}):
        plan = make_plan(q, k, v, **kwargs)
        assert not router.compiled_decode(plan)
        got = qkv.attention(q, k, v, kernel="decode", **kwargs)
        np.testing.assert_allclose(
            got, reference.attention(q, k, v, **kwargs), atol=TOL[np.float64]
        )


def test_sinks_are_added_after_the_compiled_kernel(jit):
    rng = np.random.default_rng(9)
    q, k, v = _data(rng, 2, 8, 2, 1, 700, 16, 16)
    sinks = rng.standard_normal(8)
    plan = make_plan(q, k, v, sinks=sinks)
    assert router.compiled_decode(plan) is jit
    got = qkv.attention(q, k, v, kernel="decode", sinks=sinks)
    np.testing.assert_allclose(got, reference.attention(q, k, v, sinks=sinks), atol=TOL[np.float64])


def test_row_that_sees_no_key_gives_zero_and_minus_inf(jit):
    """Causal with more queries than keys: the first rows sit before the cache's start."""
    rng = np.random.default_rng(10)
    q, k, v = _data(rng, 1, 4, 2, 4, 2, 8, 8)
    got, lse = decode.attend(make_plan(q, k, v, causal=True))
    want, want_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    assert not got[..., :2, :].any() and (lse[..., :2] == -np.inf).all()
    np.testing.assert_allclose(got, want, atol=TOL[np.float64])
    np.testing.assert_allclose(lse, want_lse, atol=TOL[np.float64])


def test_nan_and_inf_propagate_as_in_the_numpy_kernel(jit, monkeypatch):
    rng = np.random.default_rng(11)
    q, k, v = _data(rng, 2, 8, 2, 2, 1500, 16, 16, np.float32)
    k[0, 0, 100, 3] = np.nan  # every row of kv head 0, batch 0: NaN
    v[1, 1, 700, 5] = np.inf  # column 5 of kv head 1, batch 1: inf or NaN
    k[1, 0, 1499, :] = -np.inf  # a key that only the last row sees, -inf scores for some
    q[0, 5, 1, 2] = np.inf
    with np.errstate(invalid="ignore", over="ignore"):  # as dispatch calls the kernels
        got, lse = decode.attend(make_plan(q, k, v, causal=True))
        monkeypatch.setenv("QKV_JIT", "0")
        want, want_lse = decode.attend(make_plan(q, k, v, causal=True))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(
        got, want, rtol=TOL[np.float32], atol=TOL[np.float32], equal_nan=True
    )
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(want_lse))
    assert np.isnan(got[0, :4]).all() and np.isfinite(got[0, 4:]).any()


def test_non_contiguous_keys_and_values(jit):
    rng = np.random.default_rng(12)
    q, k, v = _data(rng, 2, 8, 2, 1, 800, 16, 16)
    k = np.swapaxes(np.swapaxes(k, -1, -2).copy(), -1, -2)  # column-major rows
    v = v[..., ::-1]
    got = qkv.attention(q, k, v, kernel="decode")
    np.testing.assert_allclose(got, reference.attention(q, k, v), atol=TOL[np.float64])


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_ragged_kvcache_equals_reference_per_sequence(jit, group):
    rng = np.random.default_rng(group)
    lengths = [0, 1, 64, 1037, 3000, 5, 2048]
    hkv, d = 8 // group, 16
    cache = qkv.KVCache(len(lengths), hkv, d, dtype=np.float32)
    for b, n in enumerate(lengths):
        kv = rng.standard_normal((2, hkv, n, d)).astype(np.float32)
        if n:
            cache.append(kv[0], kv[1], seq=b)
    for L in (1, 3):
        q = rng.standard_normal((len(lengths), 8, L, d)).astype(np.float32)
        for b, n in enumerate(lengths):  # the new queries' own keys are in the cache
            if n < L:
                q[b] = 0
        got = cache.attend(q, kernel="decode")
        for b, n in enumerate(lengths):
            if n < L:
                continue
            want = reference.attention(q[b], cache.keys(b), cache.values(b), causal=True)
            np.testing.assert_allclose(
                got[b], want, atol=TOL[np.float32], err_msg=f"seq {b} of {n}"
            )
        assert not got[0].any()  # an empty sequence gives zeros


def test_compiled_kernel_directly_on_rows_with_different_ranges():
    pytest.importorskip("numba")
    from qkv.engine.kernels.jit import decode as compiled

    rng = np.random.default_rng(13)
    R, L, n, d, dv = 6, 3, 200, 5, 3
    q = rng.standard_normal((R, d))
    k, v = rng.standard_normal((n, d)), rng.standard_normal((n, dv))
    lo, hi = np.array([0, 70, 150]), np.array([0, 130, 200])  # row 0 of each query: no key
    out, lse = np.empty((R, dv)), np.empty(R)
    compiled.head(q, k, v, lo, hi, L, out, lse)
    for r in range(R):
        a, b = lo[r % L], hi[r % L]
        if a == b:
            assert not out[r].any() and lse[r] == -np.inf
            continue
        s = k[a:b] @ q[r]
        w = np.exp(s - s.max())
        np.testing.assert_allclose(
            out[r], w @ v[a:b] / w.sum(), atol=bound("closed form", np.float64)
        )
        np.testing.assert_allclose(
            lse[r], s.max() + np.log(w.sum()), atol=bound("closed form", np.float64)
        )


@pytest.mark.parametrize(
    ("B", "group", "L", "kw"),
    [
        (1, 4, 1, {}),  # Llama-style decoding: 16 query heads over 4 kv heads
        (2, 2, 2, {"causal": True}),
        (3, 2, 1, {"causal": True, "window": (300, 0)}),
        (2, 8, 3, {"causal": False, "window": (50, 40)}),
    ],
)
def test_compiled_team_equals_reference_and_runs_on_numba_threads(B, group, L, kw, monkeypatch):
    """Inside ``compiled_team`` (as the transformers backend calls), a compiled decode runs its
    items in one call on Numba's thread team; K/V given as views of a prefix of a larger cache
    (a StaticCache's filled slots) are read in place, and key splits merge back exactly."""
    pytest.importorskip("numba")
    from qkv.engine.kernels import threads
    from qkv.engine.kernels.jit import decode as compiled

    monkeypatch.setenv("QKV_JIT", "1")
    monkeypatch.setattr(decode, "MAX_KEYS", 700)  # several key ranges per head, merged
    calls = []
    inner = compiled.heads

    def spy(q, k, v, *rest):
        calls.append((k, v))
        return inner(q, k, v, *rest)

    monkeypatch.setattr(compiled, "heads", spy)
    rng = np.random.default_rng(31)
    S = 2000
    q, k, v = _data(rng, B, 2 * group, 2, L, S, 16, 12, np.float32)
    big_k = np.zeros((B, 2, S + 37, 16), np.float32)
    big_v = np.zeros((B, 2, S + 37, 12), np.float32)
    big_k[:, :, :S], big_v[:, :, :S] = k, v
    with threads.compiled_team():
        out = qkv.attention(q, big_k[:, :, :S], big_v[:, :, :S], kernel="decode", **kw)
    expect = reference.attention(q.astype(np.float64), k, v, **kw)
    np.testing.assert_allclose(out, expect, rtol=TOL[np.float32], atol=TOL[np.float32])
    assert len(calls) == 1 and decode._team_ready()
    assert np.shares_memory(calls[0][0], big_k) and np.shares_memory(calls[0][1], big_v)
    # without the team: qkv's worker threads, the same numbers
    plain = qkv.attention(q, big_k[:, :, :S], big_v[:, :, :S], kernel="decode", **kw)
    assert len(calls) == 1
    np.testing.assert_allclose(out, plain, atol=bound("rule floor", np.float32))


def test_compiled_team_falls_back_for_memory_it_cannot_read_as_rows(monkeypatch):
    pytest.importorskip("numba")
    from qkv.engine.kernels import threads

    monkeypatch.setenv("QKV_JIT", "1")
    rng = np.random.default_rng(32)
    q, k, v = _data(rng, 1, 4, 2, 1, 900, 8, 8, np.float32)
    k_rev = k[:, :, ::-1]  # negative strides: no row view of it
    k_cols = np.asfortranarray(k)
    assert decode._rows(k_rev) is None and decode._rows(k_cols) is None
    rows, starts = decode._rows(np.zeros((2, 3, 5, 4), np.float32)[:, :, :2])
    assert rows.shape == (15 + 2 * 5 + 1 + 1, 4) and starts.tolist() == [
        [0, 5, 10],
        [15, 20, 25],
    ]
    rows, starts = decode._rows(k)  # C-ordered: one reshape
    assert np.shares_memory(rows, k) and starts.tolist() == [[0, 900]]
    np.testing.assert_array_equal(rows[900:1800], k[0, 1])
    with threads.compiled_team():
        for kk in (k_rev, k_cols):
            out = qkv.attention(q, kk, v, kernel="decode")
            expect = reference.attention(q.astype(np.float64), kk, v)
            np.testing.assert_allclose(out, expect, atol=TOL[np.float32])


def test_compiled_team_serves_a_padded_batch_mask_as_each_sequences_run(monkeypatch):
    """A decoding step's mask that leaves each sequence one run of keys (left padding, a
    static cache's filled slots) is read as those runs, without the mask, in one compiled call;
    a mask with a gap falls back to the masked kernels. Both equal the reference."""
    pytest.importorskip("numba")
    from qkv.engine.kernels import threads
    from qkv.engine.kernels.jit import decode as compiled

    monkeypatch.setenv("QKV_JIT", "1")
    monkeypatch.setenv("QKV_NATIVE", "0")  # the route where the native decode is not built
    calls = []
    inner = compiled.heads
    monkeypatch.setattr(compiled, "heads", lambda *a: (calls.append(a[3].copy()), inner(*a))[1])
    rng = np.random.default_rng(33)
    B, S = 4, 3000
    q, k, v = _data(rng, B, 8, 2, 1, S, 16, 8, np.float32)
    mask = np.zeros((B, 1, 1, S), bool)
    for b, (lo, hi) in enumerate([(0, S), (500, S), (1000, 2999), (2990, S)]):
        mask[b, ..., lo:hi] = True
    for gap in (False, True):
        if gap:
            mask[1, ..., 700] = False
        with threads.compiled_team():
            out = qkv.attention(q, k, v, mask=mask)
        expect = reference.attention(q.astype(np.float64), k, v, mask=mask)
        np.testing.assert_allclose(out, expect, rtol=TOL[np.float32], atol=TOL[np.float32])
        assert len(calls) == 1  # the gap: not the runs path
    entries = calls[0]
    assert entries[:, 3].min() >= 0 and entries[:, 4].max() <= S
    # sequence 3 (kv heads 6 and 7) reads only its last 10 keys
    assert entries[entries[:, 1] >= 6 * S][:, 3:].min() == 2990
