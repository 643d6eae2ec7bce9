"""Keys and values stored in fewer bytes: the forms' reference, the native decode step that
reads them in place, and the KV cache that stores them.

Tolerance rule: the kernel computes in float32 from the stored values, so it must equal the
float64 reference applied to :func:`qkv.dequantize_kv`'s values to float32 rounding (a few
units of 2^-24 of the output's scale, summed over the keys): the tolerance table's
``fast path`` row for float32, ``F32`` below. What storing
costs against unquantized float32 K/V is a property of the form, bounded separately.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.conftest import bound

import qkv
from qkv import reference
from qkv.engine.kernels import native_bf16, native_decode
from qkv.engine.quant import _e4m3_bits, _e4m3_values, storage_dtype

FORMS = ["bfloat16", "float16", "int8", "float8_e4m3fn"]
ISAS = [1, 2, 3]  # capped by the CPU: a clone it cannot run falls back to a narrower one
# and AVX-512 with AVX512_BF16 (native_bf16.ISA): bfloat16 keys' scores on vdpbf16ps for query
# rows of bfloat16 values (elsewhere the AVX-512 clone, or narrower)
STEP_ISAS = [*ISAS, 4]
F32 = bound("fast path", np.float32)  # float32 compute against the float64 reference
native = pytest.mark.skipif(
    not native_decode.available(), reason="native kernels not built (or QKV_NATIVE=0)"
)


def _dequantized(x, form):
    return qkv.dequantize_kv(*qkv.quantize_kv(x, form), form).astype(np.float64)


def _bf16_values(x):
    """float32 ``x`` cut to bfloat16 values (the low 16 bits of each float32 cleared)."""
    return (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


# --- the forms' reference ------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
def test_round_trip_error_is_within_the_forms_step(form):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 5, 64)) * rng.uniform(0.01, 100, (3, 5, 1))).astype(np.float32)
    codes, scales = qkv.quantize_kv(x, form)
    assert codes.dtype == storage_dtype(form) and codes.shape == x.shape
    back = qkv.dequantize_kv(codes, scales, form)
    assert back.dtype == np.float32
    top = np.abs(x).max(axis=-1, keepdims=True)
    # half a step of each form: relative 2^-8 (bfloat16), 2^-11 (float16), of the row's
    # largest value 1/254 (int8), relative 2^-4 of the value (e4m3fn, 3 mantissa bits)
    bound = {
        "bfloat16": np.abs(x) * 2.0**-8,
        "float16": np.abs(x) * 2.0**-11 + 1e-7,
        "int8": top / 254 * (1 + 1e-6),
        "float8_e4m3fn": np.abs(x) * 2.0**-4 + top / 448 * 2.0**-9,
    }[form]
    assert np.all(np.abs(back - x) <= bound + 1e-30)
    if scales is not None:
        assert scales.shape == x.shape[:-1]
        np.testing.assert_allclose(scales, top[..., 0] / (127 if form == "int8" else 448))


def test_e4m3_codes_match_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is the peer for float8")
    rng = np.random.default_rng(1)
    y = np.concatenate(
        [
            rng.uniform(-448, 448, 20000),
            rng.standard_normal(20000) * 1e-2,
            np.linspace(-448, 448, 4001),
        ]
    ).astype(np.float32)
    np.testing.assert_array_equal(_e4m3_bits(y), y.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    codes = np.arange(256, dtype=np.uint8)
    theirs = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = np.isfinite(theirs)  # 0x7f and 0xff are NaN in e4m3fn: never produced
    np.testing.assert_array_equal(_e4m3_values(codes)[finite], theirs[finite])


def test_bfloat16_codes_match_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is the peer for bfloat16")
    x = np.random.default_rng(2).standard_normal(50000).astype(np.float32) * 1e3
    codes, _ = qkv.quantize_kv(x, "bfloat16")
    np.testing.assert_array_equal(codes, x.astype(ml_dtypes.bfloat16).view(np.uint16))


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: qkv.quantize_kv(np.ones(4), "int4"), qkv.InputTypeError, "dtype: expected one of"),
        (lambda: qkv.quantize_kv([np.inf, 1.0], "int8"), qkv.InputError, "finite values"),
        (lambda: qkv.quantize_kv(np.array(["a"]), "int8"), qkv.InputTypeError, "real numbers"),
        (
            lambda: qkv.dequantize_kv(np.ones((2, 4), np.int8), None, "int8"),
            qkv.InputError,
            r"scales: .*need their scales",
        ),
        (
            lambda: qkv.dequantize_kv(np.ones((2, 4), np.int8), np.ones(3), "int8"),
            qkv.InputError,
            r"scales: expected shape \(2,\)",
        ),
        (
            lambda: qkv.dequantize_kv(np.ones((2, 4), np.float32), None, "bfloat16"),
            qkv.InputTypeError,
            "codes: bfloat16 codes are uint16",
        ),
        (lambda: qkv.KVCache(1, 1, 4, dtype="int4"), qkv.InputTypeError, "dtype: expected"),
    ],
)
def test_bad_forms_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


# --- the native decode step on stored K/V --------------------------------------------------


@native
@settings(max_examples=40, deadline=None)
@given(
    form=st.sampled_from(FORMS),
    d=st.sampled_from([16, 40, 64, 128]),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 4),
    L=st.integers(1, 3),
    S=st.integers(1, 700),
    batch=st.integers(1, 3),
    isa=st.sampled_from(STEP_ISAS),
    threads=st.integers(1, 2),
    softcap=st.sampled_from([None, 20.0]),
    q_bf16=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_native_step_equals_reference_on_stored_values(
    form, d, kv_heads, group, L, S, batch, isa, threads, softcap, q_bf16, seed
):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, kv_heads * group, L, d)).astype(np.float32)
    if q_bf16:  # a bfloat16 model's queries: bfloat16 values (vdpbf16ps's road, isa 4)
        q = _bf16_values(q)
    _step_equals_reference(rng, q, kv_heads, S, form, isa=isa, threads=threads, softcap=softcap)


@native
@settings(max_examples=30, deadline=None)
@given(
    d=st.sampled_from([64, 128, 96]),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 6),
    L=st.integers(1, 3),
    S=st.integers(1, 600),
    batch=st.integers(1, 2),
    threads=st.integers(1, 2),
    softcap=st.sampled_from([None, 20.0]),
    form=st.sampled_from(["bfloat16", "int8", "float8_e4m3fn"]),
    seed=st.integers(0, 2**16),
)
def test_bfloat16_queries_on_bfloat16_and_8_bit_keys_equal_reference(
    d, kv_heads, group, L, S, batch, threads, softcap, form, seed
):
    """The road of a bfloat16 model's step: bfloat16 query values against bfloat16 K/V, or an
    8-bit cache's codes (on vdpbf16ps where the CPU has AVX512_BF16, for head sizes 64 and 128;
    rows of any size and count, ragged runs of keys), the reference's numbers on the same
    values."""
    rng = np.random.default_rng(seed)
    q = _bf16_values(rng.standard_normal((batch, kv_heads * group, L, d)).astype(np.float32))
    _step_equals_reference(rng, q, kv_heads, S, form, threads=threads, softcap=softcap)


def _step_equals_reference(rng, q, kv_heads, S, form, **step):
    """Random K/V (``kv_heads`` heads of S keys) stored in ``form`` for queries ``q (batch,
    heads, L, d)``, each sequence a random run of keys: the native step's ``out`` and ``lse``
    equal the float64 reference's on the stored values to float32 rounding."""
    batch, _, _, d = q.shape
    k = (rng.standard_normal((batch, kv_heads, S, d)) * 2).astype(np.float32)
    v = rng.standard_normal((batch, kv_heads, S, d)).astype(np.float32)
    (kc, ks), (vc, vs) = qkv.quantize_kv(k, form), qkv.quantize_kv(v, form)
    lo = rng.integers(0, S, batch).astype(np.int64)
    hi = (lo + rng.integers(1, S - lo + 1)).astype(np.int64)
    got = native_decode.step(
        q, kc, vc, d**-0.5, lo, hi, kv_format=form, k_scale=ks, v_scale=vs, **step
    )
    assert got is not None
    kd, vd = (qkv.dequantize_kv(c, s, form).astype(np.float64) for c, s in ((kc, ks), (vc, vs)))
    for b in range(batch):
        keep = np.zeros(S, bool)
        keep[lo[b] : hi[b]] = True
        want, want_lse = reference.attention(
            q[b].astype(np.float64), kd[b], vd[b], mask=keep, softcap=step.get("softcap"),
            return_lse=True,
        )  # fmt: skip
        np.testing.assert_allclose(got[0][b], want, atol=F32, rtol=F32)
        np.testing.assert_allclose(got[1][b], want_lse, atol=F32, rtol=F32)


