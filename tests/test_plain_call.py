"""The commonest call's short road (:func:`qkv.engine.run.plain`): ``qkv.attention(q, k, v)``
on NumPy arrays or plain CPU tensors of one dtype (float32, float64, or float16 and bfloat16
computed in float32 on K/V read as stored), with nothing but ``scale`` and ``causal``, runs
the plan and kernel kept for its shapes.

It must give exactly what the general road gives (the same kernel on the same plan: equal bits,
``return_lse=True`` forces the general road), equal the float64 reference, follow
``QKV_NATIVE`` when it changes, and refuse what the general road refuses with the same message.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.conftest import tol

import qkv
from qkv import reference
from qkv.engine import run
from qkv.testing.strategies import shapes, values


def _arrays(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    B, Hq, Hkv, L, S, d, dv = shape
    return tuple(
        values(rng, s).astype(dtype) for s in ((B, Hq, L, d), (B, Hkv, S, d), (B, Hkv, S, dv))
    )


def _general(q, k, v, **options):
    """The general road's output: asking for the lse skips the short road."""
    return qkv.attention(q, k, v, return_lse=True, **options)[0]


@settings(max_examples=60, deadline=None)
@given(
    shape=shapes(batch=(1, 3), heads=(1, 4), L=(1, 9), S=(1, 40), d=(1, 70), dv_differs=True)
    | shapes(batch=(1, 2), heads=(2, 4), L=(1, 3), S=(1, 40), d=(1, 70), grouped=True),
    dtype=st.sampled_from([np.float32, np.float64]),
    causal=st.booleans(),
    scale=st.sampled_from([None, 0.3, 1, 2.5]),
)
def test_plain_call_equals_general_road_and_reference(shape, dtype, causal, scale):
    q, k, v = _arrays(shape, dtype)
    got = qkv.attention(q, k, v, causal=causal, scale=scale)
    assert got.dtype == dtype and got.shape == (shape.B, shape.Hq, shape.L, shape.dv)
    np.testing.assert_array_equal(got, _general(q, k, v, causal=causal, scale=scale))
    want = reference.attention(q, k, v, causal=causal, scale=scale)
    np.testing.assert_allclose(got, want, **tol("fast path", dtype))


def test_plain_call_is_the_road_taken(monkeypatch):
    """The front hands such a call to the short road, and the kept plan is reused."""
    calls = []
    real = run.plain
    monkeypatch.setattr(run, "plain", lambda *a: calls.append(a) or real(*a))
    q, k, v = _arrays((1, 8, 2, 1, 16, 64, 64), np.float32)
    run.forget()
    for _ in range(3):
        qkv.attention(q, k, v)
    assert len(calls) == 3
    info = run._ready.cache_info()
    assert (info.misses, info.hits) == (1, 2)


def test_plain_call_follows_qkv_native(monkeypatch):
    """``QKV_NATIVE=0`` set after a call still switches the native kernels off for the next
    one of the same shapes (the key holds it): the router's NumPy choice runs."""
    from qkv.engine.kernels import native_decode

    q, k, v = _arrays((1, 4, 4, 1, 64, 32, 32), np.float32)
    first = qkv.attention(q, k, v)
    ran = []
    real = native_decode.attend_finite
    monkeypatch.setattr(
        native_decode, "attend_finite", lambda *a, **kw: ran.append(1) or real(*a, **kw)
    )
    monkeypatch.setenv("QKV_NATIVE", "0")
    run.forget()
    second = qkv.attention(q, k, v)
    assert not ran
    np.testing.assert_allclose(second, first, **tol("fast path", np.float32))
    np.testing.assert_allclose(second, reference.attention(q, k, v), **tol("fast path", np.float32))


@pytest.mark.parametrize("scale", [True, -1.0, float("nan"), "0.5", [0.5]])
def test_plain_call_refuses_as_the_general_road(scale):
    """A bad scale gets the general road's refusal, also after a good one of equal hash
    (``True == 1``) was kept."""
    q, k, v = _arrays((1, 2, 2, 1, 8, 4, 4), np.float32)
    qkv.attention(q, k, v, scale=1)
    with pytest.raises((ValueError, TypeError)) as short:
        qkv.attention(q, k, v, scale=scale)
    with pytest.raises((ValueError, TypeError)) as general:
        qkv.attention(q, k, v, scale=scale, return_lse=True)
    assert str(short.value) == str(general.value)
    assert "scale" in str(short.value)


def test_plain_call_non_finite_inputs_as_general_road():
    """Infinity and NaN in the inputs take the same rules on both roads."""
    q, k, v = _arrays((1, 2, 2, 1, 16, 8, 8), np.float32)
    q[0, 0, 0, 0] = np.inf
    v[0, 1, 3, 2] = np.nan
    got = qkv.attention(q, k, v)
    np.testing.assert_array_equal(got, _general(q, k, v))


def _bf16():
    return pytest.importorskip("ml_dtypes").bfloat16


@settings(max_examples=40, deadline=None)
@given(
    shape=shapes(batch=(1, 3), heads=(1, 4), L=(1, 40), S=(1, 40), d=(1, 70), dv_differs=True)
    | shapes(batch=(1, 2), heads=(2, 8), L=(1, 20), S=(1, 70), d=(1, 70), grouped=True),
    narrow=st.sampled_from(["float16", "bfloat16"]),
    causal=st.booleans(),
    scale=st.sampled_from([None, 0.3, 2.5]),
)
def test_16_bit_plain_call_equals_general_road_and_reference(shape, narrow, causal, scale):
    """float16 and ml_dtypes' bfloat16 arrays take the short road too (q widened, K/V read as
    stored): the general road's bits, in the inputs' dtype, near the float64 reference."""
    dtype = np.dtype(np.float16) if narrow == "float16" else np.dtype(_bf16())
    q, k, v = _arrays(shape, np.float32)
    q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
    got = qkv.attention(q, k, v, causal=causal, scale=scale)
    assert got.dtype == dtype and got.shape == (shape.B, shape.Hq, shape.L, shape.dv)
    np.testing.assert_array_equal(
        got.astype(np.float32), _general(q, k, v, causal=causal, scale=scale).astype(np.float32)
    )
    wide = [a.astype(np.float64) for a in (q, k, v)]
    want = reference.attention(*wide, causal=causal, scale=scale)
    np.testing.assert_allclose(got.astype(np.float64), want, **tol("half precision", dtype))


