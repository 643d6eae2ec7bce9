"""qkv.plan_decode / qkv.DecodePlan: a decoding step planned once and run per layer equals the
float64 reference on each sequence's keys (the stored values for a stored form), on the native
step and on the NumPy road; one plan serves layers of other K/V values; an operand that does
not match the plan is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.conftest import bound, tol

import qkv
from qkv import reference
from qkv.engine.kernels import native_decode

FORMS = ["float32", "float64", "float16", "bfloat16", "int8", "float8_e4m3fn"]


def _kv(x, form):
    """``(operand, scales, stored values as float64, kv_format)`` of float32 ``x`` in ``form``."""
    if form in ("float32", "float64", "float16"):
        a = x.astype(form)
        return a, None, a.astype(np.float64), None
    if form == "bfloat16":
        import ml_dtypes

        a = x.astype(ml_dtypes.bfloat16)
        return a, None, a.astype(np.float64), None
    codes, scales = qkv.quantize_kv(x, form)
    return codes, scales, qkv.dequantize_kv(codes, scales, form).astype(np.float64), form


def _expect(q, k, v, lo, hi, **kw):
    """The float64 reference per sequence on keys ``lo[b]:hi[b]``, grouped heads repeated."""
    g = q.shape[1] // k.shape[1]
    out = np.zeros(q.shape[:-1] + (v.shape[-1],))
    for b in range(q.shape[0]):
        if hi[b] > lo[b]:
            kb = np.repeat(k[b, :, lo[b] : hi[b]], g, axis=0)
            vb = np.repeat(v[b, :, lo[b] : hi[b]], g, axis=0)
            out[b] = reference.attention(q[b].astype(np.float64), kb, vb, **kw)
    return out


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 3),
    kvh=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    d=st.sampled_from([4, 8, 16, 40]),
    S=st.integers(1, 50),
    form=st.sampled_from(FORMS),
    how=st.sampled_from(["seqlens", "mask", "all"]),
    softcap=st.sampled_from([None, 2.0]),
    native=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_plan_equals_the_reference_on_every_layer(
    B, kvh, group, d, S, form, how, softcap, native, seed
):
    rng = np.random.default_rng(seed)
    qdt = np.float64 if form == "float64" else np.float32
    lo = rng.integers(0, S + 1, B)
    hi = np.array([rng.integers(a, S + 1) for a in lo])
    kw = {"softcap": softcap}
    if how == "seqlens":
        kw.update(seqlens=hi, starts=lo)
    elif how == "mask":
        j = np.arange(S)
        hi = np.maximum(hi, lo + 1).clip(max=S)  # a mask's rows each see a key here
        lo = np.minimum(lo, hi - 1)
        kw["mask"] = ((j >= lo[:, None]) & (j < hi[:, None]))[:, None, None, :]
    else:
        lo, hi = np.zeros(B, int), np.full(B, S)
    with pytest.MonkeyPatch.context() as mp:
        if not native:
            mp.setenv("QKV_NATIVE", "0")
        plan = None
        for _ in range(2):  # two layers: other values, one plan
            q = rng.standard_normal((B, kvh * group, 1, d)).astype(qdt)
            k, ks, k64, fmt = _kv(rng.standard_normal((B, kvh, S, d)).astype(np.float32), form)
            v, vs, v64, _ = _kv(rng.standard_normal((B, kvh, S, d)).astype(np.float32), form)
            scales = {} if ks is None else {"k_scale": ks, "v_scale": vs}
            if plan is None:
                plan = qkv.plan_decode(q, k, v, kv_format=fmt, **scales, **kw)
                on = native and native_decode.available()
                assert plan.route == ("native decode" if on else "NumPy decode")
            out, lse = plan.run(q, k, v, **scales, return_lse=True)
            expect = _expect(q, k64, v64, lo, hi, softcap=softcap)
            assert out.dtype == qdt and out.shape == expect.shape and lse.shape == out.shape[:3]
            np.testing.assert_allclose(out, expect, atol=bound("decoding", qdt))
            empty = hi <= lo
            assert np.isneginf(lse[empty]).all() and not out[empty].any()


@pytest.mark.parametrize("native", [True, False])
def test_one_plan_runs_tensors_of_every_layer(native, monkeypatch):
    """CPU tensors in, tensors out (bfloat16 ones in their dtype), layer after layer on one
    plan whose mask was read once."""
    torch = pytest.importorskip("torch")
    if not native:
        monkeypatch.setenv("QKV_NATIVE", "0")
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(2, 1, 1, 30, dtype=torch.bool)
    mask[0, ..., :5] = False
    mask[1, ..., 20:] = False
    lo, hi = np.array([5, 0]), np.array([30, 20])
    for dtype, row in ((torch.float32, "decoding"), (torch.bfloat16, None)):
        plan = None
        for _ in range(3):
            q = torch.randn(2, 4, 1, 16, generator=g).to(dtype)
            k, v = (torch.randn(2, 2, 30, 16, generator=g).to(dtype) for _ in range(2))
            plan = plan or qkv.plan_decode(q, k, v, mask=mask, scale=0.3)
            out = plan.run(q, k, v)
            assert isinstance(out, torch.Tensor) and out.dtype == dtype
            expect = _expect(*(t.double().numpy() for t in (q, k, v)), lo, hi, scale=0.3)
            if row is None:  # bfloat16 out: a float32 computation rounded once
                got = out.float().numpy()
                np.testing.assert_allclose(got, expect, **tol("half precision", torch.bfloat16))
            else:
                np.testing.assert_allclose(out.numpy(), expect, atol=bound(row, np.float32))


def test_a_paged_plan_equals_the_gathered_reference():
    rng = np.random.default_rng(1)
    kp, vp = rng.standard_normal((2, 7, 4, 2, 8)).astype(np.float32)
    table = np.array([[5, 1, 3], [2, 0, 6]])
    q = rng.standard_normal((2, 4, 1, 8)).astype(np.float32)
    plan = qkv.plan_decode(q, kp, vp, block_table=table, seqlens=[10, 3])
    out = plan.run(q, kp, vp)
    for b, n in enumerate([10, 3]):
        pos = np.arange(n)
        k = kp[table[b, pos // 4], pos % 4].transpose(1, 0, 2).astype(np.float64)
        v = vp[table[b, pos // 4], pos % 4].transpose(1, 0, 2).astype(np.float64)
        expect = reference.attention(
            q[b].astype(np.float64), np.repeat(k, 2, 0), np.repeat(v, 2, 0)
        )
        np.testing.assert_allclose(out[b], expect, atol=bound("decoding", np.float32))


def test_a_mask_that_is_not_one_run_per_sequence_takes_the_numpy_road_and_says_why():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 2, 1, 8)).astype(np.float32)
    k, v = rng.standard_normal((2, 2, 2, 20, 8)).astype(np.float32)
    mask = np.ones((2, 1, 1, 20), bool)
    mask[1, ..., 7] = False  # a gap
    plan = qkv.plan_decode(q, k, v, mask=mask)
    assert plan.route == "NumPy decode"
    assert dict(plan.refused)["native decode"] in (
        "a mask row is not one run of keys",
        "switched off (QKV_NATIVE=0)",
    )
    expect = reference.attention(q.astype(np.float64), k, v, mask=mask)
    np.testing.assert_allclose(plan.run(q, k, v), expect, atol=bound("decoding", np.float32))


def test_an_operand_other_than_planned_is_refused_by_name():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 4, 1, 8)).astype(np.float32)
    k, v = rng.standard_normal((2, 1, 2, 20, 8)).astype(np.float32)
    plan = qkv.plan_decode(q, k, v)
    with pytest.raises(qkv.InputError, match=r"^k: the plan was made for array float32 \(1, 2, 20"):
        plan.run(q, k[:, :, :10], v)
    with pytest.raises(qkv.InputError, match="^v: .* got array float64"):
        plan.run(q, k, v.astype(np.float64))
    wide = np.zeros((1, 2, 20, 16), np.float32)[..., :8]
    wide[...] = v
    with pytest.raises(qkv.InputError, match="^v: .*strides"):
        plan.run(q, k, wide)
    with pytest.raises(qkv.InputError, match="^q: .* got a list"):
        plan.run(q.tolist(), k, v)


def test_a_plan_is_checked_as_a_call_is():
    q = np.zeros((2, 6, 1, 8), np.float32)
    k = v = np.zeros((2, 4, 10, 8), np.float32)
    with pytest.raises(qkv.InputError, match="heads"):
        qkv.plan_decode(q, k, v)  # 6 query heads over 4 kv heads
    k = v = np.zeros((2, 3, 10, 8), np.float32)
    with pytest.raises(qkv.InputError, match="seqlens"):
        qkv.plan_decode(q, k, v, seqlens=[4, 11])
    with pytest.raises(qkv.InputError, match="mask"):
        qkv.plan_decode(q, k, v, mask=np.ones((2, 1, 3, 10), bool))
    with pytest.raises(qkv.InputError, match="scale"):
        qkv.plan_decode(q, k, v, scale=-1.0)
    with pytest.raises(qkv.InputError, match="k_scale"):
        qkv.plan_decode(q, k.astype(np.int8), v.astype(np.int8), kv_format="int8")


@pytest.mark.parametrize("native", [True, False])
def test_a_plan_for_other_runs_of_keys_equals_one_planned_for_them(native, monkeypatch):
    """for_runs: the next model step's keys on the same plan, as if planned with them; runs
    outside the keys refused by name."""
    if not native:
        monkeypatch.setenv("QKV_NATIVE", "0")
    rng = np.random.default_rng(4)
    q = rng.standard_normal((3, 4, 1, 8)).astype(np.float32)
    k, v = rng.standard_normal((2, 3, 2, 25, 8)).astype(np.float32)
    plan = qkv.plan_decode(q, k, v).for_runs([0, 3, 24], [25, 9, 25])
    out = plan.run(q, k, v)
    expect = _expect(q, k, v, [0, 3, 24], [25, 9, 25])
    np.testing.assert_allclose(out, expect, atol=bound("decoding", np.float32))
    with pytest.raises(qkv.InputError, match="lo, hi"):
        plan.for_runs([0, 0, 0], [25, 26, 25])
