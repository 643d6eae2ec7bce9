"""The native fused prefill equals qkv.reference: shapes, masks, windows, grouped heads, dtypes,
extreme and non-finite values, every vector clone; and it switches off as documented."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.conftest import bound, tol

import qkv
from qkv import reference
from qkv.engine import run
from qkv.engine.grad import reference_attention_vjp
from qkv.engine.kernels import dispatch, native, native_lib, router
from qkv.testing import strategies as qs
from qkv.validate import make_plan

_lib, _why = native_lib.library()
_gemm, _why_gemm = native._gemm()
pytestmark = pytest.mark.skipif(
    _lib is None or _gemm is None, reason=f"native kernels unavailable: {_why or _why_gemm}"
)

# Tolerances against the float64 reference, relative to the values' size.
TOL = bound("kernels")
ISAS = list(native.ISAS)  # capped by the CPU: a clone it cannot run falls back to a narrower one


def check(out, lse, q, k, v, dtype=np.float64, **kw):
    """Assert (out, lse) equal the reference on the dtype-rounded inputs (NaN where it is)."""
    with np.errstate(invalid="ignore"):  # NaN and inf inputs: NaN rows, by policy
        ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
    tol = TOL[dtype]
    finite_v = np.abs(v[np.isfinite(v)]) if np.size(v) else np.zeros(1)
    scale = max(1.0, float(finite_v.max(initial=0.0)))
    np.testing.assert_allclose(out, ref_out, rtol=tol, atol=tol * scale)
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    assert np.array_equal(np.isnan(lse), np.isnan(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=tol, atol=tol)


def rand(rng, shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)


@pytest.fixture
def spy(monkeypatch):
    """Count the calls that reach the native kernel through qkv.attention."""
    calls = []
    real = native.attend
    monkeypatch.setattr(native, "attend", lambda plan, **kw: calls.append(plan) or real(plan, **kw))
    monkeypatch.delenv("QKV_NATIVE", raising=False)
    run.forget()  # (a plain call's kept set-up, from an earlier test, skips attend)
    run._counted.cache_clear()
    return calls


SIZES = [1, 3, 5, 7, 9, 13, 17]
STRUCTURE = [
    dict(),
    dict(causal=True),
    dict(window=(2, 1)),
    dict(window=(0, None)),
    dict(causal=True, window=(3, None)),
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("L, S", [(L, S) for L in SIZES for S in SIZES if (L + S) % 4 == 0])
@pytest.mark.parametrize("kw", STRUCTURE, ids=str)
def test_native_equals_reference_at_tile_edges(L, S, kw, isa):
    rng = np.random.default_rng(L * 100 + S)
    q, k, v = rand(rng, (2, 4, L, 6)), rand(rng, (2, 2, S, 6)), rand(rng, (2, 2, S, 3))
    out, lse = native.attend(make_plan(q, k, v, **kw), block_q=4, block_k=8, isa=isa)
    check(out, lse, q, k, v, **kw)


@st.composite
def problems(draw):
    """Shapes, grouped or broadcast heads, dtype, scale, causal, window, mask, tiles, clone.

    Shapes, values (exact in every dtype), windows and masks come from
    :mod:`qkv.testing.strategies`; the plain ``(L, d)`` layout, K/V broadcast over batch and
    heads, and the kernel's own tiles, clone and threads are drawn here.
    """
    kind = draw(st.sampled_from(["2d", "heads", "gqa", "batch-broadcast"]))
    s = draw(
        qs.shapes(
            batch=(1, 3),
            heads=(1, 3),
            L=(1, 20),
            S=(1, 20),
            d=(1, 9),
            grouped=kind == "gqa",
            dv_differs=draw(st.booleans()),
        )
    )
    q, k, v = draw(qs.inputs(st.just(s)))
    if kind == "2d":
        q, k, v = q[0, 0], k[0, 0], v[0, 0]
    elif kind == "batch-broadcast":
        k, v = k[0, 0], v[0, 0]  # k/v broadcast over batch and heads
    dtype = draw(st.sampled_from([np.float64, np.float32, np.float16]))
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    L, S = s.L, s.S
    opts = {"causal": draw(st.booleans())}
    if draw(st.booleans()):
        opts["scale"] = draw(st.floats(0.05, 4.0))
    if draw(st.booleans()):
        opts["window"] = draw(qs.windows(max_side=6))
    mask_kind = draw(st.sampled_from([None, "bool", "float", "bool-row", "bool-heads"]))
    if mask_kind == "bool":
        opts["mask"] = draw(qs.bool_masks(1, 1, L, S, every_row_sees=False))[0, 0]
    elif mask_kind == "bool-row":  # broadcast over rows
        opts["mask"] = draw(qs.bool_masks(1, 1, 1, S, every_row_sees=False))[0, 0, 0]
    elif mask_kind == "bool-heads" and q.ndim == 4:  # per head, broadcast over rows
        opts["mask"] = draw(qs.bool_masks(1, q.shape[1], 1, S, every_row_sees=False))[0]
    elif mask_kind == "float":
        bias = draw(qs.float_masks(1, 1, L, S))[0, 0]
        keep = draw(qs.bool_masks(1, 1, L, S, every_row_sees=False))[0, 0]
        opts["mask"] = np.where(keep, bias, -np.inf).astype(dtype)
    tiles = dict(block_q=draw(st.integers(1, 8)), block_k=draw(st.integers(1, 8)))
    run = dict(tiles, isa=draw(st.sampled_from(ISAS)), threads=draw(st.integers(1, 3)))
    return q, k, v, opts, run


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.sampled_from(["blas", "own"]))
def test_native_property(problem, products):
    """Either tile products: BLAS's or the library's own (tiles.h)."""
    q, k, v, opts, run = problem
    plan = make_plan(q, k, v, **opts)
    out, lse = native.attend(plan, products=products, **run)
    assert out.dtype == plan.acc_dtype and out.shape == plan.batch + (plan.L, plan.dv)
    f64 = [x.astype(np.float64) for x in (q, k, v)]
    check(out, lse, *f64, dtype=q.dtype.type, **opts)


@st.composite
def stored_problems(draw):
    """problems() with K/V stored as float16 or bfloat16 (rows strided in a wider buffer or
    not, some float16 subnormals) and q in float32."""
    q, k, v, opts, run = draw(problems())
    form = draw(st.sampled_from(["float16", "bfloat16"]))
    dt = np.dtype(np.float16) if form == "float16" else np.dtype(ml_dtypes.bfloat16)
    if draw(st.booleans()):  # float16's subnormals (below 6.1e-5) and bfloat16's small values
        k = k * 2.0**-18
    if "mask" in opts and opts["mask"].dtype.kind == "f":
        opts["mask"] = opts["mask"].astype(np.float32)
    k, v = (x.astype(np.float64).astype(dt) for x in (k, v))
    if draw(st.booleans()):  # rows of a wider buffer: the kernel reads their stride
        k, v = (np.concatenate([x, x[..., :3]], axis=-1)[..., : x.shape[-1]] for x in (k, v))
    return q.astype(np.float32), k, v, opts, run


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stored_problems(), st.sampled_from(["blas", "own"]))
def test_stored_half_kv_prefill_equals_reference(problem, products):
    """float16/bfloat16 K/V read as stored (widened per work item, exactly): bit for bit the
    float32 kernel's numbers on the widened K/V, and the float64 reference's; with either
    tile products."""
    q, k, v, opts, run = problem
    run = dict(run, products=products)
    plan = make_plan(q, k, v, keep_stored=True, **opts)
    out, lse = native.attend(plan, **run)
    wide_out, wide_lse = native.attend(plan.materialized(), **run)
    np.testing.assert_array_equal(out, wide_out)  # the same products of the same values
    np.testing.assert_array_equal(lse, wide_lse)
    f64 = [x.astype(np.float64) for x in (q, k, v)]
    check(out, lse, *f64, dtype=np.float32, **opts)


def test_float16_prefill_reads_kv_as_stored(monkeypatch):
    """qkv.attention's float16 prefill runs the stored-K/V kernel (no whole-array widening of
    K/V), in every clone, and equals the reference."""
    rng = np.random.default_rng(21)
    q, k = rand(rng, (1, 4, 300, 16), np.float16), rand(rng, (1, 2, 300, 16), np.float16)
    v = rand(rng, (1, 2, 300, 8), np.float16)
    ref = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), causal=True)
    monkeypatch.delenv("QKV_NATIVE", raising=False)
    calls = []
    real = native.attend_stored
    monkeypatch.setattr(native, "attend_stored", lambda p, **kw: calls.append(1) or real(p))
    for n, isa in enumerate(ISAS, start=1):
        monkeypatch.setenv("QKV_NATIVE_ISA", isa)
        out = qkv.attention(q, k, v, causal=True)
        assert len(calls) == n and out.dtype == np.float16
        np.testing.assert_allclose(out, ref, atol=TOL[np.float16], rtol=TOL[np.float16])


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("kw", STRUCTURE, ids=str)
def test_auto_prefill_runs_native_and_equals_reference(dtype, kw, spy):
    rng = np.random.default_rng(5)
    q, k = rand(rng, (1, 4, 300, 16), dtype), rand(rng, (1, 2, 300, 16), dtype)
    v = rand(rng, (1, 2, 300, 8), dtype)
    out = qkv.attention(q, k, v, **kw)
    assert spy and out.dtype == dtype
    ref = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), **kw)
    np.testing.assert_allclose(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("mask_shape", [(300, 260), (1, 260), (4, 1, 260), (2, 4, 300, 260)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masks_broadcast_and_combine_with_causal(mask_shape, kind, spy):
    rng = np.random.default_rng(7)
    q, k, v = rand(rng, (2, 4, 300, 8)), rand(rng, (2, 4, 260, 8)), rand(rng, (2, 4, 260, 5))
    if kind == "bool":
        mask = rng.random(mask_shape) < 0.6
    else:
        mask = rng.standard_normal(mask_shape) * 3
        mask[rng.random(mask_shape) < 0.3] = -np.inf
    for kw in (dict(), dict(causal=True), dict(window=(40, 3))):
        out, lse = qkv.attention(q, k, v, mask=mask, return_lse=True, **kw)
        check(out, lse, q, k, v, mask=mask, **kw)
    assert len(spy) == 3


def test_strided_and_broadcast_inputs():
    rng = np.random.default_rng(8)
    base = rand(rng, (3, 70, 2, 12), np.float32)  # (batch, L, heads, d): heads not outermost
    q = np.swapaxes(base, 1, 2)[..., :10]  # rows strided, last axis contiguous but cut
    k = rand(rng, (90, 10), np.float32)  # one K/V for every batch and head
    v = np.asfortranarray(rand(rng, (90, 6), np.float32))  # column-major: copied for BLAS
    plan = make_plan(q, k, v, causal=True)
    out, lse = native.attend(plan, block_q=16, block_k=32)
    f64 = [np.asarray(x, dtype=np.float64) for x in (q, k, v)]
    check(out, lse, *f64, dtype=np.float32, causal=True)


def test_rows_that_see_no_key_give_zero_and_neg_inf():
    rng = np.random.default_rng(9)
    q, k, v = rand(rng, (2, 50, 4)), rand(rng, (2, 30, 4)), rand(rng, (2, 30, 3))
    mask = np.ones((50, 30), dtype=bool)
    mask[10:20] = False  # ten rows see nothing
    for kw in (dict(causal=True, window=(0, None)), dict(mask=mask), dict(mask=mask, causal=True)):
        plan = make_plan(q, k, v, **kw)
        out, lse = native.attend(plan, block_q=8, block_k=8)
        check(out, lse, q, k, v, **kw)
        assert np.isfinite(out).all()
    # L > S under causal: the first L - S rows sit before every key
    out, lse = native.attend(make_plan(q, k, v, causal=True), block_q=7, block_k=5)
    assert np.all(out[:, :20] == 0) and np.all(np.isneginf(lse[:, :20]))
    check(out, lse, q, k, v, causal=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nan_and_inf_propagate_to_their_rows_only(dtype):
    rng = np.random.default_rng(10)
    q, k, v = (
        rand(rng, (2, 40, 4), dtype),
        rand(rng, (2, 40, 4), dtype),
        rand(rng, (2, 40, 3), dtype),
    )
    q[0, 7, 1] = np.nan  # row 7 of head 0
    k[1, 30, 2] = np.inf  # key 30 of head 1: the rows that see it
    for kw in (dict(), dict(causal=True), dict(window=(3, 3))):
        out, lse = native.attend(make_plan(q, k, v, **kw), block_q=6, block_k=9)
        with np.errstate(invalid="ignore"):
            ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
        assert np.array_equal(np.isnan(out), np.isnan(ref_out)), kw
        assert np.array_equal(np.isnan(lse), np.isnan(ref_lse)), kw
        check(out, lse, q, k, v, dtype=dtype, **kw)
    # a NaN value reaches every row that sees its key (a hidden key's value may or may not
    # reach the rows that cannot see it, as in the reference's dense product: not asserted)
    v[1, 5, 0] = np.nan
    out, lse = native.attend(make_plan(q, k, v), block_q=6, block_k=9)
    check(out, lse, q, k, v, dtype=dtype)
    assert np.isnan(out[1, :, 0]).all() and not np.isnan(out[0, :7]).any()


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_extreme_values_match_reference(dtype, spy):
    rng = np.random.default_rng(11)
    big = float(np.finfo(dtype).max)
    q, k = rand(rng, (2, 200, 8), dtype), rand(rng, (2, 200, 8), dtype)
    # huge logits (one-hot rows), values near the dtype's maximum (an accumulator of S of them
    # overflows: the dispatcher reruns with the values scaled), and a float16 q·k beyond 65504
    cases = [
        (q * dtype(8), k * dtype(8), rand(rng, (2, 200, 3), dtype)),
        (q, k, (rand(rng, (2, 200, 3)) * big / 4).astype(dtype)),
        (np.full((2, 200, 8), 200, dtype), np.full((2, 200, 8), 200, dtype), q[..., :3]),
    ]
    for qq, kk, vv in cases:
        out = qkv.attention(qq, kk, vv, causal=True)
        assert out.dtype == dtype and np.isfinite(out).all()
        ref = reference.attention(*(x.astype(np.float64) for x in (qq, kk, vv)), causal=True)
        vmax = float(np.abs(vv.astype(np.float64)).max())
        np.testing.assert_allclose(out, ref, rtol=TOL[dtype], atol=TOL[dtype] * max(1.0, vmax))
    assert spy


def test_float32_scale_beyond_its_range_runs_in_float64(spy):
    rng = np.random.default_rng(12)
    q, k, v = (rand(rng, (2, 150, 4), np.float32) for _ in range(3))
    for scale in (1e-40, 1e39):  # subnormal and beyond float32: the plan is redone in float64
        out = qkv.attention(q, k, v, causal=True, scale=scale)
        ref = reference.attention(
            *(x.astype(np.float64) for x in (q, k, v)), causal=True, scale=scale
        )
        np.testing.assert_allclose(out, ref, rtol=TOL[np.float32], atol=TOL[np.float32])
    assert spy and all(p.acc_dtype == np.float64 for p in spy)


def test_sinks_are_added_after_the_native_kernel(spy):
    rng = np.random.default_rng(13)
    q, k, v = rand(rng, (1, 4, 200, 8)), rand(rng, (1, 2, 200, 8)), rand(rng, (1, 2, 200, 4))
    sinks = np.array([0.5, -1.0, 2.0, 0.0])
    out, lse = qkv.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    ref_out, ref_lse = reference.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    np.testing.assert_allclose(out, ref_out, atol=TOL[np.float64])
    np.testing.assert_allclose(lse, ref_lse, atol=TOL[np.float64])
    assert spy


@pytest.mark.parametrize("variant", [dict(softcap=5.0), dict(alibi_slopes=np.ones(4))])
def test_score_variants_run_on_the_numpy_kernels(variant, spy):
    rng = np.random.default_rng(14)
    q, k, v = rand(rng, (1, 4, 200, 8)), rand(rng, (1, 4, 200, 8)), rand(rng, (1, 4, 200, 4))
    assert not router.holds(router.PREFILL, make_plan(q, k, v, **variant))
    out = qkv.attention(q, k, v, causal=True, **variant)
    np.testing.assert_allclose(
        out, reference.attention(q, k, v, causal=True, **variant), atol=TOL[np.float64]
    )
    assert not spy


def test_threads_and_clones_agree():
    rng = np.random.default_rng(15)
    q, k, v = (rand(rng, (3, 257, 16), np.float32) for _ in range(3))
    plan = make_plan(q, k, v, causal=True)
    first, _ = native.attend(plan, threads=1, isa="baseline", block_q=32, block_k=64)
    for isa in ISAS:
        for threads in (1, 2, 5, 13):  # (13: more threads than the tasks' runs kept on the stack)
            out, _ = native.attend(plan, threads=threads, isa=isa, block_q=32, block_k=64)
            np.testing.assert_allclose(out, first, **tol("threads and clones", np.float32))


def test_switched_off_by_environment(monkeypatch):
    rng = np.random.default_rng(16)
    q, k, v = (rand(rng, (2, 300, 8), np.float32) for _ in range(3))
    plan = make_plan(q, k, v, causal=True)
    monkeypatch.setenv("QKV_NATIVE", "0")
    assert not router.holds(router.PREFILL, plan)
    assert native.info()["active"] is False and "QKV_NATIVE=0" in native.info()["reason"]
    called = []
    monkeypatch.setattr(native, "attend", lambda *a, **kw: called.append(1))
    out, _ = dispatch.attend(plan)
    assert not called
    np.testing.assert_allclose(out, reference.attention(q, k, v, causal=True), atol=TOL[np.float32])
    monkeypatch.delenv("QKV_NATIVE")
    assert router.holds(router.PREFILL, plan) and native.info()["active"] is True


def test_info_names_the_clone_and_the_kernels(monkeypatch):
    monkeypatch.delenv("QKV_NATIVE", raising=False)
    got = native.info()
    assert got["isa"] in native.ISAS and got["library"].startswith("_native")
    assert any(got["kernels"].values())


# --- the backward ---------------------------------------------------------------------------


def check_grads(got, q, k, v, d_out, dtype=np.float64, **kw):
    """Assert (dq, dk, dv) equal the reference vjp on the dtype-rounded inputs."""
    want = reference_attention_vjp(q, k, v, d_out, **kw)
    tol = TOL[dtype] * 10  # sums over many more terms than the forward
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        size = max(1.0, float(np.abs(w).max(initial=0.0)))
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * size, err_msg=name)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.integers(0, 2**16))
def test_native_backward_property(problem, seed):
    q, k, v, opts, run = problem
    if q.dtype == np.float16:
        q, k, v = (x.astype(np.float32) for x in (q, k, v))
        if np.asarray(opts.get("mask")).dtype == np.float16:
            opts["mask"] = opts["mask"].astype(np.float32)
    plan = make_plan(q, k, v, **opts)
    d_out = np.random.default_rng(seed).standard_normal(plan.batch + (plan.L, plan.dv))
    d_out = d_out.astype(plan.acc_dtype)
    out, lse = native.attend(plan)
    got = native.backward(plan, d_out, out, lse, **run)
    assert [g.shape for g in got] == [plan.q.shape, plan.k.shape, plan.v.shape]
    f64 = [x.astype(np.float64) for x in (q, k, v, d_out)]
    dq, dk, dv = got
    if dk.shape != k.shape:  # one K/V broadcast to every head: its gradient sums over them
        dk, dv = (g.reshape((-1,) + x.shape).sum(axis=0) for g, x in ((dk, k), (dv, v)))
    check_grads((dq, dk, dv), *f64, dtype=q.dtype.type, **opts)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stored_problems(), st.integers(0, 2**16))
def test_stored_half_kv_backward(problem, seed):
    """The backward reads float16/bfloat16 K/V as stored (each task widening its key block):
    on one thread bit for bit the gradients of K/V widened first (more threads add dQ's parts
    in any order), and the float64 reference's at float32's tolerance."""
    q, k, v, opts, run = problem
    plan = make_plan(q, k, v, keep_stored=True, **opts)
    d_out = np.random.default_rng(seed).standard_normal(plan.batch + (plan.L, plan.dv))
    d_out = d_out.astype(np.float32)
    out, lse = native.attend(plan)
    one = dict(run, threads=1)
    got = native.backward(plan, d_out, out, lse, **one)
    wide = native.backward(plan.materialized(), d_out, out, lse, **one)
    for g, w in zip(got, wide, strict=True):
        np.testing.assert_array_equal(g, w)
    dq, dk, dv = native.backward(plan, d_out, out, lse, **run)
    k, v = (x.astype(np.float32) for x in (k, v))
    if dk.shape != k.shape:  # one K/V broadcast to every head: its gradient sums over them
        dk, dv = (g.reshape((-1,) + x.shape).sum(axis=0) for g, x in ((dk, k), (dv, v)))
    f64 = [x.astype(np.float64) for x in (q, k, v, d_out)]
    check_grads((dq, dk, dv), *f64, dtype=np.float32, **opts)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "kw",
    STRUCTURE + [dict(causal=True, sinks=np.array([0.5, -1.0, 2.0, 0.0]))],
    ids=str,
)
def test_attention_vjp_runs_the_native_backward(dtype, kw, monkeypatch):
    monkeypatch.delenv("QKV_NATIVE", raising=False)
    calls = []
    real = native.backward
    monkeypatch.setattr(native, "backward", lambda *a, **k: calls.append(1) or real(*a, **k))
    rng = np.random.default_rng(21)
    q, k = rand(rng, (1, 4, 300, 16), dtype), rand(rng, (1, 2, 300, 16), dtype)
    v, d_out = rand(rng, (1, 2, 300, 8), dtype), rand(rng, (1, 4, 300, 8), dtype)
    out, lse = qkv.attention(q, k, v, return_lse=True, **kw)
    got = qkv.attention_vjp(q, k, v, d_out, out=out, lse=lse, **kw)
    want = reference_attention_vjp(*(x.astype(np.float64) for x in (q, k, v, d_out)), **kw)
    assert calls
    tol = TOL[dtype] * 10
    assert len(got) == len(want) == 3 + ("sinks" in kw)  # and dsinks
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)
    assert all(g.dtype == dtype for g in got[:3])


def test_backward_rows_without_keys_and_nan():
    rng = np.random.default_rng(22)
    q, k, v = rand(rng, (2, 50, 4)), rand(rng, (2, 30, 4)), rand(rng, (2, 30, 3))
    d_out = rand(rng, (2, 50, 3))
    plan = make_plan(q, k, v, causal=True)  # L > S: the first 20 rows see no key
    out, lse = native.attend(plan)
    got = native.backward(plan, d_out, out, lse, block_q=8, block_k=8)
    assert np.all(got[0][:, :20] == 0)
    check_grads(got, q, k, v, d_out, causal=True)
    q[1, 40, 0] = np.nan  # one row: its dq row, and every dk, dv row it sees, are NaN
    plan = make_plan(q, k, v, causal=True)
    out, lse = native.attend(plan)
    dq, dk, dv = native.backward(plan, d_out, out, lse, block_q=8, block_k=8)
    assert np.isnan(dq[1, 40]).all() and not np.isnan(dq[0]).any() and not np.isnan(dk[0]).any()
    assert np.isnan(dv[1, :21]).all() and not np.isnan(dv[1, 21:]).any()


def test_without_scipy_the_native_kernels_say_why(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "scipy.linalg", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "scipy.linalg.cython_blas", None)
    gemm, why = native_lib.gemm.__wrapped__()
    assert gemm is None and "SciPy" in why


# --- the packed varlen walk -----------------------------------------------------------------


def packed_reference(q, k, v, cq, ck, **kw):
    """qkv.reference on each packed sequence alone, in float64, packed back: output and lse."""
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]))
    lse = np.full(q.shape[:2], -np.inf)
    for b in range(len(cq) - 1):
        qb, kb, vb = (
            x[c[b] : c[b + 1]].astype(np.float64).transpose(1, 0, 2)
            for x, c in ((q, cq), (k, ck), (v, ck))
        )
        with np.errstate(invalid="ignore"):
            o, s = reference.attention(qb, kb, vb, return_lse=True, **kw)
        out[cq[b] : cq[b + 1]] = o.transpose(1, 0, 2)
        lse[cq[b] : cq[b + 1]] = s.T
    return out, lse


@st.composite
def packed_problems(draw):
    """Packed batches: lengths with 0 and 1, grouped heads, dtype, causal, window, tiles.

    Offsets, values and windows come from :mod:`qkv.testing.strategies`."""
    cq = draw(qs.cu_seqlens(batch=(1, 5), length=(0, 21)))
    n = len(cq) - 1
    same = draw(st.booleans())  # prompts (L == S) or any lengths
    ck = cq if same else draw(qs.cu_seqlens(batch=(n, n), length=(0, 21)))
    dtype = draw(st.sampled_from([np.float64, np.float32, np.float16]))
    kv, g = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    d, dv = draw(st.integers(1, 9)), draw(st.integers(1, 7))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = qs.values(rng, (cq[-1], kv * g, d)).astype(dtype)
    k = qs.values(rng, (ck[-1], kv, d)).astype(dtype)
    v = qs.values(rng, (ck[-1], kv, dv)).astype(dtype)
    opts = {"causal": draw(st.booleans()), "scale": draw(st.floats(0.05, 2.0))}
    if draw(st.booleans()):
        opts["window"] = draw(qs.windows(max_side=6))
    run = dict(
        block_q=draw(st.integers(1, 8)),
        block_k=draw(st.integers(1, 8)),
        isa=draw(st.sampled_from(ISAS)),
        threads=draw(st.integers(1, 3)),
    )
    return q, k, v, cq, ck, opts, run


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(packed_problems())
def test_native_packed_property(problem):
    q, k, v, cq, ck, opts, run = problem
    out, lse = native.attend_packed(q, k, v, cq, ck, **opts, **run)
    acc = np.float32 if q.dtype == np.float16 else q.dtype
    assert out.dtype == acc and out.shape == q.shape[:2] + v.shape[2:]
    ref_out, ref_lse = packed_reference(q, k, v, cq, ck, **opts)
    tol = TOL[q.dtype.type]
    np.testing.assert_allclose(out, ref_out, rtol=tol, atol=tol * 4)
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=tol, atol=tol)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(packed_problems(), st.sampled_from(["float16", "bfloat16"]), st.booleans())
def test_native_packed_stored_half_kv(problem, form, strided):
    """The packed walk reads float16/bfloat16 K/V as stored (widened per work item, exactly):
    bit for bit the numbers of K/V widened first, and the float64 reference's at float32's
    tolerance."""
    q, k, v, cq, ck, opts, run = problem
    dt = np.dtype(np.float16) if form == "float16" else np.dtype(ml_dtypes.bfloat16)
    q = q.astype(np.float32)
    k, v = (x.astype(np.float64).astype(dt) for x in (k, v))
    if strided:  # rows of a wider buffer
        k, v = (np.concatenate([x, x[..., :2]], axis=-1)[..., : x.shape[-1]] for x in (k, v))
    out, lse = native.attend_packed(q, k, v, cq, ck, **opts, **run)
    wide = native.attend_packed(
        q, k.astype(np.float32), v.astype(np.float32), cq, ck, **opts, **run
    )
    np.testing.assert_array_equal(out, wide[0])  # the same products of the same values
    np.testing.assert_array_equal(lse, wide[1])
    ref_out, ref_lse = packed_reference(
        q, k.astype(np.float64), v.astype(np.float64), cq, ck, **opts
    )
    tol = TOL[np.float32]
    np.testing.assert_allclose(out, ref_out, rtol=tol, atol=tol * 4)
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=tol, atol=tol)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kw", STRUCTURE, ids=str)
def test_native_packed_at_tile_edges_with_strided_inputs(kw, isa):
    """Sequences of 0, 1 and more tokens (L < S, L == S, L > S), 8 query heads over 2 kv heads,
    k and v read through views of one interleaved array; then one sequence alone."""
    rng = np.random.default_rng(len(str(kw)))
    lq, lk = [5, 0, 1, 13, 37, 3, 1, 9], [5, 4, 1, 13, 41, 0, 9, 2]
    cq, ck = (np.concatenate([[0], np.cumsum(x, dtype=np.int64)]) for x in (lq, lk))
    q = rand(rng, (cq[-1], 8, 6))
    kv = rand(rng, (ck[-1], 2, 12))
    k, v = kv[:, :, :6], kv[:, :, 6:9]  # token stride 24, head stride 12, not contiguous
    seqs = np.array([0, 2, 3, 4, 5, 6, 7])
    out, lse = native.attend_packed(
        q, k, v, cq, ck, scale=0.4, seqs=seqs, isa=isa, block_q=4, block_k=7, **kw
    )
    ref_out, ref_lse = packed_reference(q, k, v, cq, ck, scale=0.4, **kw)
    np.testing.assert_allclose(out, ref_out, rtol=TOL[np.float64], atol=TOL[np.float64])
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    only = native.attend_packed(q, k, v, cq, ck, scale=0.4, seqs=[4], **kw)[0]
    rows = slice(cq[4], cq[5])
    np.testing.assert_allclose(
        only[rows], ref_out[rows], rtol=TOL[np.float64], atol=TOL[np.float64]
    )
    assert not only[: cq[4]].any() and not only[cq[5] :].any()  # the others left 0


def test_native_packed_reports_non_finite_sequences():
    rng = np.random.default_rng(21)
    lens = [4, 6, 3]
    cu = np.concatenate([[0], np.cumsum(lens)])
    q, k, v = (rand(rng, (13, 2, 4)) for _ in range(3))
    v[5, 1, 0] = np.nan  # sequence 1
    bad: set[int] = set()
    out, _ = native.attend_packed(q, k, v, cu, cu, scale=0.5, causal=True, bad=bad)
    assert bad == {1}
    assert np.isfinite(out[:4]).all() and np.isfinite(out[10:]).all()


def test_attention_varlen_runs_the_native_walk(monkeypatch):
    """With the native kernels on, every sequence takes their packed walk in one call, but one
    of a single query and those of 2 to 8 causal rows (the decode step's); switched off, none
    does; both equal the reference, and overflow is redone."""
    monkeypatch.delenv("QKV_NATIVE", raising=False)
    calls = []
    real = native.attend_packed
    monkeypatch.setattr(
        native, "attend_packed", lambda *a, **kw: calls.append(list(kw["seqs"])) or real(*a, **kw)
    )
    rng = np.random.default_rng(22)
    lens = [3, 200, 2, 150, 0, 1]
    cu = np.concatenate([[0], np.cumsum(lens)])
    q = rand(rng, (cu[-1], 4, 16), np.float32)
    k, v = (rand(rng, (cu[-1], 2, 16), np.float32) for _ in range(2))
    want, _ = packed_reference(q, k, v, cu, cu, causal=True, scale=0.25)
    got = qkv.attention_varlen(q, k, v, cu, cu, causal=True)
    assert calls == [[1, 3]]  # (5: one query, a decoding step; 0 and 2: a few causal rows)
    np.testing.assert_allclose(got, want, atol=TOL[np.float32])
    monkeypatch.setenv("QKV_NATIVE", "0")
    np.testing.assert_allclose(
        qkv.attention_varlen(q, k, v, cu, cu, causal=True), want, atol=TOL[np.float32]
    )
    assert len(calls) == 1
    monkeypatch.delenv("QKV_NATIVE")
    big = qkv.attention_varlen(q * np.float32(1e20), k * np.float32(1e20), v, cu, cu, scale=1.0)
    want_big, _ = packed_reference(q * 1e20, k * 1e20, v, cu, cu, scale=1.0)
    assert np.isfinite(big).all()
    np.testing.assert_allclose(big, want_big, atol=TOL[np.float32])


def test_native_packed_threads_and_clones_agree():
    rng = np.random.default_rng(23)
    lens = [300, 1, 77, 0, 129]
    cu = np.concatenate([[0], np.cumsum(lens)])
    q, k, v = (rand(rng, (cu[-1], 4, 16), np.float32) for _ in range(3))
    first, _ = native.attend_packed(q, k, v, cu, cu, scale=0.25, causal=True, threads=1)
    for isa in ISAS:
        for threads in (2, 5):
            out, _ = native.attend_packed(
                q, k, v, cu, cu, scale=0.25, causal=True, threads=threads, isa=isa, block_q=32
            )
            np.testing.assert_allclose(out, first, **tol("threads and clones", np.float32))


def test_info_says_the_varlen_walk_is_active(monkeypatch):
    monkeypatch.delenv("QKV_NATIVE", raising=False)
    kernels = native.info()["kernels"]
    assert [on for name, on in kernels.items() if name.startswith("packed varlen walk")] == [True]
    monkeypatch.setenv("QKV_NATIVE", "0")
    assert not any(native.info()["kernels"].values())
    q32 = np.ones((3, 2, 4), np.float32)
    assert router.packed(q32, q32, q32, np.dtype(np.float32)).name == "packed walk"


@pytest.mark.parametrize(
    "kw", [dict(causal=True), dict(window=(70, 9)), dict(causal=True, window=(150, None))], ids=str
)
@pytest.mark.parametrize("L, S", [(300, 300), (131, 290), (290, 131)])
def test_narrow_pieces_across_the_bounds(L, S, kw):
    """Rows' bounds inside a block wider than the edge pieces (64 keys): the pieces across the
    causal diagonal and the window's edges, prefill and packed."""
    rng = np.random.default_rng(L + S)
    q, k, v = rand(rng, (2, L, 16)), rand(rng, (2, S, 16)), rand(rng, (2, S, 8))
    out, lse = native.attend(make_plan(q, k, v, **kw), block_q=200, block_k=160)
    check(out, lse, q, k, v, **kw)
    cq, ck = np.array([0, L]), np.array([0, S])
    t = (x.transpose(1, 0, 2) for x in (q, k, v))
    out_p, lse_p = native.attend_packed(*t, cq, ck, scale=0.25, block_q=200, block_k=160, **kw)
    check(out_p.transpose(1, 0, 2), lse_p.T, q, k, v, **kw)


@pytest.mark.parametrize("products", ["own", "blas"])
@pytest.mark.parametrize("causal", [False, True])
def test_prefill_on_the_openmp_team_equals_its_own_threads(monkeypatch, products, causal):
    """With PyTorch imported the prefill's work items run on its OpenMP team (as the decode
    step's do); in a process without one, on the library's kept threads: the same numbers,
    equal to the float64 reference."""
    pytest.importorskip("torch")
    from qkv.engine.kernels import threads as kernel_threads

    if not native.available()[0]:
        pytest.skip("native kernels not built (or QKV_NATIVE=0)")
    rng = np.random.default_rng(21)
    q = rng.standard_normal((4, 8, 70, 32)).astype(np.float32)
    k, v = (rng.standard_normal((4, 2, 90, 32)).astype(np.float32) for _ in range(2))
    plan = make_plan(q, k, v, causal=causal)
    assert kernel_threads.openmp_parallel()[0] is not None  # PyTorch's runtime is loaded
    on_team, _ = native.attend(plan, threads=2, products=products)
    monkeypatch.setattr(kernel_threads, "_PID", -1)  # as in a forked child: no team to share
    monkeypatch.setattr(kernel_threads, "_shared", [None, None, None])
    assert kernel_threads.openmp_parallel()[0] is None
    own, _ = native.attend(plan, threads=2, products=products)
    np.testing.assert_allclose(on_team, own, **tol("other threads", np.float32))
    want = reference.attention(q, k, v, causal=causal)
    np.testing.assert_allclose(on_team, want, **tol("fast path", np.float32))


@pytest.mark.parametrize("isa", ISAS)
def test_fma_peak_counts_its_clones_flop(isa):
    """The FMA peak micro-benchmark (bench/machine.py) runs in the clone asked for, capped by
    the CPU, and returns the FLOP it did: 12 chains of vector FMAs of that clone's float32
    lanes (4, 8, 16), two FLOP per lane; a negative count is refused (-1)."""
    lib = native_lib.library()[0]
    code = min(native_lib.ISAS[isa], lib.qkv_best_isa())
    lanes = {1: 4, 2: 8, 3: 16}[code]
    assert lib.qkv_fma_peak(native_lib.ISAS[isa], 1000) == 2 * lanes * 12 * 1000
    assert lib.qkv_fma_peak(native_lib.ISAS[isa], 0) == 0
    assert lib.qkv_fma_peak(native_lib.ISAS[isa], -1) == -1
