"""A decoding step on K/V whose rows interleave the kv heads — a (batch, keys, kv_heads, d)
buffer, FlashAttention's layout, as ``qkv.attention(..., layout="blhd")`` and
``qkv.flash.flash_attn_func`` take it — runs on the paged walk, every head's rows of a run of
keys at a time (one page a sequence), from the router's size on: it equals the float64
reference and the same call on head-major copies, in float32, float64 and K/V stored as
bfloat16 or float16, with grouped heads and soft-capping; smaller K/V, head-major K/V and a
single kv head keep the walk by heads."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.conftest import bound

import qkv
from qkv import reference
from qkv.engine import run
from qkv.engine.kernels import native_decode, router
from qkv.flash import flash_attn_func

pytestmark = pytest.mark.skipif(
    not native_decode.available(), reason="native kernels not built (or QKV_NATIVE=0)"
)

TOL = bound("native decode")


def _forget() -> None:
    """Drop the choices kept per operand layout (they hold the router's answer)."""
    native_decode._constants.cache_clear()
    run._ready.cache_clear()


@pytest.fixture
def every_size(monkeypatch):
    """The every-head walk for K/V of any size, and whether each of its calls served."""
    calls = []
    step = native_decode._every_head_step

    def counted(*args, **kwargs):
        out = step(*args, **kwargs)
        calls.append(out is not None)  # (served, or refused or not finite)
        return out

    monkeypatch.setattr(router, "EVERY_HEAD_MIN_BYTES", 0)
    monkeypatch.setattr(native_decode, "_every_head_step", counted)
    _forget()
    yield calls
    _forget()


@st.composite
def problems(draw):
    B = draw(st.integers(1, 3))
    kvh = draw(st.integers(2, 4))
    group = draw(st.sampled_from([1, 2, 4]))
    L = draw(st.integers(1, 3))
    S = draw(st.integers(1, 300))
    d = draw(st.sampled_from([8, 32, 64, 80, 128]))
    dv = d if draw(st.booleans()) else draw(st.sampled_from([16, 64]))
    dtype = draw(st.sampled_from(["float32", "float64", "bfloat16", "float16"]))
    softcap = draw(st.sampled_from([None, 5.0]))
    seed = draw(st.integers(0, 2**16))
    return B, kvh, group, L, S, d, dv, dtype, softcap, seed


def _operands(B, kvh, group, L, S, d, dv, dtype, seed):
    """q (B, L, H, d) and K/V (B, S, kv_heads, ·) in FlashAttention's layout; 16-bit K/V with a
    float32 q (the decode step reads them as stored)."""
    rng = np.random.default_rng(seed)
    stored = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}.get(dtype)
    qt = np.float32 if stored else np.dtype(dtype)
    q = rng.standard_normal((B, L, kvh * group, d)).astype(qt)
    k = rng.standard_normal((B, S, kvh, d)).astype(stored or qt)
    v = rng.standard_normal((B, S, kvh, dv)).astype(stored or qt)
    return q, k, v


@given(problems())
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_interleaved_heads_walk_every_head_and_equal_the_reference(every_size, p):
    B, kvh, group, L, S, d, dv, dtype, softcap, seed = p
    q, k, v = _operands(B, kvh, group, L, S, d, dv, dtype, seed)
    before = len(every_size)
    got = qkv.attention(q, k, v, layout="blhd", softcap=softcap)
    assert every_size[before:] == [True], "the every-head walk did not serve the call"
    wide = [np.swapaxes(x.astype(np.float64), 1, 2) for x in (q, k, v)]
    want = np.swapaxes(reference.attention(*wide, softcap=softcap), 1, 2)
    tol = TOL[np.float64 if dtype == "float64" else np.float32] * 10
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    # the walk by heads on head-major copies: the same recurrence, the same values
    heads = [np.ascontiguousarray(np.swapaxes(x, 1, 2)) for x in (q, k, v)]
    by_heads = np.swapaxes(qkv.attention(*heads, softcap=softcap), 1, 2)
    np.testing.assert_allclose(got, by_heads, rtol=tol / 10, atol=tol / 10)


