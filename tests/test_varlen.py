"""attention_varlen: each packed sequence equals attention on it alone (reference, qkv, torch)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.conftest import bound

import qkv
from qkv import reference

TOL = bound("packed walk")


def packed(rng, lq, lk, heads, kv_heads, d, dv, dtype=np.float64):
    cq, ck = (np.concatenate([[0], np.cumsum(x, dtype=np.int64)]) for x in (lq, lk))
    q = rng.standard_normal((cq[-1], heads, d)).astype(dtype)
    k = rng.standard_normal((ck[-1], kv_heads, d)).astype(dtype)
    v = rng.standard_normal((ck[-1], kv_heads, dv)).astype(dtype)
    return q, k, v, cq, ck


def per_sequence(fn, q, k, v, cq, ck, **kw):
    """Run ``fn`` on each sequence alone (heads first), packed back: output and lse."""
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]))
    lse = np.full(q.shape[:2], -np.inf)
    for b in range(len(cq) - 1):
        qs = q[cq[b] : cq[b + 1]].transpose(1, 0, 2)
        ks = k[ck[b] : ck[b + 1]].transpose(1, 0, 2)
        vs = v[ck[b] : ck[b + 1]].transpose(1, 0, 2)
        o, s = fn(qs, ks, vs, return_lse=True, **kw)
        out[cq[b] : cq[b + 1]] = o.transpose(1, 0, 2)
        lse[cq[b] : cq[b + 1]] = s.T
    return out, lse


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_equals_reference_per_sequence_with_grouped_heads(group, causal):
    rng = np.random.default_rng(group)
    lq = [5, 0, 1, 13, 37, 3, 1, 70, 0, 29]
    lk = [5, 4, 1, 13, 41, 0, 9, 70, 0, 29]  # L < S, L == S, no keys, no queries
    q, k, v, cq, ck = packed(rng, lq, lk, 8, 8 // group, 6, 5)
    out, lse = qkv.attention_varlen(q, k, v, cq, ck, causal=causal, return_lse=True)
    want, want_lse = per_sequence(reference.attention, q, k, v, cq, ck, causal=causal)
    np.testing.assert_allclose(out, want, atol=TOL[np.float64])
    np.testing.assert_allclose(lse, want_lse, atol=TOL[np.float64])


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("window", [(3, 0), (None, 2), (7, 7)])
def test_windows_and_dtypes_equal_per_sequence_attention(dtype, window):
    rng = np.random.default_rng(3)
    lq, lk = [1, 17, 4, 33, 2], [1, 17, 20, 33, 50]
    q, k, v, cq, ck = packed(rng, lq, lk, 4, 2, 8, 8, dtype)
    out = qkv.attention_varlen(q, k, v, cq, ck, causal=True, window=window, scale=0.3)
    assert out.dtype == dtype
    want, _ = per_sequence(qkv.attention, q, k, v, cq, ck, causal=True, window=window, scale=0.3)
    ref, _ = per_sequence(
        reference.attention, q, k, v, cq, ck, causal=True, window=window, scale=0.3
    )
    np.testing.assert_allclose(out, want, atol=TOL[dtype])
    np.testing.assert_allclose(out, ref, atol=bound("packed walk, reference", dtype))


def test_many_short_sequences_in_few_buckets_equal_reference():
    rng = np.random.default_rng(4)
    lens = rng.integers(0, 60, size=200)
    q, k, v, cq, ck = packed(rng, lens, lens, 4, 1, 8, 8)
    got = qkv.attention_varlen(q, k, v, cq, ck, causal=True)
    want, _ = per_sequence(reference.attention, q, k, v, cq, ck, causal=True)
    np.testing.assert_allclose(got, want, atol=TOL[np.float64])
    assert (
        len(qkv.engine.varlen._buckets(lens, lens, 4 * 2 * 16)) < 30
    )  # grouped, not one call per sequence


def test_decode_rows_against_long_caches():
    """One query per sequence against caches of different lengths (the decode kernel)."""
    rng = np.random.default_rng(5)
    lq, lk = [1] * 6, [300, 1, 0, 1029, 517, 2]
    q, k, v, cq, ck = packed(rng, lq, lk, 8, 2, 16, 16, np.float32)
    got = qkv.attention_varlen(q, k, v, cq, ck, causal=True)
    want, _ = per_sequence(reference.attention, q, k, v, cq, ck, causal=True)
    np.testing.assert_allclose(got, want, atol=bound("split keys", np.float32))


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)), min_size=0, max_size=8),
    st.sampled_from([1, 2, 4]),
    st.booleans(),
)
def test_property_equals_reference(lengths, group, causal):
    rng = np.random.default_rng(len(lengths))
    lq = [a for a, _ in lengths]
    lk = [b for _, b in lengths]
    q, k, v, cq, ck = packed(rng, lq, lk, 4, 4 // group, 3, 2)
    got, lse = qkv.attention_varlen(q, k, v, cq, ck, causal=causal, return_lse=True)
    want, want_lse = per_sequence(reference.attention, q, k, v, cq, ck, causal=causal)
    np.testing.assert_allclose(got, want, atol=TOL[np.float64])
    np.testing.assert_allclose(lse, want_lse, atol=TOL[np.float64])
    assert got.shape == (sum(lq), 4, 2)


def test_equals_torch_sdpa_causal_lower_right_per_sequence():
    torch = pytest.importorskip("torch")
    from torch.nn.attention.bias import causal_lower_right

    rng = np.random.default_rng(6)
    lq, lk = [3, 1, 8, 20], [9, 5, 8, 31]
    q, k, v, cq, ck = packed(rng, lq, lk, 4, 2, 8, 8)
    got = qkv.attention_varlen(q, k, v, cq, ck, causal=True)
    for b in range(4):
        qs, ks, vs = (
            torch.from_numpy(np.ascontiguousarray(x.transpose(1, 0, 2)))[None]
            for x in (q[cq[b] : cq[b + 1]], k[ck[b] : ck[b + 1]], v[ck[b] : ck[b + 1]])
        )
        want = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=causal_lower_right(lq[b], lk[b]), enable_gqa=True
        )
        np.testing.assert_allclose(
            got[cq[b] : cq[b + 1]], want[0].numpy().transpose(1, 0, 2), atol=TOL[np.float64]
        )


def test_empty_batch_and_no_rows():
    q, k, v = np.zeros((0, 2, 4)), np.zeros((0, 1, 4)), np.zeros((0, 1, 3))
    out, lse = qkv.attention_varlen(q, k, v, [0], [0], return_lse=True)
    assert out.shape == (0, 2, 3) and lse.shape == (0, 2)
    out = qkv.attention_varlen(np.ones((2, 2, 4)), k, v, [0, 2], [0, 0])
    assert out.tolist() == np.zeros((2, 2, 3)).tolist()


@pytest.mark.parametrize(
    ("args", "kw", "exc", "words"),
    [
        (
            (np.ones((3, 4)), np.ones((3, 1, 4)), np.ones((3, 1, 4)), [0, 3], [0, 3]),
            {},
            qkv.InputError,
            "q: expected shape (total_q, heads, d)",
        ),
        (
            (np.ones((3, 3, 4)), np.ones((3, 2, 4)), np.ones((3, 2, 4)), [0, 3], [0, 3]),
            {},
            qkv.InputError,
            "3 query heads cannot share 2 kv heads",
        ),
        (
            (np.ones((3, 2, 4)), np.ones((3, 1, 5)), np.ones((3, 1, 4)), [0, 3], [0, 3]),
            {},
            qkv.InputError,
            "q, k: feature size d",
        ),
        (
            (np.ones((3, 2, 4)), np.ones((3, 1, 4)), np.ones((2, 1, 4)), [0, 3], [0, 3]),
            {},
            qkv.InputError,
            "k, v:",
        ),
        (
            (np.ones((3, 2, 4)), np.ones((3, 1, 4)), np.ones((3, 1, 4)), [0, 2], [0, 3]),
            {},
            qkv.InputError,
            "cu_seqlens_q: must end at total_q = 3",
        ),
        (
            (np.ones((3, 2, 4)), np.ones((3, 1, 4)), np.ones((3, 1, 4)), [0, 3], [1, 3]),
            {},
            qkv.InputError,
            "cu_seqlens_k: must start at 0",
        ),
        (
            (
                np.ones((3, 2, 4)),
                np.ones((3, 1, 4)),
                np.ones((3, 1, 4)),
                [0, 2, 1, 3],
                [0, 1, 2, 3],
            ),
            {},
            qkv.InputError,
            "cu_seqlens_q: must be non-decreasing",
        ),
        (
            (np.ones((3, 2, 4)), np.ones((3, 1, 4)), np.ones((3, 1, 4)), [0, 3], [0, 1, 3]),
            {},
            qkv.InputError,
            "batch sizes differ",
        ),
        (
            (np.ones((3, 2, 4)), np.ones((3, 1, 4)), np.ones((3, 1, 4)), [0.0, 3.0], [0, 3]),
            {},
            qkv.InputTypeError,
            "cu_seqlens_q: expected integer offsets",
        ),
        (
            (np.ones((3, 2, 4)), np.ones((3, 1, 4)), np.ones((3, 1, 4)), [0, 3], [0, 3]),
            {"scale": -1.0},
            qkv.InputError,
            "scale",
        ),
        (
            (np.ones((3, 2, 4)), np.ones((3, 1, 4)), np.ones((3, 1, 4)), [0, 3], [0, 3]),
            {"window": (-1, 2)},
            qkv.InputError,
            "window",
        ),
        (
            (np.ones((3, 2, 4)), np.ones((3, 1, 4)), np.ones((3, 1, 4)), [0, 3], [0, 3]),
            {"causal": "yes"},
            qkv.InputTypeError,
            "causal",
        ),
    ],
)
def test_bad_input_names_the_argument(args, kw, exc, words):
    with pytest.raises(exc, match=None) as info:
        qkv.attention_varlen(*args, **kw)
    assert words in str(info.value)


@pytest.mark.parametrize("cu", [[0, 2**70, 12], [0, -(2**64), 12]])
def test_offsets_beyond_int64_are_named_as_out_of_range(cu):
    x = np.ones((12, 1, 2))
    with pytest.raises(
        qkv.InputError, match=r"cu_seqlens_q: offset -?\d+ is out of the int64 range"
    ):
        qkv.attention_varlen(x, x, x, cu, [0, 12])


def test_bfloat16_input_of_the_wrong_rank_is_named():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q = np.array(1.0, dtype=ml_dtypes.bfloat16)
    with pytest.raises(qkv.InputError, match=r"q: expected shape \(total_q, heads, d\), got \(\)"):
        qkv.attention_varlen(q, np.ones((3, 1, 2)), np.ones((3, 1, 2)), [0, 3], [0, 3])


# --- a decoding batch: one query per sequence, on the native decode step ---

_DECODE_TOL = {"float64": 1e-10, "float32": 2e-5, "float16": 2e-3, "bfloat16": 2e-2}


def _taken(monkeypatch):
    """The results the decode step gave attention_varlen (None: not finite, the walks ran)."""
    from qkv.engine import varlen

    given_back = []
    step = varlen.decode_steps

    def spy(*args, **kwargs):
        given_back.append(step(*args, **kwargs))
        return given_back[-1]

    monkeypatch.setattr(varlen, "decode_steps", spy)
    return given_back


def _native_decode() -> bool:
    from qkv.engine.kernels import native_decode

    return native_decode.available()


@settings(max_examples=40, deadline=None)
@given(
    lk=st.lists(st.integers(1, 300), min_size=1, max_size=6),
    group=st.sampled_from([1, 2, 4]),
    kv_heads=st.integers(1, 3),
    d=st.sampled_from([8, 64, 128]),
    dv_same=st.booleans(),
    dtype=st.sampled_from(["float64", "float32", "float16", "bfloat16"]),
    causal=st.booleans(),
    window=st.sampled_from([None, (0, None), (5, None), (40, 0), (None, 3)]),
    scale=st.sampled_from([None, 0.05]),
    seed=st.integers(0, 2**16),
)
def test_a_decoding_batch_equals_the_reference_on_the_decode_step(
    lk, group, kv_heads, d, dv_same, dtype, causal, window, scale, seed
):
    import ml_dtypes

    from qkv.engine import varlen

    rng = np.random.default_rng(seed)
    lq = [1] * len(lk)
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    q, k, v, cq, ck = packed(rng, lq, lk, kv_heads * group, kv_heads, d, d if dv_same else 16, dt)
    calls = []
    step = varlen.decode_steps
    varlen.decode_steps = lambda *a, **kw: calls.append(step(*a, **kw)) or calls[-1]
    try:
        out, lse = qkv.attention_varlen(
            q, k, v, cq, ck, causal=causal, window=window, scale=scale, return_lse=True
        )
    finally:
        varlen.decode_steps = step
    if _native_decode():
        assert len(calls) == 1 and calls[0] is not None, "the decode step did not serve it"
    assert out.dtype == np.result_type(q, k, v)
    wide = [x.astype(np.float64) for x in (q, k, v)]
    kw = dict(causal=causal, window=window, scale=scale)
    want, want_lse = per_sequence(reference.attention, *wide, cq, ck, **kw)
    tol = _DECODE_TOL[dtype]
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse, want_lse, rtol=tol, atol=tol)


def test_sequences_of_one_query_and_some_keys_take_the_decode_step():
    from qkv.engine.kernels import router

    q = np.zeros((3, 4, 8), np.float32)
    k = np.zeros((9, 2, 8), np.float32)
    f32, name, keys = np.dtype(np.float32), "native decode step", np.array([3, 3, 3])
    ask = {
        "one each": (np.ones(3, np.int64), keys),
        "mixed": (np.array([1, 2, 1]), keys),
        "none of one": (np.array([2, 2, 0]), keys),
        "one but no keys": (np.array([1, 2, 1]), np.array([0, 4, 0])),
    }
    got = {what: router.packed(q, k, k, f32, rows).name == name for what, rows in ask.items()}
    on = _native_decode()
    assert got == {"one each": on, "mixed": on, "none of one": False, "one but no keys": False}
    assert router.packed(q, k, k, f32).name != name  # (rows not asked)
    k16 = k.astype(np.float16)  # 16-bit K/V are read as stored in float32 only
    assert router.packed(q, k16, k16, np.dtype(np.float64), ask["one each"]).name != name


@settings(max_examples=30, deadline=None)
@given(
    lq=st.lists(st.sampled_from([0, 1, 1, 2, 7]), min_size=1, max_size=7),
    extra=st.lists(st.integers(0, 90), min_size=7, max_size=7),
    group=st.sampled_from([1, 4]),
    dtype=st.sampled_from(["float64", "float32", "bfloat16"]),
    causal=st.booleans(),
    window=st.sampled_from([None, (3, None), (20, 2)]),
    seed=st.integers(0, 2**16),
)
def test_a_mixed_batch_splits_its_decoding_steps_off(lq, extra, group, dtype, causal, window, seed):
    import ml_dtypes

    from qkv.engine import varlen

    lk = [a + b for a, b in zip(lq, extra, strict=False)]  # some sequences with no key
    rng = np.random.default_rng(seed)
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    q, k, v, cq, ck = packed(rng, lq, lk, 2 * group, 2, 16, 16, dt)
    served = []
    step = varlen.decode_steps
    varlen.decode_steps = lambda *a, **kw: served.append(a[3]) or step(*a, **kw)
    try:
        out, lse = qkv.attention_varlen(
            q, k, v, cq, ck, causal=causal, window=window, return_lse=True
        )
    finally:
        varlen.decode_steps = step
    ones = [cq[b] for b in range(len(lq)) if lq[b] == 1 and lk[b] >= 1]
    if _native_decode() and ones:
        assert len(served) == 1 and served[0].tolist() == ones
    wide = [x.astype(np.float64) for x in (q, k, v)]
    want, want_lse = per_sequence(reference.attention, *wide, cq, ck, causal=causal, window=window)
    tol = _DECODE_TOL[dtype]
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse, want_lse, rtol=tol, atol=tol)


def test_a_decoding_batch_that_overflows_goes_back_to_the_walks(monkeypatch):
    given_back = _taken(monkeypatch)
    rng = np.random.default_rng(5)
    q, k, v, cq, ck = packed(rng, [1, 1], [30, 12], 4, 2, 8, 8, np.float32)
    k[:30, 1] = 0  # sequence 0, kv head 1: every weight 1 before the division by their sum...
    v[3:5, 1, 0] = np.float32(3e38)  # ... whose values' sum is past float32's largest
    out, lse = qkv.attention_varlen(q, k, v, cq, ck, return_lse=True)
    if _native_decode():
        assert given_back == [None], "the decode step did not give the overflow back"
    want, want_lse = per_sequence(
        reference.attention, *(x.astype(np.float64) for x in (q, k, v)), cq, ck
    )
    assert np.isfinite(out).all() and out[0, 2, 0] > 1e37
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
