"""Several causal query rows on the decode step (:mod:`qkv.engine.kernels.causal_rows`):
speculative decoding's draft tokens and short prompt chunks against a cache.

Every road is compared with the float64 reference on the stored (dequantized) K/V: the native
step with its rows causal, or (the NumPy emulation of the fast road) the keys all rows see on
the step and the last ``L - 1`` keys as a triangle in NumPy, merged. The tolerance is the
``fast path`` row's (float32 computation from the stored values; float64 for float64), as in
``test_paged``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.conftest import tol

import qkv
from qkv import reference
from qkv.engine.kernels import causal_rows, decode_fast, native_decode, router
from qkv.engine.kernels.native_lib import ISAS, running_isa
from qkv.engine.paged import attend_pages
from qkv.flash import flash_attn_with_kvcache
from qkv.testing import strategies as qst

TOL32, TOL64 = tol("fast path", np.float32), tol("fast path", np.float64)
FORMS = ["float32", "float64", "bfloat16", "float16", "int8", "float8_e4m3fn"]
native = pytest.mark.skipif(
    not native_decode.available(), reason="native kernels not built (or QKV_NATIVE=0)"
)


def _reference(q, k, v, lengths, **options):
    """The float64 reference per sequence on its first ``lengths[b]`` keys of ``k (B, kvh, S,
    d)``, grouped heads repeated: ``(out, lse)``."""
    B, H, L, _ = q.shape
    g = H // k.shape[1]
    out = np.zeros((B, H, L, v.shape[-1]))
    lse = np.full((B, H, L), -np.inf)
    for b, n in enumerate(lengths):
        kb = np.repeat(np.asarray(k[b, :, :n], np.float64), g, axis=0)
        vb = np.repeat(np.asarray(v[b, :, :n], np.float64), g, axis=0)
        out[b], lse[b] = reference.attention(
            np.asarray(q[b], np.float64), kb, vb, causal=True, return_lse=True, **options
        )
    return out, lse


def _close(got, want, dtype=np.float32):
    t = TOL64 if dtype == np.float64 else TOL32
    np.testing.assert_allclose(np.asarray(got[0], np.float64), want[0], **t)
    finite = np.isfinite(want[1])
    assert np.array_equal(np.isfinite(got[1]), finite)
    np.testing.assert_allclose(np.asarray(got[1], np.float64)[finite], want[1][finite], **t)


# --- the two pieces ---------------------------------------------------------------------------


@given(
    rows=st.integers(2, 8),
    lo=st.integers(0, 6),
    n=st.integers(0, 20),
)
def test_last_keys_are_the_keys_not_every_row_sees(rows, lo, n):
    hi = lo + n
    pos, seen = causal_rows.last_keys(np.array([lo]), np.array([hi]), rows)
    common = max(hi - rows + 1, lo)
    for i in range(rows):  # row i sits at position hi - rows + i and sees [lo, that]
        sees = set(range(lo, hi - rows + i + 1))
        from_tail = {int(pos[0, t]) for t in range(rows - 1) if seen[0, 0, i, t]}
        assert from_tail == sees - set(range(lo, common))
        assert all(p >= common for p in from_tail)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    group=st.sampled_from([1, 2, 4]),
    rows=st.integers(2, 8),
    first=st.integers(0, 40),
    softcap=st.sampled_from([None, 3.0]),
)
def test_with_tail_equals_attention_over_both_key_sets(seed, group, rows, first, softcap):
    """A part over ``first`` keys (rows that see none of them included) merged with the last
    keys' triangle equals the reference over all keys under the causal mask."""
    rng = np.random.default_rng(seed)
    B, kvh, d = 2, 2, 16
    S = first + rows - 1
    q = qst.values(rng, (B, kvh * group, rows, d))
    k, v = qst.values(rng, (B, kvh, S, d)), qst.values(rng, (B, kvh, S, d))
    kr, vr = np.repeat(k, group, 1), np.repeat(v, group, 1)
    scale = d**-0.5
    head = reference.attention(q, kr[:, :, :first], vr[:, :, :first], return_lse=True,
                               scale=scale, softcap=softcap)  # fmt: skip
    seen = np.tri(rows, rows - 1, -1, dtype=bool)
    got = causal_rows.with_tail(
        (head[0].copy(), head[1].copy()), q, k[:, :, first:], v[:, :, first:], seen, scale, softcap
    )
    want = reference.attention(q, kr, vr, causal=True, return_lse=True, scale=scale,
                               softcap=softcap)  # fmt: skip
    _close(got, want, np.float64)


# --- qkv.attention: the router's rows -------------------------------------------------------