@native
@pytest.mark.parametrize("isa", STEP_ISAS)
def test_bfloat16_scores_keep_subnormal_queries_against_large_keys(isa):
    """A subnormal query value against keys near bfloat16's top makes a score of order one.
    vdpbf16ps reads subnormal operands as 0, so rows holding one take the widening road: the
    reference's numbers, not a uniform softmax."""
    rng = np.random.default_rng(11)
    d, S = 128, 200
    q = np.full((1, 4, 1, d), 2.0**-130, np.float32)  # bfloat16 values, all subnormal
    q[0, 1] *= -1.0
    k = rng.choice([-1.0, 1.0], (1, 1, S, d)) * rng.integers(1, 9, (1, 1, S, d)) * 2.0**123
    v = rng.standard_normal((1, 1, S, d))
    kc, _ = qkv.quantize_kv(k.astype(np.float32), "bfloat16")
    vc, _ = qkv.quantize_kv(v.astype(np.float32), "bfloat16")
    out, _ = native_decode.step(q, kc, vc, d**-0.5, kv_format="bfloat16", isa=isa, threads=2)
    kd, vd = (qkv.dequantize_kv(c, None, "bfloat16").astype(np.float64) for c in (kc, vc))
    want = reference.attention(q.astype(np.float64), kd, vd)
    assert np.ptp(want[0, 0, 0]) > 0.1  # the scores are far from equal
    np.testing.assert_allclose(out, want, atol=F32, rtol=F32)


