"""FlashAttention's layout given back as it lays it out: ``qkv.attention(..., layout="blhd")``
and :func:`qkv.flash.flash_attn_func` return ``(batch, L, heads, dv)`` outputs contiguous in that
order, as flash-attn does (code written for it calls ``.view`` on them), and the native prefill
writes them so in place (:attr:`qkv.validate.Plan.rows_first`; ``o_off`` in ``abi.h``) rather
than laying them out with a copy afterwards.

Every result equals the same call in qkv's own layout bit for bit (the same kernel and sums:
only where the rows are written differs) and the float64 reference. Each call is made twice
(the first keeps the short road, the second runs on it), on arrays and on tensors; CI's loop
runs this file in every vector clone.
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
from qkv.engine.kernels import native, native_bf16
from qkv.validate import make_plan

torch = pytest.importorskip("torch")

DTYPES = {
    "float32": np.float32,
    "float64": np.float64,
    "bfloat16": ml_dtypes.bfloat16,
    "float16": np.float16,
}
native_built = pytest.mark.skipif(
    not native.available()[0],
    reason="the native prefill is not built here, or is switched off (QKV_NATIVE=0)",
)


def _as(a, kind):
    """NumPy ``a`` as the caller passes it: itself, or a CPU tensor over a copy of it."""
    if kind == "numpy":
        return a
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _numpy(x):
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return x.numpy()
    return x


def _contiguous(x):
    return x.is_contiguous() if isinstance(x, torch.Tensor) else x.flags.c_contiguous


def _mask(rng, kind, B, H, L, S, dtype):
    """None, a padding mask (B, 1, 1, S), a boolean mask that is no padding, or a float bias."""
    if kind == "none":
        return None
    if kind == "padding":
        n = rng.integers(1, S + 1, B)
        return (np.arange(S)[None, :] < n[:, None])[:, None, None, :]
    if kind == "bool":
        m = rng.random((B, H, L, S)) > 0.3
        m[..., -1] = True
        return m
    wide = np.float32 if dtype in (ml_dtypes.bfloat16, np.float16) else dtype
    return rng.standard_normal((1, H, L, S)).astype(wide)


@settings(max_examples=60, deadline=None)
@given(
    B=st.integers(1, 3),
    kv=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    L=st.sampled_from([1, 2, 15, 17, 53, 130]),
    S=st.sampled_from([1, 16, 53, 130]),
    d=st.sampled_from([8, 32, 64]),
    wide_v=st.booleans(),
    causal=st.booleans(),
    mask=st.sampled_from(["none", "padding", "bool", "bias"]),
    dtype=st.sampled_from(list(DTYPES)),
    kind=st.sampled_from(["numpy", "torch"]),
    seed=st.integers(0, 2**31),
)
def test_blhd_output_is_contiguous_and_the_bhld_calls_bits(
    B, kv, group, L, S, d, wide_v, causal, mask, dtype, kind, seed
):
    rng = np.random.default_rng(seed)
    H, dv, dt = kv * group, 2 * d if wide_v else d, DTYPES[dtype]
    q = rng.standard_normal((B, L, H, d)).astype(dt)
    k = rng.standard_normal((B, S, kv, d)).astype(dt)
    v = rng.standard_normal((B, S, kv, dv)).astype(dt)
    m = _mask(rng, mask, B, H, L, S, dt)
    args = [_as(x, kind) for x in (q, k, v)]
    swapped = [x.transpose(1, 2) if kind == "torch" else x.swapaxes(1, 2) for x in args]
    mk = None if m is None else _as(m, kind)
    want = _numpy(qkv.attention(*swapped, causal=causal, mask=mk)).swapaxes(1, 2)
    for _ in range(2):  # the first call keeps the short road, the second runs on it
        got = qkv.attention(*args, causal=causal, mask=mk, layout="blhd")
        assert tuple(got.shape) == (B, L, H, dv) and _contiguous(got)
        np.testing.assert_array_equal(_numpy(got), want)
    wide = [x.astype(np.float64).swapaxes(1, 2) for x in (q, k, v)]
    ref = reference.attention(*wide, causal=causal, mask=m).swapaxes(1, 2)
    row = "fast path" if dtype in ("float32", "float64") else "half precision"
    got64 = _numpy(got).astype(np.float64)
    # (a row that sees no key is 0 in both; the reference's NaN-free where the mask leaves one)
    np.testing.assert_allclose(got64, np.nan_to_num(ref), **tol(row, dt))


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_blhd_lse_is_contiguous_too(kind):
    rng = np.random.default_rng(5)
    q, k, v = (_as(rng.standard_normal((2, 9, 4, 16)).astype(np.float32), kind) for _ in range(3))
    out, lse = qkv.attention(q, k, v, causal=True, layout="blhd", return_lse=True)
    assert _contiguous(out) and _contiguous(lse) and tuple(lse.shape) == (2, 9, 4)
    t = [x.transpose(1, 2) if kind == "torch" else x.swapaxes(1, 2) for x in (q, k, v)]
    o2, l2 = qkv.attention(*t, causal=True, return_lse=True)
    np.testing.assert_array_equal(_numpy(out), _numpy(o2).swapaxes(1, 2))
    np.testing.assert_array_equal(_numpy(lse), _numpy(l2).swapaxes(1, 2))


def test_flash_attn_func_output_takes_view_as_flash_attn_does():
    rng = np.random.default_rng(6)
    q, k, v = (torch.from_numpy(rng.standard_normal((2, 7, 4, 8))) for _ in range(3))
    out = qkv.flash.flash_attn_func(q, k, v, causal=True)
    flat = out.view(2, 7, 32)  # (raises on a transposed view)
    want = reference.attention(*(x.numpy().swapaxes(1, 2) for x in (q, k, v)), causal=True)
    want = want.swapaxes(1, 2).reshape(2, 7, 32)
    np.testing.assert_allclose(flat.numpy(), want, **tol("fast path", np.float64))
    out, lse, _ = qkv.flash.flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.is_contiguous() and lse.is_contiguous() and tuple(lse.shape) == (2, 4, 7)


@native_built
@pytest.mark.parametrize(
    ("shape", "causal", "products"),
    [
        ((2, 4, 4, 37, 45, 32, 32), False, "own"),
        ((2, 4, 4, 37, 45, 32, 16), True, "blas"),
        ((1, 8, 2, 70, 70, 64, 64), True, "own"),  # grouped heads stacked position by position
        ((3, 6, 3, 1, 9, 16, 16), False, "own"),
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_native_prefill_writes_rows_first_in_place(shape, causal, products, dtype):
    """The prefill's struct writes each head's rows into ``(batch, L, heads, dv)`` memory:
    the result is a view of it, and its bits are those written head after head."""
    B, H, kv, L, S, d, dv = shape
    rng = np.random.default_rng(7)
    dt = DTYPES[dtype]
    q = rng.standard_normal((B, L, H, d)).astype(dt).swapaxes(1, 2)
    k = rng.standard_normal((B, S, kv, d)).astype(dt).swapaxes(1, 2)
    v = rng.standard_normal((B, S, kv, dv)).astype(dt).swapaxes(1, 2)
    plan = make_plan(q, k, v, causal=causal, keep_stored=True)  # (float16: K/V as stored)
    run = native.attend_stored if plan.stored is not None else native.attend
    kw = {"products": products, "stack": plan.group > 1}
    apart, lse = run(plan, **kw)
    first, lse2 = run(plan.but(rows_first=True), **kw)
    assert first.swapaxes(1, 2).flags.c_contiguous  # (written so: no copy to lay it out)
    np.testing.assert_array_equal(first, apart)
    np.testing.assert_array_equal(lse2, lse)


@pytest.mark.skipif(not native_bf16.available(), reason="no bfloat16 tile products here")
@pytest.mark.parametrize("counts", [None, [3, 45]])
def test_bfloat16_prefill_writes_rows_first_in_place(counts):
    rng = np.random.default_rng(8)
    bf = ml_dtypes.bfloat16
    q = rng.standard_normal((2, 37, 4, 32)).astype(bf).swapaxes(1, 2)
    k, v = (rng.standard_normal((2, 45, 4, 32)).astype(bf).swapaxes(1, 2) for _ in range(2))
    plan = make_plan(q, k, v, causal=True, keep_stored=True)
    c = None if counts is None else np.array(counts)
    apart, lse = native_bf16.attend(plan, counts=c)
    first, lse2 = native_bf16.attend(plan.but(rows_first=True), counts=c)
    assert first.swapaxes(1, 2).flags.c_contiguous
    np.testing.assert_array_equal(first, apart)
    np.testing.assert_array_equal(lse2, lse)


@native_built
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("mask", ["none", "padding", "bool"])
def test_a_16_bit_q_as_a_model_lays_it_out_is_read_in_place(dtype, mask):
    """A 16-bit prefill's kept road takes q in its own dtype; kept for the caller's layout of q
    (a transposed view of a projection's output, as a model and ``layout="blhd"`` give it) it
    reads q there, with no copy per call; q contiguous in the same process (another layout of
    the same shapes) keeps a road of its own. Every call has the general road's bits."""
    from qkv.engine import run

    run.forget()
    rng = np.random.default_rng(9)
    dt = DTYPES[dtype]
    B, L, H, d = 4, 37, 6, 32
    x = rng.standard_normal((B, L, 3, H, d)).astype(dt)
    q, k, v = (x[:, :, i].swapaxes(1, 2) for i in range(3))  # (batch, heads, L, d) views
    m = _mask(rng, mask, B, H, L, L, dt)
    calls = []
    real = np.ascontiguousarray

    def spy(a, *args, **kw):
        calls.append(a.shape)
        return real(a, *args, **kw)

    want = qkv.attention(q, k, v, mask=m, return_lse=True)[0]  # (the general road)
    qc = np.ascontiguousarray(q)
    for _ in range(2):  # the first call of each layout keeps its road
        for qq in (q, qc):
            np.testing.assert_array_equal(qkv.attention(qq, k, v, mask=m), want)
    key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, None, False, run.switches(),
           type(None), False)  # fmt: skip
    found = run._ready(*key)
    road = found if mask == "none" else None
    if road is None:
        read = run._mask_counts(key, m) if mask == "padding" else run._road_of_mask(key, found, m)
        road = read[0]
    assert road.kept is not None and road.kept.io  # (the 16-bit prefill's kept road)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(np, "ascontiguousarray", spy)
        np.testing.assert_array_equal(qkv.attention(q, k, v, mask=m), want)
        np.testing.assert_array_equal(qkv.attention(qc, k, v, mask=m), want)
    assert (B, H, L, d) not in calls  # (q was read where it lies, both times)