@native
@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    batch=st.integers(1, 3),
    kvh=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    rows=st.integers(2, 32),
    extra=st.integers(0, 200),
    d=st.sampled_from([8, 32, 64, 128]),
    dtype=st.sampled_from(["float32", "float64", "bfloat16", "float16"]),
    softcap=st.sampled_from([None, 5.0]),
)
def test_attention_with_a_few_causal_rows_equals_reference(
    seed, batch, kvh, group, rows, extra, d, dtype, softcap
):
    """Up to 8 rows, and chunks of up to 32 on 16-bit K/V (small K/V in other dtypes: the
    prefill's)."""
    rng = np.random.default_rng(seed)
    S = router.CAUSAL_ROWS_KEYS_PER_ROW * rows + extra
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    q = qst.values(rng, (batch, kvh * group, rows, d)).astype(dt)
    k = qst.values(rng, (batch, kvh, S, d)).astype(dt)
    v = qst.values(rng, (batch, kvh, S, d)).astype(dt)
    route = qkv.route(q, k, v, causal=True, softcap=softcap)
    wide = running_isa() >= ISAS["avx512"]
    steps = rows <= router.DECODE_MAX_L or (
        dtype in ("bfloat16", "float16") and S >= router.CAUSAL_CHUNK_KEYS_PER_ROW * rows and wide
    )  # fmt: skip
    # 32 rows a kv head and more against a cache: the prefill, the grouped heads stacked (K/V
    # of a few hundred KiB here), with K/V in 16 bits in the narrower clones only, and in the
    # AVX-512 one only for chunks the prefill takes anyway
    stacked = (
        (dtype in ("float32", "float64") or not wide) and softcap is None
        and S >= router.CAUSAL_CHUNK_KEYS_PER_ROW * rows
        and group * rows >= 32 and (not wide or rows > router.DECODE_MAX_L)
        and batch * kvh * group * rows * S * 2 * d >= router.CAUSAL_ROWS_MIN_WORK
    )  # fmt: skip
    # 4 to 8 rows against at most 32 keys, or 128 where the grouped heads stack them to 16
    # rows a kv head (K/V in the compute dtype or stored in 16 bits): the prefill, every clone
    few = (
        softcap is None
        and router.FEW_KEYS_MIN_L <= rows <= router.DECODE_MAX_L
        and (S <= router.FEW_KEYS_MAX_S or (
            S <= router.FEW_KEYS_STACKED_MAX_S
            and group * rows >= router.FEW_KEYS_STACKED_MIN_ROWS
        ) or (
            dtype in ("bfloat16", "float16") and rows == router.DECODE_MAX_L
            and S <= router.FEW_KEYS_STACKED_MAX_S and S * d <= router.FEW_KEYS_16_BIT_MAX_SD
        ))
        and batch * kvh * group * rows * S * 2 * d >= router.CAUSAL_ROWS_MIN_WORK
    )  # fmt: skip
    on_step = steps and not stacked and not few
    assert route.kernel.startswith("native decode, causal rows") == on_step, route
    if stacked or few:
        assert route.kernel.startswith("native prefill, own tiles"), route
    out = qkv.attention(q, k, v, causal=True, softcap=softcap)
    want = _reference(q, k, v, [S] * batch, softcap=softcap)
    if dtype in ("bfloat16", "float16"):  # the float32 result, rounded once to the output
        np.testing.assert_allclose(out.astype(np.float64), want[0], **tol("tensor dtypes", dt))
    else:
        np.testing.assert_allclose(out, want[0], **(TOL64 if dtype == "float64" else TOL32))


@native
@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    batch=st.integers(1, 2),
    kvh=st.integers(1, 3),
    group=st.integers(2, 6),
    rows=st.integers(1, 40),
    extra=st.integers(0, 300),
    d=st.sampled_from([8, 32, 64, 80]),
    dtype=st.sampled_from(["float32", "float64"]),
    products=st.sampled_from(["own", "blas"]),
    isa=st.sampled_from(["baseline", "avx2", "avx512"]),
    rule=st.sampled_from([(True, None), (True, (5, 0)), (False, (7, 3)), (False, (None, 2))]),
)
def test_stacked_causal_rows_equal_reference(
    seed, batch, kvh, group, rows, extra, d, dtype, products, isa, rule
):
    """The native prefill with a kv head's grouped heads stacked under the causal rule or a
    window, its rows taken position by position (``per_pos``): each row's keys those of its
    position, bottom-right aligned, in every clone, on either tile products (``S`` from ``L``
    up; blocks of rows split among the threads may cut a position's rows)."""
    from qkv.engine.kernels import native
    from qkv.validate import make_plan

    if products == "blas" and not native.available()[0]:
        products = "own"  # (no BLAS found: the own products alone)
    rng = np.random.default_rng(seed)
    S = rows + extra
    q = qst.values(rng, (batch, kvh * group, rows, d)).astype(dtype)
    k = qst.values(rng, (batch, kvh, S, d)).astype(dtype)
    v = qst.values(rng, (batch, kvh, S, d)).astype(dtype)
    causal, window = rule
    plan = make_plan(q, k, v, causal=causal, window=window)
    got = native.attend(plan, products=products, stack=True, isa=isa)
    kr, vr = (np.repeat(x.astype(np.float64), group, axis=1) for x in (k, v))
    want = reference.attention(q.astype(np.float64), kr, vr, causal=causal, window=window,
                               return_lse=True)  # fmt: skip
    _close(got, want, np.dtype(dtype))