@native
@pytest.mark.skipif(not native_bf16.available(), reason="needs AVX512_BF16 (vdpbf16ps) on this CPU")
@pytest.mark.parametrize("form", ["bfloat16", "int8", "float8_e4m3fn"])
def test_bfloat16_queries_take_the_dot_product_road(form):
    """With AVX512_BF16, bfloat16 query rows against bfloat16 keys or 8-bit codes are scored by
    vdpbf16ps (isa 4, the default), float32 ones by the widening FMAs: both the reference's
    numbers, and the two roads' sums (in different orders) not the same bits."""
    rng = np.random.default_rng(12)
    q = _bf16_values(rng.standard_normal((2, 8, 1, 128)).astype(np.float32))
    (k, ks), (v, vs) = (qkv.quantize_kv(x, form) for x in rng.standard_normal((2, 2, 2, 500, 128)))
    kd, vd = (qkv.dequantize_kv(c, sc, form).astype(np.float64) for c, sc in ((k, ks), (v, vs)))
    want = reference.attention(q.astype(np.float64), kd, vd)
    outs = {}
    for isa in (0, 3, 4):
        outs[isa], _ = native_decode.step(
            q, k, v, 128**-0.5, kv_format=form, k_scale=ks, v_scale=vs, isa=isa
        )
        np.testing.assert_allclose(outs[isa], want, atol=F32, rtol=F32)
    np.testing.assert_array_equal(outs[0], outs[4])  # the default is the dot-product road
    assert not np.array_equal(outs[3], outs[4])


@native
def test_native_step_reads_ml_dtypes_bfloat16_and_float16_arrays():
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="NumPy's bfloat16 comes from ml_dtypes")
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 4, 1, 64)).astype(np.float32)
    k, v = rng.standard_normal((2, 2, 2, 300, 64))
    for dt in (ml_dtypes.bfloat16, np.float16):
        kk, vv = k.astype(dt), v.astype(dt)
        out, _ = native_decode.step(q, kk, vv, 0.125)
        want = reference.attention(q, kk.astype(np.float64), vv.astype(np.float64), scale=0.125)
        np.testing.assert_allclose(out, want, atol=F32)
    # a float64 compute reads float64 only; an 8-bit form needs its scales
    assert native_decode.step(q.astype(np.float64), k.astype(np.float16), v, 0.1) is None
    codes, _ = qkv.quantize_kv(k, "int8")
    assert native_decode.step(q, codes, codes, 0.1, kv_format="int8") is None