def test_flash_attn_func_decoding_steps_take_the_every_head_walk(every_size):
    q, k, v = _operands(2, 4, 2, 1, 200, 64, 64, "bfloat16", 7)
    q = q.astype(ml_dtypes.bfloat16)
    got = flash_attn_func(q, k, v, softcap=3.0)
    assert every_size == [True], "the every-head walk did not serve the call"
    wide = [np.swapaxes(x.astype(np.float64), 1, 2) for x in (q, k, v)]
    want = np.swapaxes(reference.attention(*wide, softcap=3.0), 1, 2)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=2e-2, atol=2e-2)


def test_sums_that_overflow_take_the_general_road_as_before(every_size, monkeypatch):
    given = []
    step = native_decode._every_head_step  # (every_size's counter)
    monkeypatch.setattr(
        native_decode, "_every_head_step", lambda *a, **kw: given.append(step(*a, **kw))
    )
    q, k, v = _operands(1, 2, 2, 1, 40, 32, 32, "float32", 3)
    k[:, :, 1] = 0  # kv head 1: every weight 1 before the division by their sum...
    v[0, 5:7, 1, 0] = np.float32(3e38)  # ... whose values' sum is past float32's largest
    got = qkv.attention(q, k, v, layout="blhd")
    assert given and given[0] is None, "the every-head walk did not give the overflow back"
    wide = [np.swapaxes(x.astype(np.float64), 1, 2) for x in (q, k, v)]
    want = np.swapaxes(reference.attention(*wide), 1, 2)
    assert np.isfinite(got).all() and got[0, 0, 2, 0] > 1e37  # (a finite mean of 3e38's)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_walk_by_heads_keeps_small_head_major_and_single_head_caches(monkeypatch):
    calls = []
    step = native_decode._every_head_step
    monkeypatch.setattr(
        native_decode, "_every_head_step", lambda *a, **kw: calls.append(1) or step(*a, **kw)
    )
    _forget()
    try:
        q, k, v = _operands(1, 4, 2, 1, 64, 32, 32, "float32", 1)  # far below the size
        qkv.attention(q, k, v, layout="blhd")
        heads = [np.ascontiguousarray(np.swapaxes(x, 1, 2)) for x in (q, k, v)]
        monkeypatch.setattr(router, "EVERY_HEAD_MIN_BYTES", 0)
        _forget()
        qkv.attention(*heads)  # head-major: the walk by heads reads it in order
        q1, k1, v1 = _operands(1, 1, 4, 1, 64, 32, 32, "float32", 1)  # one kv head
        qkv.attention(q1, k1, v1, layout="blhd")
        assert calls == []
    finally:
        _forget()


NHD = (1 << 20, 256, 2048, 2)  # (batch, kv_heads, keys, d) byte strides of a (b, keys, 8, 128)
HND = (1 << 20, 1 << 17, 256, 2)  # ... of a head-major (b, 8, keys, 128) buffer
BIG = router.EVERY_HEAD_MIN_BYTES


@pytest.mark.parametrize(
    ("kv_heads", "k_strides", "v_strides", "nbytes", "expected"),
    [
        (8, NHD, NHD, BIG, True),
        (8, NHD, NHD, BIG - 1, False),  # below the size
        (8, HND, HND, BIG, False),  # head-major: read in order head by head
        (8, NHD, HND, BIG, False),  # V head-major
        (1, NHD, NHD, BIG, False),  # one kv head: nothing interleaves
    ],
)
def test_the_router_reads_every_head_where_rows_interleave_heads(
    kv_heads, k_strides, v_strides, nbytes, expected
):
    assert router.every_head(kv_heads, k_strides, v_strides, nbytes) is expected
