"""The bfloat16 prefill's two roads, AMX's tiles (tdpbf16ps) and AVX512_BF16's vdpbf16ps,
against the float64 reference, and padding masks read as key counts by that prefill.

The tolerance is the bfloat16 prefill's own rule (``test_engine_native_bf16``): both roads
round the same things, the weights to bfloat16 for the second product and the output once.
They sum each tile's products in another order, so their bits may differ by float32 rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.test_engine_native_bf16 import BF16, _bound, _check, _inputs

import qkv
from qkv import reference
from qkv.engine import run
from qkv.engine.kernels import dispatch, native_bf16, native_lib, router
from qkv.validate import make_plan

pytestmark = pytest.mark.skipif(
    not native_bf16.available(),
    reason="no AVX512_BF16 here, the library is not built, or QKV_NATIVE_ISA forces a clone",
)

ROADS = ["amx", "avx512bf16"]


@pytest.fixture(params=ROADS)
def road(request, monkeypatch):
    """Each road forced by ``QKV_NATIVE_ISA`` (AMX's only where this CPU runs it)."""
    monkeypatch.setenv("QKV_NATIVE_ISA", request.param)
    if request.param == "amx" and not native_lib.amx_tiles()[0]:
        pytest.skip(f"AMX's tiles do not run here: {native_lib.amx_tiles()[1]}")
    return request.param


@settings(max_examples=30, deadline=None)
@given(
    B=st.integers(1, 2),
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 3),
    L=st.sampled_from([1, 2, 15, 17, 63, 64, 65, 130]),
    S=st.sampled_from([0, 1, 15, 16, 17, 31, 33, 64, 65, 200]),
    d=st.sampled_from([32, 64, 96, 128, 48]),  # (48: not a multiple of 32, vdpbf16ps's)
    dv=st.sampled_from([16, 48, 64, 80, 128, 7]),
    causal=st.booleans(),
    window=st.sampled_from([None, (5, 0), (40, 3)]),
    mask=st.sampled_from([None, "mask", "bias"]),
    threads=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def _property(road, B, kv_heads, group, L, S, d, dv, causal, window, mask, threads, seed):
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, B, kv_heads, group, L, S, d, dv, spread=2.0)
    H = kv_heads * group
    m = None
    if mask == "mask":
        m = rng.random((B, H, L, S)) < 0.7
    elif mask == "bias":
        m = rng.standard_normal((B, 1, L, S)) * 3
    options = dict(causal=causal, window=window, mask=m)
    plan = make_plan(q, k, v, keep_stored=True, **options)
    out, lse = native_bf16.attend(plan, threads=threads)
    _check(out, lse, q, k, v, **options)


def test_each_road_equals_the_reference(road):
    _property(road)


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(2, 5),
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 4),
    L=st.sampled_from([2, 16, 53, 64, 120]),
    extra=st.sampled_from([0, 7]),
    d=st.sampled_from([32, 64]),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def _padded(road, B, kv_heads, group, L, extra, d, causal, seed):
    rng = np.random.default_rng(seed)
    S = L + extra
    q, k, v = _inputs(rng, B, kv_heads, group, L, S, d, d)
    counts = rng.integers(1, S + 1, B)
    counts[0] = S  # (a full row, as a tokenizer's longest)
    keep = np.arange(S)[None, :] < counts[:, None]
    as_bool = keep[:, None, None, :]
    as_float = np.where(as_bool, 0.0, -np.inf).astype(np.float32)
    want = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), mask=as_bool,
                               causal=causal)  # fmt: skip
    got = [qkv.attention(q, k, v, mask=m, causal=causal) for m in (as_bool, as_float)]
    assert got[0].dtype == BF16
    np.testing.assert_allclose(got[0].astype(np.float64), want, rtol=0, atol=_bound(v, want))
    np.testing.assert_array_equal(got[0], got[1])  # bool and 0/-inf: the same bits


def test_padding_masks_are_read_as_key_counts(road):
    _padded(road)


@pytest.mark.parametrize("before, after", [("amx", "avx512bf16"), ("avx512bf16", "amx")])
def test_a_road_kept_for_a_call_follows_the_forced_clone(monkeypatch, before, after):
    # the plain call keeps its plan and road per shapes: a clone forced between two calls of
    # the same shapes takes that clone's road, the bits of a first call under it (only AMX's
    # tiles against vdpbf16ps make the router choose apart here: the other clones' kept roads
    # check their clone themselves, so a CPU without AMX has no such pair to tell apart)
    if not native_lib.amx_tiles()[0]:
        pytest.skip(f"AMX's tiles do not run here: {native_lib.amx_tiles()[1]}")
    rng = np.random.default_rng(6)
    q, k, v = _inputs(rng, 5, 1, 2, 64, 64, 32, 32)
    keep = (np.arange(64)[None, :] < np.array([64, 9, 40, 1, 33])[:, None])[:, None, None, :]
    for mask in (None, keep):
        monkeypatch.setenv("QKV_NATIVE_ISA", before)
        qkv.attention(q, k, v, mask=mask)
        monkeypatch.setenv("QKV_NATIVE_ISA", after)
        got = qkv.attention(q, k, v, mask=mask)
        run.forget()
        np.testing.assert_array_equal(got, qkv.attention(q, k, v, mask=mask))