@native
@pytest.mark.parametrize("isa", ISAS)
def test_native_step_widens_every_float16_code(isa):
    """Every finite float16 code as a key, and every subnormal one as a value, through the
    clone's own widening (F16C's conversion on AVX-512 and AVX2, integer operations on the
    baseline): the reference's numbers on the same values."""
    rng = np.random.default_rng(5)
    codes = np.arange(2**16, dtype=np.uint16)
    finite = rng.permutation(codes[(codes & 0x7C00) != 0x7C00])  # 63488 = 496 x 128 codes
    k = finite.view(np.float16).reshape(1, 1, 496, 128)
    sub = codes[((codes & 0x7C00) == 0) & ((codes & 0x3FF) != 0)]  # 2046 subnormal codes
    q = (rng.standard_normal((1, 2, 1, 128)) * 1e-6).astype(np.float32)
    for v in (rng.choice(sub, (1, 1, 496, 128)).view(np.float16), k[..., ::-1, :].copy()):
        out, lse = native_decode.step(q, k, v, 1.0, isa=isa, threads=2)
        want, want_lse = reference.attention(
            q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), scale=1.0,
            return_lse=True,
        )  # fmt: skip
        top = float(np.abs(v.astype(np.float64)).max())
        np.testing.assert_allclose(out, want, rtol=F32, atol=F32 * top)
        np.testing.assert_allclose(lse, want_lse, rtol=F32, atol=F32)


@native
@pytest.mark.parametrize("isa", ISAS)
def test_native_step_widens_every_e4m3_code(isa):
    """Every float8 e4m3fn code but NaN, subnormal ones included, as keys and as values (with
    scales per token) through each clone: the reference on :func:`qkv.dequantize_kv`'s values."""
    rng = np.random.default_rng(6)
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)  # 254
    kc = rng.permutation(np.tile(codes, 64)).reshape(1, 1, 127, 128)
    vc = rng.permutation(np.tile(codes, 64)).reshape(1, 1, 127, 128)
    ks, vs = (rng.uniform(1e-4, 1e-2, (1, 1, 127)).astype(np.float32) for _ in "kv")
    q = rng.standard_normal((1, 3, 1, 128)).astype(np.float32)
    out, lse = native_decode.step(
        q, kc, vc, 0.1, kv_format="float8_e4m3fn", k_scale=ks, v_scale=vs, isa=isa, threads=2
    )
    kd, vd = (
        qkv.dequantize_kv(c, sc, "float8_e4m3fn").astype(np.float64)
        for c, sc in ((kc, ks), (vc, vs))
    )
    want, want_lse = reference.attention(q.astype(np.float64), kd, vd, scale=0.1, return_lse=True)
    np.testing.assert_allclose(out, want, rtol=F32, atol=F32 * float(np.abs(vd).max()))
    np.testing.assert_allclose(lse, want_lse, rtol=F32, atol=F32)


# --- the KV cache in each form --------------------------------------------------------------


