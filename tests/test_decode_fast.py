"""The decode step's opt-in fast road (precision="fast"): int8 K scored against the query rows
rounded to int8, the weights rounded to int16 for the values' integer products. Within its
stated bound of the exact road, never silently the exact road, the same scores on every clone
and in the NumPy emulation, the same outputs on the clones whose integers and float32
operations are the same, refused by name for bad values."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.conftest import tol

import qkv
from qkv import reference
from qkv.engine import decoding
from qkv.engine.kernels import decode_fast, native_decode, native_lib

FAST, EXACT = decoding.NATIVE_FAST, decoding.NATIVE
T32 = tol("fast path", np.float32)
EMUL = 2.0**-13  # the emulation against the native step: four units of a block's weights


def _clones() -> list[str]:
    """The clones this CPU runs (the native library built), narrowest first, then "" (none
    forced: the widest road, which on a CPU with AVX512_VNNI is a piece of its own)."""
    lib = native_lib.library()[0]
    if lib is None or native_lib.switched_off():
        return []
    best = lib.qkv_best_isa()
    return [name for name, code in native_lib.ISAS.items() if code <= best] + [""]


CLONES = _clones()


def _case(rng, B, H, kvh, L, d, S, dv=None):
    q = rng.standard_normal((B, H, L, d)).astype(np.float32)
    k = rng.standard_normal((B, kvh, S, d)).astype(np.float32)
    v = rng.standard_normal((B, kvh, S, dv or d)).astype(np.float32)
    kc, ks = qkv.quantize_kv(k, "int8")
    vc, vs = qkv.quantize_kv(v, "int8")
    return q, kc, ks, vc, vs


def _paged(x, page, order):
    """``(B, kvh, S, ·)`` (or scales ``(B, kvh, S)``) as pages ``(blocks, page, kvh, ·)`` in
    the block order ``order`` (B x S/page ids)."""
    B, kvh, S = x.shape[:3]
    per = S // page
    y = np.moveaxis(x, 1, 2).reshape(B * per, page, kvh, *x.shape[3:])
    out = np.zeros_like(y)
    out[order.reshape(-1)] = y
    return out


def _run(precision, q, kc, ks, vc, vs, lengths=None, paged=None, threads=None):
    """``(out, lse, plan)`` of one planned step."""
    if paged is None:
        plan = qkv.plan_decode(
            q, kc, vc, kv_format="int8", k_scale=ks, v_scale=vs, seqlens=lengths,
            precision=precision, threads=threads,
        )  # fmt: skip
        out, lse = plan.run(q, kc, vc, k_scale=ks, v_scale=vs, return_lse=True)
        return out, lse, plan
    page, table = paged
    kp, vp, ksp, vsp = (_paged(x, page, table) for x in (kc, vc, ks, vs))
    plan = qkv.plan_decode(
        q, kp, vp, kv_format="int8", k_scale=ksp, v_scale=vsp, seqlens=lengths,
        block_table=table, precision=precision, threads=threads,
    )  # fmt: skip
    out, lse = plan.run(q, kp, vp, k_scale=ksp, v_scale=vsp, return_lse=True)
    return out, lse, plan


def _keys(lengths, B, S):
    n = np.full(B, S) if lengths is None else np.asarray(lengths)
    return np.arange(S)[None, :] < n[:, None]


def _check_bound(fast, exact, q, kc, ks, vc, vs, scale, keys):
    """|fast - exact| within the stated bound, plus float32's rounding of both roads."""
    k = qkv.dequantize_kv(kc, ks, "int8")
    v = qkv.dequantize_kv(vc, vs, "int8")
    b = decode_fast.bound(q, k, v, scale, keys)
    vmax = float(np.abs(v).max(initial=0.0))
    slack = T32["atol"] * vmax + T32["rtol"] * np.abs(exact)
    err = np.abs(fast.astype(np.float64) - exact)
    assert (err <= b + slack).all(), f"worst excess {float((err - b - slack).max()):.3g}"