@native
@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    rows=st.integers(2, 8),
    runs=st.lists(st.tuples(st.integers(0, 1300), st.integers(0, 1300)), min_size=1, max_size=3),
    form=st.sampled_from(["float32", "float64", "bfloat16", "float16"]),
    group=st.sampled_from([1, 3]),
    isa=st.sampled_from(["baseline", "avx2", "avx512"]),
)
def test_the_step_takes_its_rows_causal(seed, rows, runs, form, group, isa):
    """The native step's causal rows on each sequence's run of keys ``[lo, hi)``: row ``i``
    sees ``[lo, hi - (L - 1) + i)``, none for a row before ``lo`` (output 0, lse -inf);
    runs long enough to be split among the threads, in every clone."""
    rng = np.random.default_rng(seed)
    B, kvh, d, S = len(runs), 2, 64, 1300
    lo = np.array([min(a, b) for a, b in runs], np.int64)
    hi = np.array([max(a, b) for a, b in runs], np.int64)
    dt = np.float64 if form == "float64" else np.float32
    kt = ml_dtypes.bfloat16 if form == "bfloat16" else np.dtype(form)
    q = qst.values(rng, (B, kvh * group, rows, d)).astype(dt)
    k, v = (qst.values(rng, (B, S, kvh, d)).astype(kt) for _ in range(2))  # a page a sequence
    table = np.arange(B, dtype=np.int32)[:, None]
    got = native_decode.paged_step(q, k, v, table, lo, hi, 0.125, threads=2,
                                   isa=ISAS[isa], causal=True)  # fmt: skip
    assert got is not None
    out = np.zeros((B, kvh * group, rows, d))
    lse = np.full((B, kvh * group, rows), -np.inf)
    for b in range(B):
        for i in range(rows):
            end = hi[b] - (rows - 1) + i
            if end <= lo[b]:
                continue
            kb, vb = (np.repeat(x[b, lo[b] : end].astype(np.float64).transpose(1, 0, 2), group,
                                axis=0) for x in (k, v))  # fmt: skip
            o, s = reference.attention(q[b, :, i : i + 1].astype(np.float64), kb, vb,
                                       scale=0.125, return_lse=True)  # fmt: skip
            out[b, :, i], lse[b, :, i] = o[:, 0], s[:, 0]
    _close(got, (out, lse), dt)


@native
@pytest.mark.parametrize("isa", ["baseline", "avx2", ""])
def test_every_clone_runs_the_causal_rows(monkeypatch, isa):
    monkeypatch.setenv("QKV_NATIVE_ISA", isa)
    rng = np.random.default_rng(3)
    q = qst.values(rng, (2, 8, 4, 64)).astype(np.float32)
    k, v = (qst.values(rng, (2, 2, 300, 64)).astype(np.float32) for _ in range(2))
    out, lse = qkv.attention(q, k, v, causal=True, return_lse=True)
    _close((out, lse), _reference(q, k, v, [300, 300]))


def test_short_rows_and_other_masks_keep_their_roads():
    rng = np.random.default_rng(4)
    q = qst.values(rng, (1, 4, 4, 16))
    short = qst.values(rng, (1, 4, 3, 16))  # fewer keys than rows: the general kernels
    assert not qkv.route(q, short, short, causal=True).kernel.startswith("native decode, causal")
    k = qst.values(rng, (1, 4, 200, 16))
    for options in ({"causal": False}, {"causal": True, "window": (50, 0)}):
        assert "causal rows" not in qkv.route(q, k, k, **options).kernel