def _ragged_cache(form, lengths, rng, kv_heads=2, d=64):
    cache = qkv.KVCache(len(lengths), kv_heads, d, dtype=form)
    full = []
    for b, n in enumerate(lengths):
        k = rng.standard_normal((kv_heads, n, d)).astype(np.float32)
        v = rng.standard_normal((kv_heads, n, d)).astype(np.float32)
        if n:
            cache.append(k[:, : n // 2 + 1], v[:, : n // 2 + 1], seq=b)  # appends grow it
            if n // 2 + 1 < n:
                cache.append(k[:, n // 2 + 1 :], v[:, n // 2 + 1 :], seq=b)
        full.append((k, v))
    return cache, full


@pytest.mark.parametrize("form", ["float32", *FORMS])
def test_ragged_cache_equals_reference_per_sequence_in_every_form(form, monkeypatch):
    rng = np.random.default_rng(4)
    lengths = [700, 1, 0, 333, 700]
    cache, full = _ragged_cache(form, lengths, rng)
    q = rng.standard_normal((5, 4, 1, 64)).astype(np.float32)
    calls = []
    run = native_decode.Template.run  # a planned step's one native call
    monkeypatch.setattr(
        native_decode.Template, "run", lambda *a, **kw: calls.append(1) or run(*a, **kw)
    )
    out, lse = cache.attend(q, return_lse=True, softcap=30.0)
    assert out.dtype == np.float32 and lse.shape == (5, 4, 1)
    if native_decode.available():
        assert len(calls) == 1  # every sequence, each its own length, in one call
    for b, n in enumerate(lengths):
        if n == 0:
            np.testing.assert_array_equal(out[b], 0)
            assert np.all(lse[b] == -np.inf)
            continue
        k, v = full[b]
        kd = k if form == "float32" else _dequantized(k, form)
        vd = v if form == "float32" else _dequantized(v, form)
        np.testing.assert_array_equal(cache.keys(b), kd)
        want = reference.attention(q[b].astype(np.float64), kd, vd, causal=True, softcap=30.0)
        np.testing.assert_allclose(out[b], want, atol=F32, rtol=F32)


@pytest.mark.parametrize("form", FORMS)
def test_stored_cache_error_against_float32_kv_is_bounded(form):
    """What a form costs against float32 K/V (random data): bounded per form."""
    rng = np.random.default_rng(5)
    cache, full = _ragged_cache(form, [512, 512], rng)
    q = rng.standard_normal((2, 4, 1, 64)).astype(np.float32)
    out = cache.attend(q)
    want = np.stack([reference.attention(q[b], *full[b], causal=True) for b in range(2)])
    err = np.abs(out - want).max() / np.abs(want).max()
    assert err < {"bfloat16": 2e-2, "float16": 2e-3, "int8": 3e-2, "float8_e4m3fn": 1e-1}[form]


@pytest.mark.parametrize("form", FORMS)
def test_stored_cache_general_road_for_what_the_kernel_does_not_serve(form):
    """A causal block of queries and ALiBi take the general road on the stored values."""
    rng = np.random.default_rng(6)
    cache, full = _ragged_cache(form, [40, 17], rng, d=8)
    q = rng.standard_normal((2, 2, 3, 8)).astype(np.float32)
    slopes = np.array([0.5, 0.25])
    out = cache.attend(q, alibi_slopes=slopes)
    for b in range(2):
        kd, vd = (_dequantized(x, form) for x in full[b])
        want = reference.attention(
            q[b].astype(np.float64), kd, vd, causal=True, alibi_slopes=slopes
        )
        np.testing.assert_allclose(out[b], want, atol=F32, rtol=F32)


def test_window_and_sinks_on_the_one_call_road():
    rng = np.random.default_rng(7)
    cache, full = _ragged_cache("int8", [300, 90], rng)
    q = rng.standard_normal((2, 2, 1, 64)).astype(np.float32)
    sinks = np.array([0.5, -1.0])
    out = cache.attend(q, window=(50, 0), sinks=sinks)
    for b in range(2):
        kd, vd = (_dequantized(x, "int8") for x in full[b])
        want = reference.attention(
            q[b].astype(np.float64), kd, vd, causal=True, window=(50, 0), sinks=sinks
        )
        np.testing.assert_allclose(out[b], want, atol=F32, rtol=F32)


def test_scaled_forms_refuse_non_finite_appends_by_name():
    cache = qkv.KVCache(1, 1, 4, dtype="int8")
    with pytest.raises(qkv.InputError, match=r"^v: int8 stores finite values"):
        cache.append(np.ones((1, 1, 1, 4)), np.full((1, 1, 1, 4), np.nan))
    assert cache.lengths.tolist() == [0]


@native
@pytest.mark.parametrize("q_dtype", [np.float16, np.float32])
def test_a_decoding_step_on_a_stored_cache_copies_nothing(q_dtype):
    """The one-call road checks the call against zero-stride stand-ins: no buffer-sized
    array is made (the K/V here are 8 MiB; the step allocates well under 1 MiB)."""
    import tracemalloc

    rng = np.random.default_rng(8)
    cache = qkv.KVCache(2, 2, 64, dtype=np.float16)
    k, v = rng.standard_normal((2, 2, 2, 4000, 64))
    cache.append(k, v)
    q = rng.standard_normal((2, 8, 1, 64)).astype(q_dtype)
    cache.attend(q)  # warm: imports, thread team
    tracemalloc.start()
    out = cache.attend(q)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert out.dtype == q_dtype and peak < 1 << 20
    kd, vd = (x.astype(np.float16).astype(np.float64) for x in (k, v))
    want = reference.attention(q.astype(np.float64), kd, vd, causal=True)
    np.testing.assert_allclose(out.astype(np.float64), want, atol=bound("fast path", q_dtype))


def test_quantize_kv_reads_tensors_and_lists_as_arrays():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(9).standard_normal((3, 16)).astype(np.float32)
    for form in FORMS:
        want = qkv.quantize_kv(x, form)
        for arg in (torch.from_numpy(x), x.tolist()):
            got = qkv.quantize_kv(arg, form)
            np.testing.assert_array_equal(got[0], want[0])
            assert (got[1] is None) == (want[1] is None)
    # a bfloat16 tensor is read as its values (widened exactly)
    b = torch.from_numpy(x).bfloat16()
    codes, _ = qkv.quantize_kv(b, "bfloat16")
    np.testing.assert_array_equal(codes, b.view(torch.int16).numpy().view(np.uint16))
    with pytest.raises(qkv.InputError, match=r"x: expected at least 1 dimension"):
        qkv.quantize_kv(3.0, "int8")