@st.composite
def shapes(draw):
    kvh = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 4]))
    d = draw(st.sampled_from([8, 16, 24, 40, 64, 100, 128]))
    B = draw(st.integers(1, 3))
    L = draw(st.integers(1, 2))
    paged = draw(st.booleans())
    page = draw(st.sampled_from([1, 4, 16]))
    S = draw(st.integers(1, 200))
    if paged:
        S = -(-S // page) * page
    lengths = draw(st.lists(st.integers(0, S), min_size=B, max_size=B))
    if draw(st.booleans()):
        lengths[0] = S  # at least one full sequence
    seed = draw(st.integers(0, 2**31 - 1))
    return B, kvh * group, kvh, L, d, S, lengths, paged, page, seed


@pytest.mark.skipif(not CLONES, reason="the native library is not built or is switched off")
@settings(max_examples=40, deadline=None)
@given(shapes())
def test_fast_road_within_its_bound_of_the_exact_road_on_every_clone(case):
    B, H, kvh, L, d, S, lengths, paged, page, seed = case
    rng = np.random.default_rng(seed)
    q, kc, ks, vc, vs = _case(rng, B, H, kvh, L, d, S)
    pages = None
    if paged:
        table = rng.permutation(B * (S // page)).reshape(B, S // page).astype(np.int32)
        pages = (page, table)
    keys = _keys(lengths, B, S)
    scale = 1 / np.sqrt(d)
    seen = []
    for clone in CLONES:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("QKV_NATIVE_ISA", clone)
            fast, lse_f, plan = _run("fast", q, kc, ks, vc, vs, lengths, pages)
            exact, lse_e, plan_e = _run("exact", q, kc, ks, vc, vs, lengths, pages)
        assert (plan.route, plan_e.route) == (FAST, EXACT)
        _check_bound(fast, exact, q, kc, ks, vc, vs, scale, keys)
        seen.append((fast, lse_f))
        # never the exact road in disguise: its rows are not all int8 values times a scale
        codes, s = decode_fast.quantize_rows(q)
        if keys.any() and not np.array_equal(codes * s[..., None], q):
            assert not np.array_equal(lse_f, lse_e)
        # the emulation: the same scores, the softmax in float64, the weights rounded alike
        # (a weight whose float32 value times 32767 / max lies within float32's rounding of a
        # half may round a unit the other way: EMUL's allowance, far below the bound's)
        k = qkv.dequantize_kv(kc, ks, "int8")
        v = qkv.dequantize_kv(vc, vs, "int8")
        o64, l64 = decode_fast.attend(q, kc, ks, vc, vs, scale, keys=keys)
        vmax = float(np.abs(v).max(initial=0.0))
        np.testing.assert_allclose(fast, o64, rtol=T32["rtol"], atol=T32["atol"] + EMUL * vmax)
        np.testing.assert_allclose(lse_f, l64, **T32)
        # and the exact road still equals the float64 reference on the stored values
        want = np.zeros_like(o64)
        for b in range(B):
            n = int(keys[b].sum())
            if n:
                want[b] = reference.attention(q[b], k[b, :, :n], v[b, :, :n])
        np.testing.assert_allclose(exact, want, **T32)
    # every clone: the same outputs to float32's rounding, and to a weight that lies within
    # float32's rounding of a half rounding a unit one way in one clone and the other way in
    # another (each clone lies within EMUL of the emulation: twice that between two; found by
    # a case of 3 keys, d 24, pages of 16, where the baseline clone's float32 weights differed
    # in their last bits from the vector clones')
    vmax = float(np.abs(qkv.dequantize_kv(vc, vs, "int8")).max(initial=0.0))
    for fast, lse in seen[1:]:
        np.testing.assert_allclose(
            fast, seen[0][0], rtol=T32["rtol"], atol=T32["atol"] + 2 * EMUL * vmax
        )
        np.testing.assert_array_equal(np.isinf(lse), np.isinf(seen[0][1]))


@pytest.mark.skipif(not CLONES, reason="the native library is not built or is switched off")
@pytest.mark.parametrize("d", [8, 24, 64, 128])
def test_every_clone_gives_the_emulations_scores_bit_for_bit(monkeypatch, d):
    # one key per sequence: the log-sum-exp is the score itself
    rng = np.random.default_rng(d)
    q, kc, ks, vc, vs = _case(rng, 3, 8, 2, 1, d, 1)
    q[0, 0, 0, :] = 0  # a row of zeros: scale 0, score 0
    want = decode_fast.scores(q, kc, ks, 1 / np.sqrt(d))[..., 0]
    for clone in CLONES:
        monkeypatch.setenv("QKV_NATIVE_ISA", clone)
        _, lse, plan = _run("fast", q, kc, ks, vc, vs)
        assert plan.route == FAST
        np.testing.assert_array_equal(lse, want, err_msg=clone)


def test_the_emulation_runs_where_the_native_step_is_off(monkeypatch):
    rng = np.random.default_rng(5)
    q, kc, ks, vc, vs = _case(rng, 2, 8, 2, 1, 64, 70)
    monkeypatch.setenv("QKV_NATIVE", "0")
    out, lse, plan = _run("fast", q, kc, ks, vc, vs, [70, 33])
    assert plan.route == decoding.NUMPY_FAST
    o64, l64 = decode_fast.attend(q, kc, ks, vc, vs, 0.125, keys=_keys([70, 33], 2, 70))
    np.testing.assert_allclose(out, o64, **T32)
    np.testing.assert_allclose(lse, l64, **T32)
    exact, _, plan_e = _run("exact", q, kc, ks, vc, vs, [70, 33])
    assert plan_e.route == decoding.NUMPY
    assert not np.array_equal(out, exact)
    _check_bound(out, exact, q, kc, ks, vc, vs, 0.125, _keys([70, 33], 2, 70))


def test_bound_holds_for_the_emulation_against_the_exact_road_with_large_logits():
    # q large: scores of tens, where e^{2ε} − 1 is not small; the bound still holds
    rng = np.random.default_rng(9)
    q, kc, ks, vc, vs = _case(rng, 1, 4, 1, 1, 32, 50)
    q *= 8
    k = qkv.dequantize_kv(kc, ks, "int8")
    v = qkv.dequantize_kv(vc, vs, "int8")
    o, _ = decode_fast.attend(q, kc, ks, vc, vs, 1 / np.sqrt(32))
    exact = reference.attention(q, k, v)
    b = decode_fast.bound(q, k, v, 1 / np.sqrt(32))
    assert (np.abs(o - exact) <= b + 1e-12).all()
    assert (np.abs(o - exact) > 0).any()


@pytest.mark.parametrize("bad", ["quick", "Fast", None, 1])
def test_bad_precision_values_are_refused_by_name(bad):
    rng = np.random.default_rng(0)
    q, kc, ks, vc, vs = _case(rng, 1, 2, 1, 1, 16, 8)
    msg = r"precision: expected 'exact' or 'fast'"
    with pytest.raises(ValueError, match=msg):
        qkv.plan_decode(q, kc, vc, kv_format="int8", k_scale=ks, v_scale=vs, precision=bad)
    cache = qkv.KVCache(1, 1, 16, dtype="int8")
    cache.append(rng.standard_normal((1, 1, 3, 16)), rng.standard_normal((1, 1, 3, 16)))
    with pytest.raises(ValueError, match=msg):
        cache.attend(q, precision=bad)
    pool = qkv.PagedKVCache(4, 4, 1, 16, dtype="int8")
    s = pool.allocate()
    pool.append(s, rng.standard_normal((1, 3, 16)), rng.standard_normal((1, 3, 16)))
    with pytest.raises(ValueError, match=msg):
        pool.attend(q, precision=bad)


@pytest.mark.parametrize("form", [None, "bfloat16", "float16", "float8_e4m3fn"])
def test_fast_on_a_form_it_does_not_change_runs_the_exact_road(form):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 4, 1, 32)).astype(np.float32)
    k, v = rng.standard_normal((2, 2, 2, 40, 32)).astype(np.float32)
    scales = {}
    if form is not None:
        (k, ks), (v, vs) = qkv.quantize_kv(k, form), qkv.quantize_kv(v, form)
        if ks is not None:
            scales = dict(k_scale=ks, v_scale=vs)
    plans = [
        qkv.plan_decode(q, k, v, kv_format=form, precision=p, **scales) for p in ("exact", "fast")
    ]
    exact, fast = (p.run(q, k, v, **scales) for p in plans)
    assert plans[1].route == plans[0].route
    np.testing.assert_array_equal(fast, exact)
    why = dict(plans[1].refused)
    assert "precision='fast' rounds q only for int8" in why[FAST]
    assert FAST not in dict(plans[0].refused)  # an exact step's walk skips the fast rows


def _cache_case(rng, d=64, n=(50, 20)):
    cache = qkv.KVCache(2, 2, d, dtype="int8")
    for b, m in enumerate(n):
        cache.append(
            rng.standard_normal((2, m, d)).astype(np.float32),
            rng.standard_normal((2, m, d)).astype(np.float32),
            seq=b,
        )
    return cache


@pytest.mark.parametrize("native", [True, False])
def test_caches_take_the_fast_road_when_asked(monkeypatch, native):
    if not native:
        monkeypatch.setenv("QKV_NATIVE", "0")
    elif not CLONES:
        pytest.skip("the native library is not built")
    rng = np.random.default_rng(2)
    d = 64
    q = rng.standard_normal((2, 8, 1, d)).astype(np.float32)
    cache = _cache_case(rng, d)
    exact = cache.attend(q)
    fast = cache.attend(q, precision="fast")
    again = cache.attend(q, precision="fast")  # the memo keeps the road apart
    np.testing.assert_array_equal(fast, again)
    np.testing.assert_array_equal(cache.attend(q), exact)
    assert not np.array_equal(fast, exact)
    kc, ks = cache._k, cache._ks
    k = qkv.dequantize_kv(kc, ks, "int8")[:, :, :50]
    v = qkv.dequantize_kv(cache._v, cache._vs, "int8")[:, :, :50]
    keys = _keys([50, 20], 2, 50)
    b = decode_fast.bound(q, k, v, 1 / np.sqrt(d), keys)
    slack = T32["atol"] * float(np.abs(v).max()) + T32["rtol"] * np.abs(exact)
    assert (np.abs(fast - exact) <= b + slack).all()

    pool = qkv.PagedKVCache(16, 8, 2, d, dtype="int8")
    seqs = [pool.allocate() for _ in range(2)]
    for s, m in zip(seqs, (50, 20), strict=True):
        pool.append(s, k[s, :, :m], v[s, :, :m])
    pexact = pool.attend(q)
    pfast = pool.attend(q, precision="fast")
    assert not np.array_equal(pfast, pexact)
    assert (np.abs(pfast - pexact) <= b + slack + T32["atol"]).all()


def test_the_native_plan_carries_the_fast_code():
    if not CLONES:
        pytest.skip("the native library is not built")
    p = native_decode.DecodePlan.plan(
        (1, 2, 1, 1, 8, 8, 4), f64=False, kv_format="int8", precision="fast"
    )
    assert p is not None and p.precision == "fast"
    assert native_decode.format_code("int8", "fast") == native_lib.KV_FORMATS["int8"] | 256
    assert native_decode.format_code("bfloat16", "fast") == native_lib.KV_FORMATS["bfloat16"]
    assert native_decode.format_code(None, "fast") == 0


@st.composite
def long_shapes(draw):
    """Runs of keys past one block and past a piece (256 keys: with 2 threads a run of 512 or
    more is split), block lengths of any remainder, odd counts, head sizes with a road of
    their own (64, 128) and without (40), query rows scaled large (sharp weights: most of a
    block rounds to 0) or small (flat ones)."""
    d = draw(st.sampled_from([40, 64, 128]))
    group = draw(st.sampled_from([1, 3, 4]))
    S = draw(st.integers(60, 700))
    lengths = [S, draw(st.integers(1, S))]
    lo = min(draw(st.integers(0, 70)), lengths[1] - 1)  # (a mask of one run per sequence)
    return (
        d,
        group,
        S,
        lengths,
        lo,
        draw(st.sampled_from([1e-3, 1.0, 8.0])),
        draw(st.integers(1, 2)),
    )


@pytest.mark.skipif(not CLONES, reason="the native library is not built or is switched off")
@settings(max_examples=25, deadline=None)
@given(long_shapes(), st.integers(0, 2**31 - 1))
def test_fast_road_within_its_bound_over_many_blocks_and_pieces(case, seed):
    d, group, S, lengths, lo, qs, threads = case
    rng = np.random.default_rng(seed)
    q, kc, ks, vc, vs = _case(rng, 2, 2 * group, 2, 1, d, S)
    q *= qs
    vs[:, :, ::7] *= 1e-4  # some value rows tiny: their weights round to few units
    keys = _keys(lengths, 2, S)
    keys[:, :lo] = False  # runs that start past 0: blocks from lo
    mask = keys[:, None, None, :]
    k = qkv.dequantize_kv(kc, ks, "int8").astype(np.float64)
    v = qkv.dequantize_kv(vc, vs, "int8").astype(np.float64)
    # the exact road's output on the stored K/V in float64
    s = np.einsum("bhd,bhsd->bhs", q.reshape(2, 2, group, d)[:, :, :, :].reshape(2, 2 * group, d),
                  np.repeat(k, group, axis=1)) / np.sqrt(d)  # fmt: skip
    s = np.where(mask[:, :, 0], s, -np.inf)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    p = np.where(np.isfinite(m), np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    tot = p.sum(axis=-1, keepdims=True)
    want = np.einsum("bhs,bhsd->bhd", p, np.repeat(v, group, axis=1))
    want = np.where(tot > 0, want / np.where(tot > 0, tot, 1.0), 0.0)[:, :, None, :]
    b = decode_fast.bound(q, k, v, 1 / np.sqrt(d), keys)
    vmax = float(np.abs(v).max(initial=0.0))
    for clone in CLONES:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("QKV_NATIVE_ISA", clone)
            plan = qkv.plan_decode(
                q, kc, vc, kv_format="int8", k_scale=ks, v_scale=vs, mask=mask,
                precision="fast", threads=threads,
            )  # fmt: skip
            fast = plan.run(q, kc, vc, k_scale=ks, v_scale=vs)
        assert plan.route == FAST
        slack = T32["atol"] * vmax + T32["rtol"] * np.abs(want)
        err = np.abs(fast.astype(np.float64) - want)
        assert (err <= b + slack).all(), (
            f"{clone}: worst excess {float((err - b - slack).max()):.3g}"
        )


def _direct(rng, B, kvh, S, d, tiny=None):
    """int8 K/V codes and scales drawn directly (codes in [-127, 127], each value row's
    largest 127, as quantize_kv stores them; rows in ``tiny`` scaled by 1e-5)."""
    kc = rng.integers(-127, 128, (B, kvh, S, d)).astype(np.int8)
    vc = rng.integers(-127, 128, (B, kvh, S, d)).astype(np.int8)
    vc[..., 0] = 127
    ks = rng.uniform(0.005, 0.02, (B, kvh, S)).astype(np.float32)
    vs = rng.uniform(0.005, 0.02, (B, kvh, S)).astype(np.float32)
    if tiny is not None:
        vs[:, :, tiny] *= np.float32(1e-5)
    return kc, ks, vc, vs


@pytest.mark.skipif(not CLONES, reason="the native library is not built or is switched off")
def test_a_weight_below_half_a_unit_of_its_blocks_largest_rounds_to_zero():
    # q 0: every score 0, every weight 1, the weights u = the value rows' scales; row 1's is
    # 1e-5 of row 0's, so 32767 · u / max|u| < 1/2 rounds it to 0: its values drop out of the
    # fast road's output (column 1, where row 0's code is 0), not of the exact road's
    kc = np.zeros((1, 1, 2, 64), np.int8)
    vc = np.zeros((1, 1, 2, 64), np.int8)
    vc[0, 0, 0, 0] = 127
    vc[0, 0, 1, 1] = 127
    ks = np.ones((1, 1, 2), np.float32)
    vs = np.array([[[1.0, 1e-5]]], np.float32)
    q = np.zeros((1, 4, 1, 64), np.float32)
    o64, _ = decode_fast.attend(q, kc, ks, vc, vs, 0.125)
    assert o64[0, 0, 0, 1] == 0 and o64[0, 0, 0, 0] == 127 / 2
    for clone in CLONES:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("QKV_NATIVE_ISA", clone)
            fast, _, _ = _run("fast", q, kc, ks, vc, vs)
            exact, _, _ = _run("exact", q, kc, ks, vc, vs)
        assert (fast[..., 1] == 0).all() and (fast[..., 0] == np.float32(127 / 2)).all(), clone
        assert (exact[..., 1] > 0).all()
        v = qkv.dequantize_kv(vc, vs, "int8")
        bound = decode_fast.bound(q, qkv.dequantize_kv(kc, ks, "int8"), v, 0.125)
        assert (np.abs(fast - exact) <= bound).all()


@pytest.mark.skipif(len(CLONES) < 2, reason="one clone or none")
@pytest.mark.parametrize("d", [40, 64, 128])
@pytest.mark.parametrize("paged", [False, True])
def test_the_vector_clones_give_the_same_outputs_where_the_weights_sum_exactly(d, paged):
    # q 0: every weight exactly 1 and every denominator an exact count, so each output is
    # the block sums of integer products taken into float32 by the same operations: the
    # AVX2, AVX-512 and VNNI roads give the same bits (the baseline clone, without FMA, takes
    # the last step with two roundings: within float32's rounding of them)
    rng = np.random.default_rng(d)
    S = 16 * 13
    kc, ks, vc, vs = _direct(rng, 2, 2, S, d, tiny=slice(3, None, 5))
    q = np.zeros((2, 8, 1, d), np.float32)
    table = rng.permutation(2 * (S // 16)).reshape(2, -1).astype(np.int32)
    lengths = [S, 131]
    got = {}
    for clone in CLONES:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("QKV_NATIVE_ISA", clone)
            got[clone], _, _ = _run(
                "fast", q, kc, ks, vc, vs, lengths, (16, table) if paged else None, threads=1
            )
    o64, _ = decode_fast.attend(q, kc, ks, vc, vs, 1.0, keys=_keys(lengths, 2, S))
    for clone, out in got.items():
        np.testing.assert_allclose(out, o64, **T32, err_msg=clone)
        if clone != "baseline":
            np.testing.assert_array_equal(out, got[CLONES[-1]], err_msg=clone)
