"""The native prefill on its own tile products (``native_src/tiles.h``, issue 42 item 1) equals
qkv.reference: the small-shapes grid and odd sizes (L or S of 1, 2, 15, 17; heads 1..16; d 8..128;
no mask, causal, padding key counts; grouped heads), every vector clone (CI forces each one with
``QKV_NATIVE_ISA``, and the direct calls draw one), and the router sends the short rows there."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.conftest import bound, tol, within_rule

import qkv
from qkv import reference
from qkv.engine.kernels import native, native_lib, router
from qkv.testing.strategies import values
from qkv.validate import make_plan

_lib, _why = native_lib.library()
native_built = pytest.mark.skipif(_lib is None, reason=f"native library unavailable: {_why}")

TOL = bound("kernels")
ISAS = list(native.ISAS)  # capped by the CPU: a clone it cannot run falls back to a narrower one
ODD = [1, 2, 15, 16, 17, 37, 53]  # the grid's short lengths and the tiles' edges


def padding_counts(rng: np.random.Generator, B: int, S: int) -> np.ndarray:
    """Key counts per batch row as a tokenizer's padding leaves them: the first row full, the
    others anywhere in [0, S] (a row of no key included)."""
    n = rng.integers(0, S + 1, size=B)
    n[0] = S
    return n


# Not qkv.testing.strategies' shapes: the sizes are the micro-kernel's own edges (rows and
# keys around its register blocks, ODD; head sizes that are no multiple of a vector).
@st.composite
def problems(draw):
    """A short problem: batch, heads (kv heads a divisor), L, S, d, dv, mask, dtype, seed."""
    B = draw(st.integers(1, 4))
    H = draw(st.integers(1, 16))
    kv = draw(st.sampled_from([h for h in range(1, H + 1) if H % h == 0]))
    L = draw(st.sampled_from(ODD) | st.integers(1, 70))
    S = draw(st.sampled_from(ODD) | st.integers(1, 70))
    d = draw(st.sampled_from([8, 13, 16, 32, 64, 100, 128]))
    dv = draw(st.sampled_from([d, 5, 24]))
    mask = draw(st.sampled_from(["none", "causal", "padding"]))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    return B, H, kv, L, S, d, dv, mask, dtype, draw(st.integers(0, 2**31))


def make(problem):
    """``(q, k, v)``, ``qkv.attention``'s options and the reference's (the mask as given)."""
    B, H, kv, L, S, d, dv, mask, dtype, seed = problem
    rng = np.random.default_rng(seed)
    q = values(rng, (B, H, L, d)).astype(dtype)
    k = values(rng, (B, kv, S, d)).astype(dtype)
    v = values(rng, (B, kv, S, dv)).astype(dtype)
    opts: dict = {}
    if mask == "causal":
        opts["causal"] = True
    elif mask == "padding":
        n = padding_counts(rng, B, S)
        opts["mask"] = (np.arange(S)[None, :] < n[:, None])[:, None, None, :]
    return q, k, v, opts


def wide(*xs):
    return [x.astype(np.float64) for x in xs]


@native_built
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.sampled_from(ISAS), st.integers(1, 80), st.integers(1, 80), st.integers(1, 2))
def test_own_products_equal_the_reference(problem, isa, block_q, block_k, threads):
    """native.attend(products="own") in a drawn clone, tile size and thread count."""
    q, k, v, opts = make(problem)
    plan = make_plan(q, k, v, **opts)
    counts = None
    if plan.key_counts is not None:  # the padding mask read as key counts, as the router runs it
        from qkv.engine.kernels import key_counts

        counts, plan = router.key_counts_per_row(plan), key_counts.bare(plan)
    run = dict(isa=isa, block_q=block_q, block_k=block_k, threads=threads, products="own")
    out, lse = native.attend(plan, counts=counts, **run)
    ref_out, ref_lse = reference.attention(*wide(q, k, v), return_lse=True, **opts)
    t = TOL[q.dtype.type]
    np.testing.assert_allclose(out, ref_out, rtol=t, atol=t * max(1.0, float(np.abs(v).max())))
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))  # rows with no key
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=t, atol=t)


@settings(
    max_examples=100,
    deadline=None,
    # monkeypatch.context() undoes each example's setting
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(problems(), st.booleans())
def test_attention_on_short_rows_equals_the_reference(monkeypatch, problem, off):
    """qkv.attention on the road the router picks (the own tiles where built), and with the
    native kernels off (QKV_NATIVE=0): the same numbers."""
    with monkeypatch.context() as m:
        m.setenv("QKV_NATIVE", "0" if off else "1")
        q, k, v, opts = make(problem)
        got = qkv.attention(q, k, v, **opts)
        want = reference.attention(*wide(q, k, v), **opts)
        np.testing.assert_allclose(got, want, **tol("fast path", q.dtype))


GRID = [  # (B, H, kv, L, d, mask): bench/small.py's quick cells and their neighbours
    (32, 12, 12, 53, 32, "none"),
    (32, 12, 12, 16, 32, "padding"),
    (8, 12, 12, 16, 64, "padding"),
    (8, 12, 3, 37, 32, "causal"),
    (8, 8, 8, 53, 64, "none"),
    (1, 8, 2, 16, 64, "none"),
    (1, 8, 2, 37, 32, "causal"),
    (1, 8, 2, 120, 32, "causal"),
    (1, 12, 12, 120, 64, "padding"),
]


@native_built
@pytest.mark.parametrize("cell", GRID, ids=str)
def test_the_router_sends_the_grid_to_the_own_tiles(monkeypatch, cell):
    monkeypatch.delenv("QKV_NATIVE", raising=False)
    B, H, kv, L, d, mask = cell
    q, k, v, opts = make((B, H, kv, L, L, d, d, mask, np.float32, L * d))
    route = qkv.route(q, k, v, **opts)
    assert route.kernel == "native prefill, own tiles"
    np.testing.assert_allclose(
        qkv.attention(q, k, v, **opts),
        reference.attention(*wide(q, k, v), **opts),
        **tol("fast path", np.float32),
    )
    # bfloat16 in: the same kernel reads the stored K/V, widening them per work item
    b16 = [x.astype(ml_dtypes.bfloat16) for x in (q, k, v)]
    if not native_lib.bf16_products()[0]:  # (with AVX512_BF16 its own bfloat16 kernel runs)
        assert qkv.route(*b16, **opts).kernel == "native prefill, own tiles, stored K/V"
    within_rule(qkv.attention(*b16, **opts), *wide(*b16), dtype=ml_dtypes.bfloat16, **opts)


@native_built
def test_tiny_problems_take_the_own_tiles_and_the_walk_says_why_not_when_off(monkeypatch):
    """The tiniest problem with more than a decoding step's rows takes the own tiles, masked
    or not (2-10x the dense kernel's speed once its set-up is kept); switched off, the walk
    says why."""
    monkeypatch.delenv("QKV_NATIVE", raising=False)
    q = k = v = np.ones((1, 1, 9, 8), dtype=np.float32)
    mask = np.tril(np.ones((9, 9), dtype=bool))[::-1]  # no padding: read as a mask
    for options in ({}, {"causal": True, "window": (2, 0)}, {"mask": mask}):
        assert qkv.route(q, k, v, **options).kernel == "native prefill, own tiles", options
    monkeypatch.setenv("QKV_NATIVE", "0")
    q = np.ones((8, 12, 16, 64), dtype=np.float32)
    refused = dict(qkv.route(q, q, q).refused)
    assert refused["native prefill, own tiles"] == "switched off (QKV_NATIVE=0)"


@native_built
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_own_and_blas_products_agree(isa, dtype):
    """Both products on the same plan: each within the kernels' bound of the reference, and
    of each other (the same sums, a different order)."""
    if native._gemm()[0] is None:
        pytest.skip("SciPy's BLAS not found")
    rng = np.random.default_rng(3)
    q, k, v = (values(rng, (2, 4, 70, 40)).astype(dtype) for _ in range(3))
    plan = make_plan(q, k, v, causal=True)
    own = native.attend(plan, isa=isa, products="own", block_q=32, block_k=48)
    blas = native.attend(plan, isa=isa, products="blas", block_q=32, block_k=48)
    t = TOL[dtype]
    np.testing.assert_allclose(own[0], blas[0], rtol=t, atol=t)
    np.testing.assert_allclose(own[1], blas[1], rtol=t, atol=t)
    ref = reference.attention(*wide(q, k, v), causal=True)
    np.testing.assert_allclose(own[0], ref, rtol=t, atol=t)


@native_built
def test_a_padding_mask_in_any_form_gives_the_same_result_on_the_own_tiles(monkeypatch):
    monkeypatch.delenv("QKV_NATIVE", raising=False)
    rng = np.random.default_rng(11)
    B, H, L, d = 8, 12, 16, 64
    q, k, v = (values(rng, (B, H, L, d)).astype(np.float32) for _ in range(3))
    keep = (np.arange(L)[None, :] < padding_counts(rng, B, L)[:, None])[:, None, None, :]
    forms = [
        keep,
        np.broadcast_to(keep, (B, 1, L, L)),
        np.where(keep, np.float32(0), np.float32(-np.inf)),
    ]
    assert qkv.route(q, k, v, mask=keep).kernel == "native prefill, own tiles"
    outs = [qkv.attention(q, k, v, mask=m) for m in forms]
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])
    want = reference.attention(*wide(q, k, v), mask=keep)
    np.testing.assert_allclose(outs[0], want, **tol("fast path", np.float32))


@native_built
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    problems(),
    st.sampled_from(["bool", "bias", "window"]),
    st.sampled_from([0.0, 0.3, 0.9, 1.0]),
    st.sampled_from(ISAS),
    st.integers(1, 80),
    st.integers(1, 80) | st.integers(129, 300),
    st.booleans(),
)
def test_own_products_with_masks_biases_and_windows(problem, kind, hidden, isa, bq, bk, long_rows):
    """The own tiles' softmax steps (a vector of lanes at a time over each padded row; rows of
    more than 128 keys one by one) under a boolean mask or float bias hiding none, some or all
    keys of a row (-inf in the bias), and a sliding window, against the float64 reference;
    rows with no key give 0 and -inf."""
    B, H, kv, L, S, d, dv, _, dtype, seed = problem
    if long_rows:  # keys enough for pieces wider than 128
        B, H, kv, S = 1, min(H, 2), 1, 129 + seed % 200
    q, k, v, _ = make((B, H, kv, L, S, d, dv, "none", dtype, seed))
    rng = np.random.default_rng(seed + 1)
    opts: dict = {"causal": bool(rng.integers(2))}
    if kind == "window":
        opts["window"] = (int(rng.integers(0, 20)), int(rng.integers(0, 20)))
    else:
        keep = rng.random((B, 1, L, S)) >= hidden
        if kind == "bool":
            opts["mask"] = keep
        else:
            bias = values(rng, (B, 1, L, S)).astype(dtype)
            opts["mask"] = np.where(keep, bias, -np.inf).astype(dtype)
    plan = make_plan(q, k, v, **opts)
    run = dict(isa=isa, block_q=bq, block_k=bk, threads=1, products="own")
    out, lse = native.attend(plan, **run)
    ref_out, ref_lse = reference.attention(*wide(q, k, v), return_lse=True, **opts)
    t = TOL[q.dtype.type]
    np.testing.assert_allclose(out, ref_out, rtol=t, atol=t * max(1.0, float(np.abs(v).max())))
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=t, atol=t)


@native_built
@pytest.mark.parametrize("products", ["own", "blas"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_threads_kept_tiles_carry_nothing_from_call_to_call(products, dtype):
    """Each worker thread keeps its tiles from call to call (forward.cpp's kept_buffers), grown
    and never cleared. A call after larger ones that left non-finite values everywhere in them
    (scores of 1e30 against huge keys, outputs refused as not finite) gives the bits it gives
    when it runs first, for every shape of a few: nothing of an earlier call is read."""
    rng = np.random.default_rng(11)

    def case(B, H, kv, L, S, d, dv, causal, big=False):
        q = values(rng, (B, H, L, d)).astype(dtype)
        k = values(rng, (B, kv, S, d)).astype(dtype) * (dtype(1e30) if big else 1)
        v = values(rng, (B, kv, S, dv)).astype(dtype) * (dtype(1e30) if big else 1)
        return make_plan(q, k, v, scale=None, causal=causal)

    small = [
        case(1, 8, 2, 37, 37, 64, 64, True),
        case(2, 4, 4, 5, 70, 32, 24, False),
        case(1, 2, 1, 120, 120, 16, 16, True),
    ]
    first = [native.attend(p, products=products, threads=2) for p in small]
    for L, S, d in [(512, 512, 128), (300, 700, 100)]:  # larger tiles, left full of inf/NaN
        with np.errstate(all="ignore"):
            native.attend(case(1, 4, 2, L, S, d, d, False, big=True), products=products, threads=2)
    for p, (out, lse) in zip(small, first, strict=True):
        again = native.attend(p, products=products, threads=2)
        assert again[0].tobytes() == out.tobytes() and again[1].tobytes() == lse.tobytes()
        want = reference.attention(p.q, p.k, p.v, causal=p.causal)
        np.testing.assert_allclose(out, want, **tol("fast path", dtype))