@native
@pytest.mark.parametrize("isa", ["avx512", "avx2", "baseline"])
def test_a_few_rows_against_a_short_cache_run_on_the_prefill(monkeypatch, isa):
    monkeypatch.setenv("QKV_NATIVE_ISA", isa)
    rng = np.random.default_rng(8)
    for B, H, kvh, L, S in ((32, 12, 12, 8, 16), (8, 12, 3, 4, 32), (8, 8, 2, 8, 8)):
        q = qst.values(rng, (B, H, L, 32)).astype(np.float32)
        k, v = (qst.values(rng, (B, kvh, S, 32)).astype(np.float32) for _ in range(2))
        assert qkv.route(q, k, v, causal=True).kernel == "native prefill, own tiles"
        out, lse = qkv.attention(q, k, v, causal=True, return_lse=True)
        _close((out, lse), _reference(q, k, v, [S] * B))
        b16 = [x.astype(ml_dtypes.bfloat16) for x in (q, k, v)]
        assert qkv.route(*b16, causal=True).kernel == "native prefill, own tiles, stored K/V"
        out = qkv.attention(*b16, causal=True).astype(np.float64)
        want = _reference(*b16, [S] * B)[0]
        np.testing.assert_allclose(out, want, **tol("tensor dtypes", ml_dtypes.bfloat16))
    # grouped heads stacked to 16 rows a kv head and more: up to 128 keys
    for B, H, kvh, L, S in ((1, 12, 3, 4, 128), (8, 8, 2, 8, 64)):
        q = qst.values(rng, (B, H, L, 32)).astype(np.float32)
        k, v = (qst.values(rng, (B, kvh, S, 32)).astype(np.float32) for _ in range(2))
        assert qkv.route(q, k, v, causal=True).kernel == "native prefill, own tiles"
        _close(qkv.attention(q, k, v, causal=True, return_lse=True), _reference(q, k, v, [S] * B))
    # heads alone, 8 rows of K/V in 16 bits against 128 keys of 32
    q, k, v = (qst.values(rng, (2, 12, n, 32)).astype(ml_dtypes.bfloat16) for n in (8, 128, 128))
    assert qkv.route(q, k, v, causal=True).kernel == "native prefill, own tiles, stored K/V"
    out = qkv.attention(q, k, v, causal=True).astype(np.float64)
    np.testing.assert_allclose(
        out, _reference(q, k, v, [128] * 2)[0], **tol("tensor dtypes", ml_dtypes.bfloat16)
    )
    # two rows, 64 keys and more a head alone, or more than 128 keys, keep the step (AVX-512:
    # the AVX2 clone's rule differs)
    if running_isa() >= ISAS["avx512"]:
        for L, S, kvh in ((2, 16, 12), (4, 64, 12), (4, 256, 3)):
            q = qst.values(rng, (8, 12, L, 32)).astype(np.float32)
            k = qst.values(rng, (8, kvh, S, 32)).astype(np.float32)
            assert qkv.route(q, k, k, causal=True).kernel == "native decode, causal rows"


# --- paged and cached steps, every stored form --------------------------------------------------


def _pool(rng, form, nb, page, kvh, d):
    kx = qst.values(rng, (nb, page, kvh, d)).astype(np.float32)
    vx = qst.values(rng, (nb, page, kvh, d)).astype(np.float32)
    if form in ("float32", "float64", "float16"):
        k, v = kx.astype(form), vx.astype(form)
        return k, v, {}, k.astype(np.float64), v.astype(np.float64)
    (k, ks), (v, vs) = qkv.quantize_kv(kx, form), qkv.quantize_kv(vx, form)
    kd = qkv.dequantize_kv(k, ks, form).astype(np.float64)
    vd = qkv.dequantize_kv(v, vs, form).astype(np.float64)
    extra = {"kv_format": form}
    if ks is not None:
        extra.update(k_scale=ks, v_scale=vs)
    return k, v, extra, kd, vd