def test_a_padded_batch_runs_on_the_bfloat16_prefill_with_its_counts(monkeypatch):
    rng = np.random.default_rng(4)
    q, k, v = _inputs(rng, 8, 2, 4, 120, 120, 64, 64)
    keep = (np.arange(120)[None, :] < rng.integers(1, 121, 8)[:, None])[:, None, None, :]
    seen = []
    run = native_bf16.attend
    monkeypatch.setattr(native_bf16, "attend", lambda p, **kw: seen.append(kw) or run(p, **kw))
    plan = make_plan(q, k, v, mask=keep, keep_stored=True)
    choice = dispatch.choose(plan)
    assert choice.kernel == "native bfloat16 prefill"
    assert choice.counts == "key counts read by the native prefill"
    out, _ = dispatch.attend(plan, choice=choice)
    assert [x["counts"].tolist() for x in seen] == [keep[:, 0, 0].sum(-1).tolist()]
    want = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), mask=keep)
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=0, atol=_bound(v, want))


def test_a_call_kept_on_key_counts_takes_each_calls_counts(road):
    rng = np.random.default_rng(5)
    q, k, v = _inputs(rng, 4, 2, 2, 40, 40, 64, 64)
    for counts in ([40, 3, 17, 40], [40, 40, 1, 29], [40, 12, 12, 5]):
        keep = (np.arange(40)[None, :] < np.array(counts)[:, None])[:, None, None, :]
        want = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), mask=keep)
        got = qkv.attention(q, k, v, mask=keep).astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=0, atol=_bound(v, want))


@pytest.mark.parametrize("L, S", [(24, 24), (37, 37), (16, 64), (120, 120)])
def test_a_short_prompt_takes_the_tiles_where_they_run(monkeypatch, L, S):
    q, k, v = _inputs(np.random.default_rng(L), 1, 2, 4, L, S, 64, 64)
    on_tiles = native_lib.amx_tiles()[0]
    plan = make_plan(q, k, v, causal=True, keep_stored=True)
    assert (dispatch.choose(plan).kernel == "native bfloat16 prefill") == on_tiles
    out = qkv.attention(q, k, v, causal=True)
    want = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), causal=True)
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=0, atol=_bound(v, want))
    monkeypatch.setenv("QKV_NATIVE_ISA", "avx512bf16")  # (vdpbf16ps: the prefill's size rule)
    assert dispatch.choose(plan).kernel == "native prefill, own tiles, stored K/V"


def test_smaller_prompts_keep_the_float32_tiles():
    for L, S, d in ((20, 20, 64), (16, 36, 64), (12, 64, 64), (37, 37, 48)):
        q, k, v = _inputs(np.random.default_rng(L), 1, 2, 4, L, S, d, d)
        plan = make_plan(q, k, v, causal=True, keep_stored=True)
        assert dispatch.choose(plan).kernel == "native prefill, own tiles, stored K/V"


def test_the_isa_setting_names_the_roads(monkeypatch):
    monkeypatch.setenv("QKV_NATIVE_ISA", "avx512bf16")
    assert native_lib.bf16_isa() == native_lib.BF16_ISA
    assert native_lib.amx_tiles() == (False, "vdpbf16ps is forced (QKV_NATIVE_ISA=avx512bf16)")
    assert native_bf16.available()
    monkeypatch.setenv("QKV_NATIVE_ISA", "amx")
    assert native_lib.bf16_isa() == native_lib.AMX_ISA and native_bf16.available()
    monkeypatch.setenv("QKV_NATIVE_ISA", "avx512")
    assert not native_bf16.available() and not native_lib.amx_tiles()[0]
    monkeypatch.setenv("QKV_NATIVE_ISA", "tiles")
    with pytest.raises(ValueError, match="QKV_NATIVE_ISA: expected one of .*'amx'"):
        native_lib.isa_cap()


def test_the_router_sends_padded_bfloat16_calls_to_the_prefill():
    assert "native bfloat16 prefill" in router.READ_BY