def test_16_bit_plain_call_is_the_road_taken(monkeypatch):
    """A bfloat16 call is kept as a float32 one is: one plan per shapes, reused."""
    q, k, v = (a.astype(_bf16()) for a in _arrays((1, 8, 2, 16, 16, 64, 64), np.float32))
    run.forget()
    for _ in range(3):
        qkv.attention(q, k, v)
    info = run._ready.cache_info()
    assert (info.misses, info.hits) == (1, 2)


def test_plain_call_other_inputs_take_the_general_road():
    """Mixed dtypes, lists and broadcast batches are not plain: the general road answers
    them, equal to the reference."""
    q, k, v = _arrays((2, 2, 2, 3, 5, 4, 4), np.float32)
    for args in (
        (q, k.astype(np.float64), v),
        (q.astype(np.float16), k.astype(np.float16), v.astype(np.float32)),
        (q[0].tolist(), k[0].tolist(), v[0].tolist()),
        (q, k[:1], v[:1]),
    ):
        got = qkv.attention(*args)
        want = reference.attention(*args)
        np.testing.assert_allclose(
            np.asarray(got, np.float64), want, **tol("fast path", np.float16)
        )


torch = pytest.importorskip("torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_plain_call_on_tensors(dtype, causal):
    """Plain CPU tensors: a tensor of their dtype back, equal to the general road's and to
    PyTorch's SDPA."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, n, 16, generator=g, dtype=dtype) for n in (3, 7, 7))
    got = qkv.attention(q, k, v, causal=causal)
    assert isinstance(got, torch.Tensor) and got.dtype == dtype
    np.testing.assert_array_equal(got.numpy(), _general(q, k, v, causal=causal).numpy())
    want = reference.attention(q.numpy(), k.numpy(), v.numpy(), causal=causal)
    np.testing.assert_allclose(got.numpy(), want, **tol("fast path", np.dtype(str(dtype)[6:])))
    keep = torch.ones(3, 7, dtype=torch.bool).tril(diagonal=7 - 3) if causal else None
    peer = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)  # qkv's causal: bottom-right
    np.testing.assert_allclose(
        got.numpy(), peer.numpy(), **tol("fast path", np.dtype(str(dtype)[6:]))
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_16_bit_plain_call_on_tensors(dtype, causal):
    """bfloat16 and float16 CPU tensors on the short road: a tensor of their dtype back, the
    general road's bits, near PyTorch's SDPA on the same values."""
    import torch.nn.functional as F

    pytest.importorskip("ml_dtypes")
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 8, n, 32, generator=g).to(dtype) for n in (5, 37, 37))
    k, v = k[:, :2].contiguous(), v[:, :2].contiguous()  # grouped heads: 8 over 2
    got = qkv.attention(q, k, v, causal=causal)
    assert isinstance(got, torch.Tensor) and got.dtype == dtype
    assert torch.equal(got, _general(q, k, v, causal=causal))
    keep = torch.ones(5, 37, dtype=torch.bool).tril(diagonal=37 - 5) if causal else None
    peer = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=keep, enable_gqa=True
    )
    np.testing.assert_allclose(got.float().numpy(), peer.numpy(), **tol("half precision", dtype))


def test_tensors_that_are_not_plain_keep_their_roads():
    """A tensor that requires grad gets its gradient (the autograd road); a bfloat16 one a
    bfloat16 result; a negative view is read correctly."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for n in (2, 5, 5))
    qg = q.clone().requires_grad_(True)
    out = qkv.attention(qg, k, v)
    out.sum().backward()
    assert qg.grad is not None and qg.grad.shape == q.shape
    half = qkv.attention(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert half.dtype == torch.bfloat16
    neg = torch.neg(q.conj()) if q.is_complex() else q._neg_view()
    got = qkv.attention(neg, k, v)
    want = reference.attention(-q.numpy(), k.numpy(), v.numpy())
    np.testing.assert_allclose(got.numpy(), want, **tol("fast path", np.float32))


@settings(max_examples=40, deadline=None)
@given(
    shape=shapes(batch=(1, 4), heads=(1, 4), L=(1, 20), S=(1, 40), d=(1, 40), dv_differs=True)
    | shapes(batch=(1, 4), heads=(2, 8), L=(1, 20), S=(1, 40), d=(1, 40), grouped=True),
    dtype=st.sampled_from([np.float32, np.float64, "bfloat16"]),
    kind=st.sampled_from(["tail", "tail rows", "middle", "all", "none"]),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_padding_mask_on_the_short_road(shape, dtype, kind, causal, seed):
    """A boolean padding mask on the short road (its key counts read per call, the road kept
    per shapes): the general road's bits and the float64 reference, for masks that hide a
    tail, all keys, none, or a middle run (which is no padding mask: the general road)."""
    dtype = np.dtype(_bf16()) if dtype == "bfloat16" else np.dtype(dtype)
    q, k, v = (a.astype(dtype) for a in _arrays(shape, np.float32, seed))
    rng = np.random.default_rng(seed)
    S, L = shape.S, shape.L
    counts = rng.integers(0, S + 1, shape.B)
    if kind == "all":
        counts[:] = S
    elif kind == "none":
        counts[:] = 0
    keep = np.arange(S)[None, :] < counts[:, None]
    if kind == "middle":
        keep[:, S // 2] = False
    keep = keep[:, None, None, :]
    if kind == "tail rows":
        keep = np.broadcast_to(keep, (shape.B, 1, L, S))
    got = qkv.attention(q, k, v, mask=keep, causal=causal)
    assert got.dtype == dtype
    general = _general(q, k, v, mask=keep, causal=causal)
    np.testing.assert_array_equal(got.astype(np.float64), general.astype(np.float64))
    wide = [a.astype(np.float64) for a in (q, k, v)]
    want = reference.attention(*wide, mask=keep, causal=causal)
    row = "half precision" if dtype.kind == "V" else "fast path"
    np.testing.assert_allclose(got.astype(np.float64), want, **tol(row, dtype))


@pytest.mark.parametrize("rows", [1, 4, 300])
def test_padding_mask_that_hides_nothing_is_no_mask(monkeypatch, rows):
    """A padding mask that hides no key (one sentence's, a batch of full ones) runs as no mask:
    the bits of the call without it. A small one is seen whole in its bytes, without its key
    counts read, whatever nonzero bytes say True; a large one (300 x 16 elements) is read as
    before."""
    q, k, v = _arrays((rows, 4, 4, 3, 16, 32, 32), np.float32)
    want = qkv.attention(q, k, v)
    wide = [a.astype(np.float64) for a in (q, k, v)]
    np.testing.assert_allclose(want, reference.attention(*wide), **tol("fast path", np.float32))
    counted = []
    real = run.tail_counts
    monkeypatch.setattr(run, "tail_counts", lambda *a: counted.append(1) or real(*a))
    keep = np.ones((rows, 1, 1, 16), bool)
    twos = np.full((rows, 1, 1, 16), 2, np.uint8).view(bool)
    for mask in (keep, twos, keep, twos):
        np.testing.assert_array_equal(qkv.attention(q, k, v, mask=mask), want)
    if rows * 16 <= run._SEEN_WHOLE:
        assert counted == []
    one_hidden = keep.copy()
    one_hidden[-1, ..., -1] = False  # the last row's last key: hidden, whichever road reads it
    got = qkv.attention(q, k, v, mask=one_hidden)
    ref = reference.attention(*wide, mask=one_hidden)
    np.testing.assert_allclose(got, ref, **tol("fast path", np.float32))


# The kept road: from a key's second call on, a road that has a kept set-up (the native
# decode step, the native prefill on its own tiles; dispatch.KEPT) runs without the plan or
# the dispatcher. It must give the general road's bits, and step aside (to the general road)
# for other strides, another clone, another thread team, or a result that is not finite.


def _dtype(name):
    return np.dtype(_bf16()) if name == "bfloat16" else np.dtype(name)


def _strided(a):
    """``a``'s values with other strides (its last two axes stored the other way round)."""
    return np.swapaxes(np.swapaxes(a, -1, -2).copy(), -1, -2)


@settings(max_examples=40, deadline=None)
@given(
    shape=shapes(batch=(1, 2), heads=(1, 4), L=(1, 40), S=(1, 48), d=(8, 70), dv_differs=True)
    | shapes(batch=(1, 2), heads=(2, 8), L=(1, 40), S=(1, 48), d=(8, 70), grouped=True),
    name=st.sampled_from(["float32", "float64", "float16", "bfloat16"]),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_kept_road_gives_the_general_roads_bits(shape, name, causal, seed):
    """Three calls of one key (the first keeps its road's set-up), then the same values with
    other strides: each the general road's bits on the same arrays, and near the float64
    reference."""
    dtype = _dtype(name)
    q, k, v = (a.astype(dtype) for a in _arrays(shape, np.float32, seed))
    want = _general(q, k, v, causal=causal)
    for _ in range(3):
        np.testing.assert_array_equal(qkv.attention(q, k, v, causal=causal), want)
    sq, sv = _strided(q), _strided(v)
    got = qkv.attention(sq, k, sv, causal=causal)
    np.testing.assert_array_equal(got, _general(sq, k, sv, causal=causal))
    wide = [a.astype(np.float64) for a in (q, k, v)]
    ref = reference.attention(*wide, causal=causal)
    kind = "fast path" if name in ("float32", "float64") else "half precision"
    np.testing.assert_allclose(got.astype(np.float64), ref, **tol(kind, dtype))


# (shape, the router's row): a decoding step and a short prompt's grouped heads
_KEPT_CASES = [
    ((1, 8, 2, 1, 16, 64, 64), "native decode"),
    ((1, 8, 2, 16, 16, 64, 64), "native prefill, own tiles"),
]


def _native():
    from qkv.engine.kernels import native_lib

    if native_lib.library()[0] is None or native_lib.switched_off():
        pytest.skip("the native kernels are off: no kept road")


def _counting(monkeypatch):
    """Count the general road's runs (the dispatcher's)."""
    from qkv.engine.kernels import dispatch

    ran = []
    real = dispatch.attend
    monkeypatch.setattr(dispatch, "attend", lambda *a, **kw: ran.append(1) or real(*a, **kw))
    return ran


@pytest.mark.parametrize(("shape", "row"), _KEPT_CASES)
@pytest.mark.parametrize("name", ["float32", "bfloat16"])
def test_kept_road_is_the_road_taken(monkeypatch, shape, row, name):
    """The first call of a key runs the general road and keeps its road's set-up; the next
    ones run only the kept road, with the first one's bits."""
    _native()
    ran = _counting(monkeypatch)
    q, k, v = (a.astype(_dtype(name)) for a in _arrays(shape, np.float32))
    run.forget()
    first = qkv.attention(q, k, v)
    found = run._ready(q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, None, False,
                       run.switches(), type(None), False)  # fmt: skip
    assert found.choice.kernel.startswith(row) and found.kept is not None
    for _ in range(3):
        np.testing.assert_array_equal(qkv.attention(q, k, v), first)
    assert len(ran) == 1
    if name == "float32":  # (the kept road's output is the call's; no lse is written for it)
        done = found.kept(q, k, v)
        assert done is not None and done[1] is None
        np.testing.assert_array_equal(done[0], first)


@pytest.mark.parametrize(
    ("shape", "mask"),  # (a padded decoding step's road follows its counts: it keeps none)
    [(s, None) for s, _ in _KEPT_CASES]
    + [(_KEPT_CASES[1][0], "padding"), ((4, 6, 6, 37, 37, 32, 32), None)]
    + [((4, 6, 6, 37, 37, 32, 32), "padding")],
)
@pytest.mark.parametrize("name", ["float32", "bfloat16"])
def test_each_layout_of_a_key_keeps_a_road(monkeypatch, shape, name, mask):
    """The same shapes called in several layouts (a model's transposed views, contiguous
    arrays, another stride) keep a road for each: after each layout's first call, no call runs
    the general road, and every call has the first call's bits (near the reference)."""
    _native()
    ran = _counting(monkeypatch)
    q, k, v = (a.astype(_dtype(name)) for a in _arrays(shape, np.float32))
    m = None
    if mask == "padding":
        n = np.arange(q.shape[0]) % k.shape[-2] + 1
        m = (np.arange(k.shape[-2])[None, :] < n[:, None])[:, None, None, :]

    def padded(a):  # (rows 8 elements apart from the next: a view of wider rows)
        wide = np.zeros(a.shape[:-1] + (a.shape[-1] + 8,), a.dtype)
        wide[..., : a.shape[-1]] = a
        return wide[..., : a.shape[-1]]

    x = np.concatenate([q.swapaxes(1, 2), np.zeros_like(q.swapaxes(1, 2))], axis=2)
    layouts = [
        (q, k, v),
        tuple(padded(a) for a in (q, k, v)),
        (x[:, :, : q.shape[1]].swapaxes(1, 2), k, v),  # (a projection's view of q)
    ]
    run.forget()
    want = qkv.attention(q, k, v, mask=m)
    wide = [a.astype(np.float64) for a in (q, k, v)]
    kind = "fast path" if name == "float32" else "half precision"
    np.testing.assert_allclose(
        want.astype(np.float64), reference.attention(*wide, mask=m), **tol(kind, _dtype(name))
    )
    for args in layouts:  # each layout's first call keeps its road
        np.testing.assert_array_equal(qkv.attention(*args, mask=m), want)
    firsts = len(ran)
    assert firsts <= len(layouts)
    for _ in range(2):
        for args in layouts:
            np.testing.assert_array_equal(qkv.attention(*args, mask=m), want)
    assert len(ran) == firsts  # (all on kept roads)


@pytest.mark.parametrize("shape", [(1, 8, 2, 2, 16, 64, 64), (2, 8, 8, 8, 300, 32, 32)])
@pytest.mark.parametrize("name", ["float32", "bfloat16"])
@pytest.mark.parametrize("tensors", [False, True])
def test_kept_causal_rows_are_the_road_taken(monkeypatch, shape, name, tensors):
    """A few causal rows (draft tokens): from a key's second call on, the native step with its
    rows causal runs kept, on arrays and on tensors' addresses, with the first call's bits
    near the reference; a row that would see no key (fewer keys than rows) keeps no road."""
    _native()
    ran = _counting(monkeypatch)
    q, k, v = (a.astype(_dtype(name)) for a in _arrays(shape, np.float32))
    run.forget()
    first = qkv.attention(q, k, v, causal=True)
    found = run._ready(q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, None, True,
                       run.switches(), type(None), False)  # fmt: skip
    # (the prefill's own tiles where the running clone gives them these rows)
    road = qkv.route(q, k, v, causal=True).kernel
    assert road.startswith(("native decode, causal rows", "native prefill, own tiles"))
    assert found.choice.kernel == road and found.kept is not None
    given = (q, k, v)
    if tensors:  # (the same values: float32 rounds to bfloat16 alike in both)
        tdt = getattr(torch, name)
        given = tuple(torch.from_numpy(a.astype(np.float32)).to(tdt) for a in given)
    for _ in range(3):
        got = qkv.attention(*given, causal=True)
        np.testing.assert_array_equal(_viewed(got) if tensors else got, first)
    assert len(ran) == 1
    wide = [a.astype(np.float64) for a in (q, k, v)]
    kind = "fast path" if name == "float32" else "half precision"
    ref = reference.attention(*wide, causal=True)
    np.testing.assert_allclose(first.astype(np.float64), ref, **tol(kind, q.dtype))
    short = k[..., : shape[3] - 1, :]
    run.forget()
    got = qkv.attention(q, short, v[..., : shape[3] - 1, :], causal=True)
    found = run._ready(q.shape, short.shape, short.shape, q.dtype, k.dtype, v.dtype, None, True,
                       run.switches(), type(None), False)  # fmt: skip
    assert found is None or found.kept is None


@pytest.mark.parametrize(("shape", "row"), _KEPT_CASES)
def test_kept_road_steps_aside(monkeypatch, shape, row):
    """Another clone forced, another thread team, or a result that is not finite: the general
    road runs, with its own bits."""
    _native()
    from qkv.engine.kernels import native

    q, k, v = _arrays(shape, np.float32)
    run.forget()
    qkv.attention(q, k, v)  # keeps the set-up
    ran = _counting(monkeypatch)
    forced = os.environ.get("QKV_NATIVE_ISA")  # (CI forces narrower clones on the suite)
    monkeypatch.setenv("QKV_NATIVE_ISA", "avx2" if forced == "baseline" else "baseline")
    np.testing.assert_array_equal(qkv.attention(q, k, v), _general(q, k, v))
    assert len(ran) == 2  # (the call and _general)
    if forced is None:
        monkeypatch.delenv("QKV_NATIVE_ISA")
    else:
        monkeypatch.setenv("QKV_NATIVE_ISA", forced)
    if row.startswith("native prefill"):
        real = native.prefill_team
        monkeypatch.setattr(native, "prefill_team", lambda *a: (real(*a)[0] + 1, None))
        np.testing.assert_array_equal(qkv.attention(q, k, v), _general(q, k, v))
        assert len(ran) == 4
        monkeypatch.setattr(native, "prefill_team", real)
    v = v.copy()
    v[0, 1, 3, 2] = np.inf
    got = qkv.attention(q, k, v)
    np.testing.assert_array_equal(got, _general(q, k, v))
    assert len(ran) in (6, 4) and not np.isfinite(got).all()


@settings(max_examples=25, deadline=None)
@given(
    shape=shapes(batch=(2, 6), heads=(1, 4), L=(9, 24), S=(9, 40), d=(16, 64), dv_differs=True)
    | shapes(batch=(2, 6), heads=(2, 8), L=(9, 24), S=(9, 40), d=(16, 64), grouped=True),
    name=st.sampled_from(["float32", "float64", "bfloat16"]),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_kept_padded_road_gives_the_general_roads_bits(shape, name, causal, seed):
    """A padded call's key-count road kept per shapes and mask shape: calls with other
    counts each give the general road's bits, and are near the float64 reference."""
    q, k, v = (a.astype(_dtype(name)) for a in _arrays(shape, np.float32, seed))
    rng = np.random.default_rng(seed)
    S = shape.S
    for _ in range(3):
        counts = rng.integers(0, S + 1, shape.B)
        keep = (np.arange(S)[None, :] < counts[:, None])[:, None, None, :]
        got = qkv.attention(q, k, v, mask=keep, causal=causal)
        np.testing.assert_array_equal(got, _general(q, k, v, mask=keep, causal=causal))
    wide = [a.astype(np.float64) for a in (q, k, v)]
    want = reference.attention(*wide, mask=keep, causal=causal)
    kind = "fast path" if name in ("float32", "float64") else "half precision"
    np.testing.assert_allclose(got.astype(np.float64), want, **tol(kind, _dtype(name)))


@pytest.mark.parametrize("name", ["float32", "bfloat16"])
def test_kept_padded_road_is_the_road_taken(monkeypatch, name):
    """After the first padded call of a key, calls with other counts run only the kept road
    (the first one's counts are not kept: each call's are read)."""
    _native()
    ran = _counting(monkeypatch)
    q, k, v = (a.astype(_dtype(name)) for a in _arrays((8, 12, 12, 16, 16, 64, 64), np.float32))
    run.forget()
    run._counted.cache_clear()
    rng = np.random.default_rng(1)
    outs = []
    for _ in range(4):
        counts = rng.integers(1, 17, 8)
        keep = (np.arange(16)[None, :] < counts[:, None])[:, None, None, :]
        outs.append((qkv.attention(q, k, v, mask=keep), keep))
    assert len(ran) == 1
    for got, keep in outs:
        np.testing.assert_array_equal(got, _general(q, k, v, mask=keep))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_kept_prefill_flags_outputs_that_are_not_finite(dtype, bad):
    """The native prefill reports an output that is not finite (status 3, the outputs all
    written) and the kept prefill then steps aside; with finite outputs it gives
    :func:`native.attend`'s bits."""
    _native()
    from qkv.engine.kernels import native
    from qkv.validate import make_plan

    q, k, v = _arrays((2, 4, 2, 24, 40, 32, 16), dtype)
    plan = make_plan(q, k, v)
    kept = native.keep(plan)
    assert kept is not None
    out, lse = kept(q, k, v)
    want, _ = native.attend(plan, products="own")
    np.testing.assert_array_equal(out, want)
    assert lse is None  # (not written: the kept road's callers read the output)
    v = v.copy()
    v[1, 0, 7, 3] = bad
    assert kept(q, k, v) is None
    out, _ = native.attend(make_plan(q, k, v), products="own")  # (written: status 3 allowed)
    assert not np.isfinite(out[1, :2]).all() and np.isfinite(out[0]).all()


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
@pytest.mark.parametrize("size", [1.0, 1e-6])  # (1e-6: float16's subnormals)
@pytest.mark.parametrize("L", [16, 1])  # the prefill's road, the decode step's
def test_16_bit_kept_road_narrows_in_the_kernel(monkeypatch, name, size, L):
    """A 16-bit call's kept road, the prefill's or the decode step's, takes q and gives its
    output in that dtype (the kernel widens q and narrows its float32 output, rounding to
    nearest even): on outputs that lie exactly halfway between two 16-bit values (each query
    sees 8 copies of x and 8 of the next value after x, with equal scores) the even one of
    the two, float16's subnormals included, and the general road's bits; NumPy arrays (a
    strided q too) and tensors alike."""
    _native()
    dtype = _dtype(name)
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((1, 2, 1, 64)) * size).astype(dtype)
    bits = x.view(np.uint16)
    after = (bits + 1).view(dtype)  # (the next value away from zero)
    v = np.concatenate([x, after] * 8, axis=2)
    k = np.zeros((1, 2, 16, 64), dtype)
    q = rng.standard_normal((1, 8, L, 64)).astype(dtype)
    run.forget()
    first = qkv.attention(q, k, v)
    found = run._ready(q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, None, False,
                       run.switches(), type(None), False)  # fmt: skip
    assert found.kept is not None and found.kept.io
    ran = _counting(monkeypatch)
    got = qkv.attention(q, k, v)
    assert got.dtype == dtype and len(ran) == 0  # (the kept road ran)
    even = np.where(bits % 2 == 0, bits, bits + 1)  # each head's values, 4 query heads each
    np.testing.assert_array_equal(got.view(np.uint16), np.repeat(even, 4, axis=1)[..., :1, :]
                                  .repeat(L, axis=2))  # fmt: skip
    np.testing.assert_array_equal(got.view(np.uint16), first.view(np.uint16))
    strided = qkv.attention(_strided(q), k, v)  # (q made contiguous for the kept road)
    np.testing.assert_array_equal(strided.view(np.uint16), got.view(np.uint16))
    assert len(ran) == 0
    tq, tk, tv = (torch.from_numpy(a.view(np.int16)).view(getattr(torch, name)) for a in (q, k, v))
    for _ in range(2):  # (the first keeps the tensors' key)
        out = qkv.attention(tq, tk, tv)
    np.testing.assert_array_equal(_viewed(out).view(np.uint16), got.view(np.uint16))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(8, 12, 12, 53, 53, 64, 64), (2, 8, 2, 130, 130, 64, 64)])
def test_bfloat16_prefill_kept_road_reads_q_as_it_is(monkeypatch, shape, causal):
    """The bfloat16 prefill (vdpbf16ps) keeps its set-up too, taking q as the bfloat16 it is
    (no float32 copy): from the second call on only the kept road runs, with the general
    road's bits, on NumPy arrays (a strided q too) and on tensors, near the float64
    reference."""
    _native()
    from qkv.engine.kernels import native_bf16

    if not native_bf16.available():
        pytest.skip("no AVX512_BF16 here: the bfloat16 prefill does not run")
    bf16 = _bf16()
    q, k, v = (a.astype(bf16) for a in _arrays(shape, np.float32))
    run.forget()
    first = qkv.attention(q, k, v, causal=causal)
    found = run._ready(q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, None, causal,
                       run.switches(), type(None), False)  # fmt: skip
    assert found.choice.kernel == "native bfloat16 prefill"
    assert found.kept is not None and found.kept.io
    ran = _counting(monkeypatch)
    got = qkv.attention(q, k, v, causal=causal)
    strided = qkv.attention(_strided(q), k, v, causal=causal)
    assert got.dtype == bf16 and len(ran) == 0
    np.testing.assert_array_equal(got.view(np.uint16), first.view(np.uint16))
    np.testing.assert_array_equal(strided.view(np.uint16), got.view(np.uint16))
    general = _general(q, k, v, causal=causal)
    np.testing.assert_array_equal(general.view(np.uint16), got.view(np.uint16))
    done = found.kept(q, k, v)  # (its output alone: no lse is written for it)
    assert done is not None and done[1] is None
    np.testing.assert_array_equal(done[0].view(np.uint16), got.view(np.uint16))
    wide = [a.astype(np.float64) for a in (q, k, v)]
    want = reference.attention(*wide, causal=causal)
    # (the bfloat16 prefill's bound, tests/test_engine_native_bf16.py's _bound: its weights
    # rounded to bfloat16, then the output)
    bound = 2.0**-8 * (np.abs(wide[2]).max() + np.abs(want).max()) + 1e-5
    np.testing.assert_allclose(got.astype(np.float64), want, atol=bound)
    tq, tk, tv = (torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) for a in (q, k, v))
    ran.clear()
    out = qkv.attention(tq, tk, tv, causal=causal)  # (the arrays' key: kept already)
    assert len(ran) == 0 and out.dtype is torch.bfloat16
    np.testing.assert_array_equal(_viewed(out).view(np.uint16), got.view(np.uint16))
    real = native_bf16.prefill_team  # another thread team: the general road, the same bits
    monkeypatch.setattr(native_bf16, "prefill_team", lambda *a: (real(*a)[0] + 1, None))
    again = qkv.attention(q, k, v, causal=causal)
    assert len(ran) == 1
    np.testing.assert_array_equal(again.view(np.uint16), got.view(np.uint16))


# Plain CPU tensors of float32/float64 reach a kept road by their addresses and strides
# (tensors.read_at, run.plain_at), without NumPy views: the same bits as the arrays' road.


def _viewed(t):
    """Tensor ``t``'s NumPy view (ml_dtypes' bfloat16 for bfloat16)."""
    if t.dtype is torch.bfloat16:
        return t.view(torch.int16).numpy().view(_bf16())
    return t.numpy()


@settings(max_examples=30, deadline=None)
@given(
    shape=shapes(batch=(1, 2), heads=(1, 4), L=(1, 24), S=(1, 40), d=(8, 70), dv_differs=True)
    | shapes(batch=(1, 2), heads=(2, 8), L=(1, 24), S=(1, 40), d=(8, 70), grouped=True),
    name=st.sampled_from(["float32", "float64", "float16", "bfloat16"]),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_tensor_kept_road_gives_the_arrays_bits(shape, name, causal, seed):
    """Three calls of one key on tensors (the first keeps the road), then the same values with
    other strides (a transposed copy's view, and a view at an offset): each a tensor with the
    NumPy arrays' bits on the same strides (16-bit ones narrowed by PyTorch, not ml_dtypes),
    near the float64 reference."""
    if name == "bfloat16":
        pytest.importorskip("ml_dtypes")
    dtype = getattr(torch, name)
    q, k, v = (torch.from_numpy(a).to(dtype) for a in _arrays(shape, np.float32, seed))
    want = qkv.attention(_viewed(q), _viewed(k), _viewed(v), causal=causal)
    for _ in range(3):
        got = qkv.attention(q, k, v, causal=causal)
        assert isinstance(got, torch.Tensor) and got.dtype == dtype
        np.testing.assert_array_equal(_viewed(got), want)
    sq = q.transpose(-1, -2).contiguous().transpose(-1, -2)
    pad = torch.cat([torch.zeros_like(v[..., :1, :]), v], dim=-2)
    ov = pad[..., 1:, :]  # (a view at an offset into its storage)
    for _ in range(2):
        got = qkv.attention(sq, k, ov, causal=causal)
        strided = qkv.attention(_viewed(sq), _viewed(k), _viewed(ov), causal=causal)
        np.testing.assert_array_equal(_viewed(got), strided)
    wide = (a.double().numpy() for a in (q, k, v))
    ref = reference.attention(*wide, causal=causal)
    kind = "fast path" if name in ("float32", "float64") else "half precision"
    np.testing.assert_allclose(got.double().numpy(), ref, **tol(kind, dtype))


@pytest.mark.parametrize(("shape", "row"), _KEPT_CASES)
@pytest.mark.parametrize("name", ["float32", "bfloat16"])
def test_tensor_kept_road_is_the_road_taken(monkeypatch, shape, row, name):
    """From a key's second call on, tensors run the kept road on their addresses (no NumPy
    view of them); what that road cannot read — other strides, a tensor that requires grad,
    a negative view, dtypes that differ — is read as before, with the right values."""
    _native()
    from qkv import tensors
    from qkv.engine.kernels import native_lib

    ran, viewed = _counting(monkeypatch), []
    real_at, real_read = native_lib.Kept.at, tensors.read_plain
    monkeypatch.setattr(native_lib.Kept, "at", lambda *a: viewed.append("at") or real_at(*a))
    monkeypatch.setattr("qkv.front.read_plain", lambda *a: viewed.append("view") or real_read(*a))
    if name == "bfloat16":
        pytest.importorskip("ml_dtypes")
    q, k, v = (torch.from_numpy(a).to(getattr(torch, name)) for a in _arrays(shape, np.float32))
    run.forget()
    first = qkv.attention(q, k, v)
    assert viewed == ["view"] and len(ran) == 1  # the first call keeps the road
    for _ in range(2):
        assert torch.equal(qkv.attention(q, k, v), first)
    assert viewed == ["view", "at", "at"] and len(ran) == 1
    viewed.clear()
    sk = k.transpose(-1, -2).contiguous().transpose(-1, -2)
    strided = qkv.attention(q, sk, v)
    assert viewed[:2] == ["at", "view"]
    want = qkv.attention(_viewed(q), _viewed(sk), _viewed(v))
    np.testing.assert_array_equal(_viewed(strided), want)
    qg = q.clone().requires_grad_(True)
    out = qkv.attention(qg, k, v)
    out.sum().backward()
    assert qg.grad is not None
    kind = "fast path" if name == "float32" else "half precision"
    np.testing.assert_allclose(out.detach().float(), first.float(), **tol(kind, q.dtype))
    got = qkv.attention(q._neg_view(), k, v)
    wide = [a.double().numpy() for a in (q, k, v)]
    want = reference.attention(-wide[0], *wide[1:])
    np.testing.assert_allclose(got.double().numpy(), want, **tol(kind, q.dtype))
    mixed = qkv.attention(q.double(), k, v)
    assert mixed.dtype == torch.float64
    np.testing.assert_allclose(mixed.numpy(), reference.attention(*wide), **tol(kind, q.dtype))


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("B", [1, 3, 12])
def test_tensor_padded_call_runs_the_kept_road_on_addresses(monkeypatch, name, B):
    """A padding mask beside plain tensors: from the key's second call on, its key counts
    (read from the mask tensor's view, a mask that hides nothing read as none) run the kept
    key-count road on the tensors' addresses, with the arrays' bits; a mask that is not a
    padding mask takes the arrays' road, with its values."""
    _native()
    if name == "bfloat16":
        pytest.importorskip("ml_dtypes")
    from qkv.engine.kernels import native_lib

    viewed = []
    real_at = native_lib.Kept.at
    monkeypatch.setattr(native_lib.Kept, "at", lambda *a: viewed.append("at") or real_at(*a))
    dtype = getattr(torch, name)
    shape = (B, 8, 8, 16, 16, 32, 32)
    q, k, v = (torch.from_numpy(a).to(dtype) for a in _arrays(shape, np.float32, B))
    run.forget()
    run._counted.cache_clear()
    rng = np.random.default_rng(B)
    for i in range(4):
        counts = rng.integers(1, 17, B) if i else np.full(B, 16)
        keep = torch.from_numpy((np.arange(16)[None, :] < counts[:, None])[:, None, None, :])
        got = qkv.attention(q, k, v, mask=keep, causal=True)
        want = qkv.attention(_viewed(q), _viewed(k), _viewed(v), mask=keep.numpy(), causal=True)
        assert isinstance(got, torch.Tensor) and got.dtype == dtype
        np.testing.assert_array_equal(_viewed(got), want)
    assert viewed[-2:] == ["at", "at"]  # (calls 2 and 3: kept from calls 0 and 1)
    viewed.clear()
    middle = keep.clone()
    middle[0, 0, 0, 0] = False  # the first key hidden: not a padding mask
    got = qkv.attention(q, k, v, mask=middle)
    assert viewed == []
    wide = [a.double().numpy() for a in (q, k, v)]
    ref = reference.attention(*wide, mask=middle.numpy())
    kind = "fast path" if name == "float32" else "half precision"
    np.testing.assert_allclose(got.double().numpy(), ref, **tol(kind, dtype))


def test_read_at_refuses_what_it_cannot_read():
    """read_at gives None for tensors whose addresses the kept road must not read."""
    from qkv.tensors import read_at

    q = torch.randn(1, 2, 3, 8)
    assert read_at(q, q, q) is not None
    assert read_at(q.numpy(), q, q) is None
    assert read_at(q.int(), q.int(), q.int()) is None
    assert read_at(q.bfloat16(), q, q) is None
    assert read_at(q, q.double(), q) is None
    assert read_at(q.clone().requires_grad_(True), q, q) is None
    assert read_at(q._neg_view(), q, q) is None
    assert read_at(q.to_sparse(), q, q) is None
    assert read_at(q.to("meta"), q, q) is None
    assert read_at(torch.nn.Parameter(q), q, q) is None  # (a subclass: the general road)


@pytest.mark.parametrize("L", [1, 16])  # the decode step's kept road, the prefill's
def test_kept_call_serves_calls_from_many_threads(L):
    """A kept small call hands the library its operands' addresses, and the library fills a
    copy of the kept arguments per call (``qkv_decode_at``, ``qkv_prefill_at``): calls on other
    operands from several threads at once each get their own operands' answer, the bits of the
    same call made alone, equal to the float64 reference."""
    _native()
    from concurrent.futures import ThreadPoolExecutor

    from qkv.engine.kernels import native_lib

    shape = (1, 8, 2, L, 16, 32, 32)
    q, k, v = _arrays(shape, np.float32)
    qkv.attention(q, k, v)  # (the key's first call keeps its road)
    dt, off = q.dtype, native_lib.switches()
    kept = run._ready(q.shape, k.shape, v.shape, dt, dt, dt, None, False, off, type(None),
                      False).kept  # fmt: skip
    assert kept is not None
    inputs = [_arrays(shape, np.float32, seed) for seed in range(1, 9)]
    alone = [kept(*x)[0] for x in inputs]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda x: kept(*x)[0], inputs * 8))
    for i, got in enumerate(together):
        np.testing.assert_array_equal(got, alone[i % len(inputs)])
    for x, got in zip(inputs, alone, strict=True):
        want = reference.attention(*(a.astype(np.float64) for a in x))
        np.testing.assert_allclose(got, want, **tol("fast path", np.float32))


def _fields_alike(a, b):
    """Two plans' fields equal, stand-in arrays compared by dtype and shape."""
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape, name
        else:
            assert x == y, name


@settings(max_examples=60, deadline=None)
@given(
    shape=shapes(batch=(1, 2), heads=(1, 4), L=(1, 4), S=(1, 300), d=(1, 70), dv_differs=True)
    | shapes(batch=(1, 2), heads=(2, 8), L=(1, 3), S=(1, 300), d=(1, 70), grouped=True),
    S=st.integers(0, 700),
    name=st.sampled_from(["float32", "float64", "float16", "bfloat16"]),
    causal=st.booleans(),
    scale=st.sampled_from([None, 0.3, 1]),
)
def test_a_new_number_of_keys_is_planned_from_the_last_one(shape, S, name, causal, scale):
    """A call whose shapes differ from a known one's in the number of keys alone (a decoding
    loop over a slice of its own buffers) is planned from the known answer: the same fields
    (but the shapes they record) and the router's choice for the new number, equal to what
    a call never seen before gets; the kept road grown to it where the road is the same."""
    from unittest import mock

    dt = np.dtype(_bf16()) if name == "bfloat16" else np.dtype(name)
    B, Hq, Hkv, L, S0, d, dv = shape
    off = qkv.engine.kernels.native_lib.switches()

    def key(n):
        return ((B, Hq, L, d), (B, Hkv, n, d), (B, Hkv, n, dv), dt, dt, dt, scale, causal, off,
                type(scale), False)  # fmt: skip

    with mock.patch.object(run, "_FAMILIES", {}):
        known = run._ready.__wrapped__(*key(S0))
        if known is None:
            return
        q, k, v = _arrays((B, Hq, Hkv, L, S0, d, dv), dt)
        run._unmasked(q, k, v, known)  # (its first call keeps its road, if it has one)
        grown = run._ready.__wrapped__(*key(S))
    with mock.patch.object(run, "_FAMILIES", {}):
        fresh = run._ready.__wrapped__(*key(S))
    _fields_alike(grown.fields, fresh.fields)
    assert grown.choice == fresh.choice and grown.narrow == fresh.narrow
    q, k, v = _arrays((B, Hq, Hkv, L, S, d, dv), dt, seed=1)
    if grown.kept is not None:  # the grown road gives the general road's bits
        assert grown.kept.grow is not None
        done = grown.kept(q.astype(np.float32) if grown.narrow and not grown.kept.io else q, k, v)
        if done is not None:
            want = _general(q, k, v, causal=causal, scale=scale)
            np.testing.assert_array_equal(done[0].astype(dt), want)


@pytest.mark.parametrize("tensors", [False, True])
def test_decoding_loop_over_a_growing_slice(tensors):
    """A decoding loop over a slice of its own buffers, one key longer each step: every step
    runs on the road kept for it (grown from the step before, no general road after the
    first) and equals the general road's bits and the float64 reference."""
    _native()
    from qkv.engine.kernels import dispatch

    rng = np.random.default_rng(3)
    K = values(rng, (1, 2, 600, 64)).astype(np.float32)
    V = values(rng, (1, 2, 600, 64)).astype(np.float32)
    qs = values(rng, (40, 1, 8, 1, 64)).astype(np.float32)
    if tensors:
        torch = pytest.importorskip("torch")
        K, V, qs = torch.from_numpy(K), torch.from_numpy(V), torch.from_numpy(qs)
    ran = []
    real = dispatch.attend
    try:
        dispatch.attend = lambda *a, **kw: ran.append(1) or real(*a, **kw)
        outs = [qkv.attention(qs[i], K[:, :, : 230 + i], V[:, :, : 230 + i]) for i in range(40)]
    finally:
        dispatch.attend = real
    assert len(ran) <= 1  # (the loop's first shape, unless an earlier test kept it)
    for i, got in enumerate(outs):
        args = (np.asarray(qs[i]), np.asarray(K[:, :, : 230 + i]), np.asarray(V[:, :, : 230 + i]))
        np.testing.assert_array_equal(np.asarray(got), _general(*args))
        want = reference.attention(*(a.astype(np.float64) for a in args))
        np.testing.assert_allclose(np.asarray(got), want, **tol("fast path", np.float32))