def _paged(rng, form, page, lengths, kvh, d):
    """A shuffled pool holding ``lengths`` keys per sequence: ``(k_pages, v_pages, the
    attend_pages keywords of the form, block table, gathered stored K, V (B, kvh, S, d))``."""
    B = len(lengths)
    nb = sum(-(-n // page) for n in lengths) + 2
    k, v, extra, kd, vd = _pool(rng, form, nb, page, kvh, d)
    width = max(max(-(-n // page) for n in lengths), 1)
    table = np.full((B, width), -1, np.int64)  # unused entries: not pages
    ids, at = rng.permutation(nb), 0
    for b, n in enumerate(lengths):
        p = -(-n // page)
        table[b, :p] = ids[at : at + p]
        at += p
    pos = np.arange(width * page)
    kg = np.moveaxis(kd[table[:, pos // page], pos % page], 2, 1)
    vg = np.moveaxis(vd[table[:, pos // page], pos % page], 2, 1)
    return k, v, extra, table, kg, vg


@native
@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    form=st.sampled_from(FORMS),
    page=st.sampled_from([1, 3, 16, 64]),
    rows=st.integers(2, 8),
    lengths=st.lists(st.integers(0, 150), min_size=1, max_size=4),
    softcap=st.sampled_from([None, 4.0]),
    fast=st.booleans(),
)
def test_paged_step_with_a_few_causal_rows_equals_reference(
    seed, form, page, rows, lengths, softcap, fast
):
    """Sequences shorter than the rows (some rows see nothing) and empty ones included."""
    rng = np.random.default_rng(seed)
    B, kvh, H, d = len(lengths), 2, 4, 32
    k, v, extra, table, kg, vg = _paged(rng, form, page, lengths, kvh, d)
    dt = np.float64 if form == "float64" else np.float32
    q = qst.values(rng, (B, H, rows, d)).astype(dt)
    precision = "fast" if fast and form == "int8" else "exact"
    got = attend_pages(q, k, v, table, lengths, softcap=softcap, return_lse=True,
                       precision=precision, **extra)  # fmt: skip
    want = _reference(q, kg, vg, lengths, softcap=softcap)
    if precision == "fast":  # q rounded to int8: the fast road's own bound, loosely
        np.testing.assert_allclose(got[0], want[0], atol=0.15)
    else:
        _close(got, want, dt)


@pytest.mark.parametrize("rows", [4, 24])
@pytest.mark.parametrize("form", ["float32", "bfloat16", "int8", "float8_e4m3fn", "float16"])
def test_cache_step_with_a_few_causal_rows_equals_reference(form, rows):
    """A few rows: the decode step's split (the NumPy kernels without the native library);
    a chunk of 24: the general road, bfloat16 and float16 caches read as stored (sequences
    of equal length together)."""
    rng = np.random.default_rng(5)
    B, kvh, H, d = 3, 2, 8, 64
    cache = qkv.KVCache(B, kvh, d, dtype=form)
    for n in (90, 7):  # a prompt, then a few draft tokens: the rows that attend
        cache.append(qst.values(rng, (B, kvh, n, d)), qst.values(rng, (B, kvh, n, d)))
    cache.append(qst.values(rng, (kvh, 5, d)), qst.values(rng, (kvh, 5, d)), seq=1)
    q = qst.values(rng, (B, H, rows, d)).astype(np.float32)
    got = cache.attend(q, return_lse=True)
    lengths = [97, 102, 97]
    k = np.zeros((B, kvh, 102, d))
    v = np.zeros((B, kvh, 102, d))
    for b, n in enumerate(lengths):
        k[b, :, :n], v[b, :, :n] = cache.keys(b), cache.values(b)
    _close(got, _reference(q, k, v, lengths))


@pytest.mark.parametrize("form", ["bfloat16", "float16", "int8", "float8_e4m3fn", "float32"])
def test_cache_chunk_of_16_rows_equals_reference(monkeypatch, form):
    """A 16-row chunk against a cache of 8 keys a row and more: on the decode step where the
    cache is stored in 16 or 8 bits and the AVX-512 clone runs (the codes read in place),
    else the general road; both equal the reference on the stored values."""
    from qkv.engine import cache as cache_module

    taken = []
    real = cache_module.causal_rows
    monkeypatch.setattr(cache_module, "causal_rows",
                        lambda *a, **kw: taken.append(1) or real(*a, **kw))  # fmt: skip
    rng = np.random.default_rng(11)
    B, kvh, H, d, rows = 2, 2, 8, 32, 16
    cache = qkv.KVCache(B, kvh, d, dtype=form)
    cache.append(qst.values(rng, (B, kvh, 300, d)), qst.values(rng, (B, kvh, 300, d)))
    cache.append(qst.values(rng, (kvh, 20, d)), qst.values(rng, (kvh, 20, d)), seq=0)
    q = qst.values(rng, (B, H, rows, d)).astype(np.float32)
    got = cache.attend(q, return_lse=True)
    lengths = [320, 300]
    k = np.zeros((B, kvh, 320, d))
    v = np.zeros((B, kvh, 320, d))
    for b, n in enumerate(lengths):
        k[b, :, :n], v[b, :, :n] = cache.keys(b), cache.values(b)
    _close(got, _reference(q, k, v, lengths))
    wide = running_isa() >= ISAS["avx512"]  # (with QKV_NATIVE=0 the step declines it)
    assert bool(taken) == (wide and form != "float32")


@pytest.mark.parametrize("rows", [2, 5, 8])
def test_cache_fast_road_with_a_few_causal_rows_is_near_reference(rows):
    """The fast road of an int8 cache: the native step's causal rows, or without the native
    library its NumPy emulation with the last keys merged (the only road that still splits),
    within the fast road's stated bound (over all the keys: at least each row's) of the
    reference on the stored values."""
    rng = np.random.default_rng(rows)
    B, kvh, H, d = 2, 2, 8, 32
    cache = qkv.KVCache(B, kvh, d, dtype="int8")
    cache.append(qst.values(rng, (B, kvh, 40, d)), qst.values(rng, (B, kvh, 40, d)))
    q = qst.values(rng, (B, H, rows, d)).astype(np.float32)
    got = cache.attend(q, precision="fast")
    exact = cache.attend(q)
    k = np.stack([cache.keys(b) for b in range(B)])
    v = np.stack([cache.values(b) for b in range(B)])
    want = _reference(q, k, v, [40, 40])[0]
    slack = TOL32["atol"] * np.abs(v).max() + TOL32["rtol"] * np.abs(want)
    assert (np.abs(got - want) <= decode_fast.bound(q, k, v, d**-0.5) + slack).all()
    np.testing.assert_allclose(exact, want, **TOL32)
    if native_decode.available():  # each row: the fast step of that row alone on its keys
        for i in range(rows):
            alone = qkv.KVCache(B, kvh, d, dtype="int8")
            n = 40 - (rows - 1) + i
            alone.append(k[..., :n, :], v[..., :n, :])  # (the same codes, quantized again)
            one = alone.attend(q[:, :, i : i + 1], precision="fast")
            np.testing.assert_allclose(got[:, :, i : i + 1], one, rtol=1e-5, atol=1e-6)


@native
@pytest.mark.parametrize("rows", [4, 24])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_flash_kvcache_with_draft_tokens_equals_reference(paged, dtype, rows):
    """``flash_attn_with_kvcache`` with new k/v of 4 tokens per sequence (written, then
    attended causally: the decode step), or a chunk of 24 (each sequence's full pages that
    every row sees read in place by the prefill; a contiguous cache's rows viewed as pages
    of 256), on a contiguous and a paged cache."""
    rng = np.random.default_rng(6)
    B, kvh, H, d, page = 2, 2, 4, 64, 16
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    seqlens = np.array([400, 300])
    cap = 512
    k_new = qst.values(rng, (B, rows, kvh, d)).astype(dt)
    v_new = qst.values(rng, (B, rows, kvh, d)).astype(dt)
    q = qst.values(rng, (B, rows, H, d)).astype(dt)
    if paged:
        nb = B * cap // page
        kc = qst.values(rng, (nb, page, kvh, d)).astype(dt)
        vc = qst.values(rng, (nb, page, kvh, d)).astype(dt)
        table = rng.permutation(nb).reshape(B, cap // page).astype(np.int32)
        out = flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens,
                                      block_table=table, causal=True)  # fmt: skip
        pos = np.arange(cap)
        kg, vg = kc[table[:, pos // page], pos % page], vc[table[:, pos // page], pos % page]
    else:
        kc = qst.values(rng, (B, cap, kvh, d)).astype(dt)
        vc = qst.values(rng, (B, cap, kvh, d)).astype(dt)
        out = flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, causal=True)
        kg, vg = kc, vc
    want = _reference(q.transpose(0, 2, 1, 3), np.moveaxis(kg, 2, 1), np.moveaxis(vg, 2, 1),
                      (seqlens + rows).tolist())  # fmt: skip
    t = tol("tensor dtypes" if dtype == "bfloat16" else "fast path", dt)
    np.testing.assert_allclose(np.asarray(out, np.float64), want[0].transpose(0, 2, 1, 3), **t)


@native
@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    form=st.sampled_from(FORMS),
    page=st.sampled_from([16, 64]),
    rows=st.integers(9, 40),
    lengths=st.lists(st.integers(0, 700), min_size=1, max_size=3),
    softcap=st.sampled_from([None, 4.0]),
)
def test_paged_chunks_read_their_full_pages_in_place_and_equal_reference(
    seed, form, page, rows, lengths, softcap
):
    """A chunk of more rows than a decoding step's: each sequence's full pages that every row
    sees whole (from 256 keys) split off to the prefill that reads them in place, the rest
    gathered; sequences shorter than the chunk included."""
    rng = np.random.default_rng(seed)
    B, kvh, H, d = len(lengths), 2, 4, 32
    k, v, extra, table, kg, vg = _paged(rng, form, page, lengths, kvh, d)
    dt = np.float64 if form == "float64" else np.float32
    q = qst.values(rng, (B, H, rows, d)).astype(dt)
    got = attend_pages(q, k, v, table, lengths, softcap=softcap, return_lse=True, **extra)
    _close(got, _reference(q, kg, vg, lengths, softcap=softcap), dt)


@native
def test_a_paged_chunk_splits_at_its_own_full_pages(monkeypatch):
    """The prefill reads the pages every row sees whole, in place, once per sequence."""
    from qkv.engine.kernels import native

    seen = []
    real = native.attend_prefix_pages

    def spy(part, k_pages, v_pages, ids, *args, **kwargs):
        seen.append((part.S, ids.tolist()))
        return real(part, k_pages, v_pages, ids, *args, **kwargs)

    monkeypatch.setattr(native, "attend_prefix_pages", spy)
    rng = np.random.default_rng(7)
    k, v, _, kd, vd = _pool(rng, "float32", 80, 16, 2, 32)
    table = rng.permutation(80)[:76].reshape(2, 38)
    q = qst.values(rng, (2, 4, 32, 32)).astype(np.float32)
    got = attend_pages(q, k, v, table, [600, 400], return_lse=True)
    # every row sees keys up to length - 32; whole pages of them: 35 and 23
    assert seen == [(35 * 16, table[0, :35].tolist()), (23 * 16, table[1, :23].tolist())]
    pos = np.arange(38 * 16)
    kg = np.moveaxis(kd[table[:, pos // 16], pos % 16], 2, 1)
    vg = np.moveaxis(vd[table[:, pos // 16], pos % 16], 2, 1)
    _close(got, _reference(q, kg, vg, [600, 400]))


def test_the_router_says_which_steps_split_and_which_chunks_run_alone():
    from qkv.validate import make_plan

    rng = np.random.default_rng(8)
    k = qst.values(rng, (2, 2, 300, 8))

    def plan(rows, keys=64, **options):
        return make_plan(qst.values(rng, (2, 4, rows, 8)), k[:, :, :keys], k[:, :, :keys],
                         **options)  # fmt: skip

    assert router.causal_rows_step(plan(4, causal=True))
    assert not router.causal_rows_step(plan(1, causal=True))  # one row: the step as it is
    assert not router.causal_rows_step(plan(4, causal=False))  # every row sees every key
    assert not router.causal_rows_step(plan(9, causal=True))  # a chunk: the prefill's
    assert not router.causal_rows_step(plan(4, causal=True, window=(10, 0)))
    # a chunk of up to 32 rows against 8 keys a row and more, on K/V stored in 16 bits or of
    # 16 MiB and more: the step's, in the AVX-512 clone
    wide = running_isa() >= ISAS["avx512"]
    assert router.causal_rows_step(plan(32, 256, causal=True), True, 0) == wide
    assert not router.causal_rows_step(plan(32, 255, causal=True), True, 0)
    assert router.causal_rows_step(plan(8, 8, causal=True), False, 0)
    assert router.causal_rows_step(plan(9, 72, causal=True), False, 16 << 20) == wide
    assert not router.causal_rows_step(plan(9, 72, causal=True), False, (16 << 20) - 1)
    assert not router.causal_rows_step(plan(33, 300, causal=True), True, 1 << 30)
    assert router.chunks_alone(plan(9, causal=True), 2, 0)
    assert not router.chunks_alone(plan(9, causal=True), 2, 0, steps=True)
    assert not router.chunks_alone(plan(9, causal=True), 1, 0)
    assert not router.chunks_alone(plan(9, causal=True), 2, 256)  # a shared prefix first
    assert not router.chunks_alone(plan(8, causal=True), 2, 0)
    assert router.cascade(plan(9, causal=True), None, 256, 1)  # its own full pages in place
    assert not router.cascade(plan(9, causal=True), None, 256, 1, steps=True)
    assert router.cascade(plan(9, causal=True), None, 256, 2, steps=True)  # a shared prefix
    kb = qst.values(rng, (2, 2, 128, 8))
    bf16 = [a.astype(ml_dtypes.bfloat16) for a in (qst.values(rng, (2, 8, 16, 8)), kb, kb)]
    if native_decode.available() and wide:  # (else no native row, or not for a chunk)
        assert qkv.route(*bf16, causal=True).kernel == "native decode, causal rows, stored K/V"
    f32 = [a.astype(np.float32) for a in bf16]
    assert "causal rows" not in qkv.route(*f32, causal=True).kernel  # (K/V in cache)
    square = [a[:, :, :16] for a in bf16]  # a prompt's own causal block: the prefill's
    assert "causal rows" not in qkv.route(*square, causal=True).kernel


@native
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    seqs=st.lists(
        st.tuples(st.sampled_from([0, 1, 2, 3, 5, 8, 12, 16]), st.integers(0, 160)),
        min_size=1,
        max_size=5,
    ),
    dtype=st.sampled_from(["float32", "bfloat16"]),
)
def test_packed_sequences_of_a_few_causal_rows_equal_reference(seed, seqs, dtype):
    """``attention_varlen`` with sequences of 2-8 rows (draft tokens) beside decoding steps,
    longer chunks and empty sequences: the few-row ones on the decode step as causal rows, and
    in bfloat16 (K/V stored in 16 bits) chunks of up to 32 rows against 8 keys a row and more
    where the AVX-512 clone runs."""
    from qkv.engine import varlen

    rng = np.random.default_rng(seed)
    H, kvh, d = 4, 2, 32
    lq = np.array([n for n, _ in seqs])
    lk = np.array([n + extra for n, extra in seqs])  # at least as many keys as rows
    cq, ck = np.concatenate([[0], np.cumsum(lq)]), np.concatenate([[0], np.cumsum(lk)])
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    q = qst.values(rng, (int(cq[-1]), H, d)).astype(dt)
    k = qst.values(rng, (int(ck[-1]), kvh, d)).astype(dt)
    v = qst.values(rng, (int(ck[-1]), kvh, d)).astype(dt)
    served: list[int] = []
    real = varlen.causal_rows_steps

    def spy(*args):
        found = real(*args)
        served.extend(int(b) for group, *_ in found for b in group)
        return found

    varlen.causal_rows_steps = spy
    try:
        out, lse = qkv.attention_varlen(q, k, v, cq, ck, causal=True, return_lse=True)
    finally:
        varlen.causal_rows_steps = real
    few = (lq >= 2) & (lq <= router.DECODE_MAX_L) & (lk >= router.CAUSAL_ROWS_KEYS_PER_ROW * lq)
    if dtype == "bfloat16" and running_isa() >= ISAS["avx512"]:
        few |= (lq > router.DECODE_MAX_L) & (lq <= 32) & (lk >= 8 * lq)
    assert sorted(served) == np.flatnonzero(few).tolist()  # the road serves exactly those
    for b in range(len(seqs)):
        if lq[b] == 0:
            continue
        rows, keys = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        want = _reference(q[rows].transpose(1, 0, 2)[None], k[keys].transpose(1, 0, 2)[None],
                          v[keys].transpose(1, 0, 2)[None], [int(lk[b])])  # fmt: skip
        got = (out[rows].transpose(1, 0, 2)[None], lse[rows].T[None])
        if dtype == "bfloat16":
            t = tol("tensor dtypes", dt)
            np.testing.assert_allclose(got[0].astype(np.float64), want[0], **t)
        else:
            _close(got, want)


@native
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("isa", ["avx2", "baseline"])
def test_16_bit_rows_stacked_on_the_kept_road(monkeypatch, dtype, isa):
    """Grouped heads' draft rows on 16-bit arrays in the narrower clones: the prefill with the
    heads stacked, then (a plain call's second call) its kept road, which reads q and writes
    the output in 16 bits row by row: the same bits, near the reference."""
    from qkv.engine import run

    monkeypatch.setenv("QKV_NATIVE_ISA", isa)
    run.forget()
    rng = np.random.default_rng(5)
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    q = qst.values(rng, (2, 8, 8, 32)).astype(dt)  # 4 heads a kv head, 8 rows: 32 a kv head
    k = qst.values(rng, (2, 2, 200, 32)).astype(dt)
    v = qst.values(rng, (2, 2, 200, 32)).astype(dt)
    assert qkv.route(q, k, v, causal=True).kernel == "native prefill, own tiles, stored K/V"
    first = qkv.attention(q, k, v, causal=True)
    again = qkv.attention(q, k, v, causal=True)
    np.testing.assert_array_equal(again, first)
    want = _reference(q, k, v, [200, 200])[0]
    np.testing.assert_allclose(first.astype(np.float64), want, **tol("tensor dtypes", dt))
    run.forget()


@native
@pytest.mark.parametrize("lengths", [(300, 300), (300, 211), (8192, 8192)])
def test_cache_rows_on_the_prefill_in_the_avx2_clone(monkeypatch, lengths):
    """A float32 ``KVCache``'s 32 causal rows a kv head in the AVX2 clone leave its decode step
    for the general road, where the prefill stacks them (``router.cache_rows_on_prefill``):
    each sequence's rows against its own keys, equal to the reference, lengths equal or not,
    and K/V of 16 MiB, which the general road's runs would otherwise take to the NumPy decode
    kernel together (``router.decode_together``)."""
    from qkv.engine.kernels import native

    monkeypatch.setenv("QKV_NATIVE_ISA", "avx2")
    stacks: list[bool] = []
    real = native.attend
    monkeypatch.setattr(
        native, "attend", lambda p, **kw: stacks.append(kw.get("stack", False)) or real(p, **kw)
    )
    rng = np.random.default_rng(9)
    B, kvh, g, L, d = len(lengths), 2, 4, 8, 64
    k = qst.values(rng, (B, kvh, max(lengths), d)).astype(np.float32)
    v = qst.values(rng, (B, kvh, max(lengths), d)).astype(np.float32)
    cache = qkv.KVCache(B, kvh, d)
    for b, n in enumerate(lengths):
        cache.append(k[b, :, :n], v[b, :, :n], seq=b)
    q = qst.values(rng, (B, kvh * g, L, d)).astype(np.float32)
    out = cache.attend(q)
    assert stacks and all(stacks), stacks
    np.testing.assert_allclose(out, _reference(q, k, v, lengths)[0], **TOL32)


@native
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("window", [None, (200, 0)])
@pytest.mark.parametrize(("group", "L", "S"), [(3, 600, 600), (4, 520, 900), (1, 600, 600)])
def test_a_long_causal_prompt_runs_its_grouped_heads_stacked(
    monkeypatch, dtype, window, group, L, S
):
    """A causal prompt (or a chunk of one against its cache) of ``STACK_PROMPT_MIN_L`` query
    rows per head and more, with or without a sliding window: the native prefill takes a kv
    head's grouped heads stacked position by position (blocks of 512 rows that cut a
    position's rows), equal to the float64 reference; one query head per kv head, or a
    shorter prompt, keeps them apart."""
    from qkv.engine.kernels import native, stacked
    from qkv.validate import make_plan

    stacks: list[bool] = []
    for name in ("attend", "keep"):
        real = getattr(native, name)

        def spy(*a, real=real, **kw):
            stacks.append(bool(kw.get("stack")))
            return real(*a, **kw)

        monkeypatch.setattr(native, name, spy)
    rng = np.random.default_rng(L + group)
    kvh, d = 2, 16
    q = qst.values(rng, (1, kvh * group, L, d)).astype(dtype)
    k, v = (qst.values(rng, (1, kvh, S, d)).astype(dtype) for _ in range(2))
    assert L >= router.STACK_PROMPT_MIN_L
    out, lse = qkv.attention(q, k, v, causal=True, window=window, return_lse=True)
    assert stacks and all(stacks) == (group > 1), stacks
    _close((out, lse), _reference(q, k, v, [S], window=window), np.dtype(dtype))
    n = router.STACK_PROMPT_MIN_L - 1  # a shorter prompt: its heads apart
    short = make_plan(q[:, :, :n], k[:, :, :n], v[:, :, :n], causal=True, window=window)
    assert stacked.stacks(make_plan(q, k, v, causal=True, window=window)) == (group > 1)
    assert not stacked.stacks(short)
