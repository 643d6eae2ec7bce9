"""A decoding step's plan and run: runs of keys found by one function (``decode.key_runs``),
read once per plan, and ``native_decode.DecodePlan`` (checked once, run per layer) equal to
the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tests.conftest import bound

from qkv import reference
from qkv.engine.kernels import decode, dispatch, native_decode, router
from qkv.validate import make_plan

TOL = bound("native decode")
native = pytest.mark.skipif(
    not native_decode.available(), reason="native kernels not built (or QKV_NATIVE=0)"
)


@given(st.lists(st.lists(st.booleans(), min_size=1, max_size=12), min_size=1, max_size=5))
def test_key_runs_are_each_rows_first_and_last_visible_key(rows):
    """Each row's run equals flatnonzero's min and max + 1 where every row's visible keys are
    one run; None as soon as one row has a gap or no key."""
    S = max(len(r) for r in rows)
    a = np.array([r + [False] * (S - len(r)) for r in rows])
    runs = decode.key_runs(a)
    expect = []
    for row in a:
        idx = np.flatnonzero(row)
        one = len(idx) > 0 and idx[-1] - idx[0] + 1 == len(idx)
        expect.append((int(idx[0]), int(idx[-1]) + 1) if one else None)
    if None in expect:
        assert runs is None
    else:
        assert runs is not None
        assert list(zip(runs.lo.tolist(), runs.hi.tolist(), strict=True)) == expect
        assert runs.lo.dtype == runs.hi.dtype == np.int64 and runs.lo.flags.c_contiguous


def test_key_runs_of_no_key_and_of_no_row():
    assert decode.key_runs(np.zeros((2, 0), dtype=bool)) is None
    runs = decode.key_runs(np.zeros((0, 4), dtype=bool))
    assert runs is not None and runs.lo.shape == runs.hi.shape == (0,)


def _problem(B=3, hq=8, kvh=2, S=70, d=16, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, hq, 1, d)).astype(dtype)
    k = rng.standard_normal((B, kvh, S, d)).astype(dtype)
    v = rng.standard_normal((B, kvh, S, d)).astype(dtype)
    return q, k, v


def _operand(a):
    item = a.itemsize
    found = native_decode.layout(a.shape, [st // item for st in a.strides], 1)
    assert found is not None
    return a.ctypes.data, found


def _run(plan, q, k, v):
    out = np.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype)
    lse = np.empty(q.shape[:-1], dtype=q.dtype)
    status = plan.run(_operand(q), _operand(k), _operand(v), out.ctypes.data, lse.ctypes.data)
    return status, out, lse


@native
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("how", ["runs", "mask"])
def test_one_plan_runs_every_layer_equal_to_the_reference(dtype, how):
    """A plan made once (ragged runs of keys, grouped heads, a soft-cap, the default scale) and
    run on three layers' q, K, V: each layer's output and lse equal the float64 reference."""
    B, hq, kvh, S, d = 3, 8, 2, 70, 16
    keep = np.zeros((B, 1, 1, S), dtype=bool)
    for b, (lo, hi) in enumerate([(5, 70), (0, 33), (20, 21)]):
        keep[b, ..., lo:hi] = True
    kw = {}
    if how == "runs":
        kw["runs"] = decode.key_runs(keep[:, 0, 0, :])
    else:  # boolean rows the kernel reads as each sequence's run
        kw["mask"] = (keep.ctypes.data, keep.strides[0], keep.strides[3])
    plan = native_decode.DecodePlan.plan(
        (B, hq, kvh, 1, d, d, S), f64=dtype == np.float64, softcap=4.0, **kw
    )
    assert plan is not None and plan.scale == 0.25 and plan.sizes[2] == hq // kvh
    for layer in range(3):
        q, k, v = _problem(B, hq, kvh, S, d, dtype, seed=layer)
        q *= 3  # scores large enough for the soft-cap to matter
        status, out, lse = _run(plan, q, k, v)
        assert status == 0
        args = [a.astype(np.float64) for a in (q, k, v)]
        ref, ref_lse = reference.attention(*args, mask=keep, softcap=4.0, return_lse=True)
        np.testing.assert_allclose(out, ref, rtol=TOL[dtype], atol=TOL[dtype])
        np.testing.assert_allclose(lse, ref_lse, rtol=TOL[dtype], atol=TOL[dtype])


@native
def test_a_mask_row_of_two_runs_is_status_4_and_a_nan_is_status_3():
    B, hq, kvh, S, d = 2, 4, 2, 40, 8
    q, k, v = _problem(B, hq, kvh, S, d)
    keep = np.ones((B, 1, 1, S), dtype=bool)
    keep[1, ..., 10] = False  # a gap
    rows = (keep.ctypes.data, keep.strides[0], keep.strides[3])
    plan = native_decode.DecodePlan.plan((B, hq, kvh, 1, d, d, S), f64=False, mask=rows)
    assert plan is not None
    assert _run(plan, q, k, v)[0] == 4
    plan = native_decode.DecodePlan.plan((B, hq, kvh, 1, d, d, S), f64=False, scale=0.5)
    assert plan is not None and plan.scale == 0.5
    q[0, 1, 0, 3] = np.nan
    assert _run(plan, q, k, v)[0] == 3


@pytest.mark.parametrize(
    ("sizes", "kw"),
    [
        ((2, 6, 4, 1, 8, 8, 10), {}),  # 6 heads over 4 kv heads
        ((2, 4, 0, 1, 8, 8, 10), {}),  # no kv head
        ((2, 4, 2, 1, 0, 8, 10), {}),  # an empty axis
        ((2, 4, 2, 1, 8, 8, 10), {"scale": -1.0}),
        ((2, 4, 2, 1, 8, 8, 10), {"scale": float("inf")}),
        ((2, 4, 2, 1, 8, 8, 10), {"scale": True}),
        ((2, 4, 2, 1, 8, 8, 10), {"softcap": 0.0}),
        ((2, 4, 2, 1, 8, 8, 10), {"softcap": float("nan")}),
    ],
)
def test_a_step_the_kernel_does_not_take_has_no_plan(sizes, kw):
    assert native_decode.DecodePlan.plan(sizes, f64=False, **kw) is None


@native
def test_a_plans_mask_is_read_once_when_the_native_step_falls_back(monkeypatch):
    """A masked decoding plan whose native result is not finite: the NumPy decode kernel takes
    it with the runs native_decode already found, not reading the mask a second time."""
    q, k, v = _problem(B=2, hq=4, kvh=2, S=300, d=16)
    q[1, 0, 0, 0] = np.nan
    keep = np.zeros((2, 1, 1, 300), dtype=bool)
    keep[0, ..., 4:300] = keep[1, ..., 0:120] = True
    plan = make_plan(q, k, v, mask=keep)
    assert router.holds(router.DECODE_STEP, plan)
    calls = []
    inner = decode.key_runs

    def spy(rows):
        calls.append(rows.shape)
        return inner(rows)

    monkeypatch.setattr(decode, "key_runs", spy)
    out, _ = dispatch.attend(plan, choice=dispatch.choose(plan)._replace(run=native_decode.attend))
    assert calls == [(2, 300)]
    args = [a.astype(np.float64) for a in (q, k, v)]
    ref = reference.attention(*args, mask=keep)
    assert np.isnan(out[1, 0]).all() and np.isfinite(out[0]).all()
    np.testing.assert_allclose(out[0], ref[0], rtol=TOL[np.float32], atol=TOL[np.float32])
