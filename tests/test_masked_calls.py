"""A call with a boolean mask that is no padding, or a float bias, on the short road kept for
its shapes and mask layout (:func:`qkv.engine.run._masked`, the native prefill's kept set-up
:func:`qkv.engine.kernels.native.keep`): ``qkv.attention(q, k, v, mask=m)`` on NumPy
arrays or plain CPU tensors.

It must give exactly what the general road gives (``return_lse=True`` forces it: the same
kernel on the same plan, equal bits), equal the float64 reference, read each call's own mask
(a kept set-up is for a layout, never for values), and leave to the general road what it reads
otherwise: padding masks (key counts), a 0/-inf float mask (the boolean mask it is), biases of
another dtype, and biases that require grad (refused there by name).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.conftest import tol

import qkv
from qkv import front, reference
from qkv.engine import run
from qkv.engine.kernels import native

native_built = pytest.mark.skipif(
    not native.available()[0], reason="the native prefill is not built here"
)


def _general(q, k, v, mask, causal=False):
    """The general road's output: asking for the lse skips the short road."""
    return qkv.attention(q, k, v, mask=mask, causal=causal, return_lse=True)[0]


def _mask(rng, kind, shape, dtype):
    """A mask of ``kind`` and ``shape``: a boolean one that is no padding (a row's visible keys
    not a prefix; some rows see none with ``"bool, empty rows"``), or a float bias (with -inf
    entries where ``"bias, -inf"``)."""
    if kind.startswith("bool"):
        m = rng.random(shape) > 0.4
        m[..., 0] = False  # (no row's visible keys are a prefix: not a padding mask)
        m[..., -1] = True
        if kind == "bool, empty rows" and shape[-2] > 1:
            m[..., 0, :] = False
        return m
    m = rng.standard_normal(shape).astype(dtype)
    if kind == "bias, -inf":
        m[rng.random(shape) < 0.3] = -np.inf
    return m


@settings(max_examples=60, deadline=None)
@given(
    B=st.integers(1, 3),
    kv=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    L=st.sampled_from([1, 2, 9, 16, 17, 37]),
    S=st.sampled_from([2, 5, 16, 33, 70]),
    d=st.sampled_from([4, 16, 32, 64]),
    kind=st.sampled_from(["bool", "bool, empty rows", "bias", "bias, -inf"]),
    heads_axis=st.sampled_from(["one", "all"]),
    batch_axis=st.sampled_from(["one", "all"]),
    causal=st.booleans(),
    dtype=st.sampled_from([np.float32, np.float64]),
    seed=st.integers(0, 2**31),
)
def test_a_masked_call_equals_the_general_road_and_the_reference(
    B, kv, group, L, S, d, kind, heads_axis, batch_axis, causal, dtype, seed
):
    rng = np.random.default_rng(seed)
    H = kv * group
    q = rng.standard_normal((B, H, L, d)).astype(dtype)
    k, v = (rng.standard_normal((B, kv, S, d)).astype(dtype) for _ in range(2))
    shape = (B if batch_axis == "all" else 1, H if heads_axis == "all" else 1, L, S)
    for _ in range(3):  # the first call keeps the road; the later ones run on it, new masks
        m = _mask(rng, kind, shape, dtype)
        got = qkv.attention(q, k, v, mask=m, causal=causal)
        np.testing.assert_array_equal(got, _general(q, k, v, m, causal))
        ref = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), mask=m, causal=causal)
        finite = np.isfinite(ref)
        assert (np.isfinite(got) == finite).all()
        np.testing.assert_allclose(got[finite], ref[finite], **tol("fast path", dtype))


@native_built
@pytest.mark.parametrize("kind", ["bool", "bias"])
def test_the_second_call_runs_on_the_kept_road_and_reads_its_own_mask(monkeypatch, kind):
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 4, 16, 32)).astype(np.float32) for _ in range(3))
    first = _mask(rng, kind, (2, 1, 16, 16), np.float32)
    run.forget()
    qkv.attention(q, k, v, mask=first)  # keeps the road
    general = []
    real = front._run
    monkeypatch.setattr(front, "_run", lambda call: general.append(1) or real(call))
    kept = []
    real_keep = native.keep
    monkeypatch.setattr(native, "keep", lambda *a, **kw: kept.append(1) or real_keep(*a, **kw))
    for _ in range(3):
        m = _mask(rng, kind, (2, 1, 16, 16), np.float32)
        got = qkv.attention(q, k, v, mask=m)
        assert not general  # neither checked nor routed again
        monkeypatch.setattr(front, "_run", real)
        np.testing.assert_array_equal(got, _general(q, k, v, m))
        monkeypatch.setattr(front, "_run", lambda call: general.append(1) or real(call))
    assert not kept  # (set up once, at the first call)
    # the same masks laid out otherwise (a transposed copy's view): a road of its own
    m = _mask(rng, kind, (2, 1, 16, 16), np.float32)
    other = np.ascontiguousarray(m.swapaxes(-1, -2)).swapaxes(-1, -2)
    np.testing.assert_array_equal(qkv.attention(q, k, v, mask=other), _general(q, k, v, m))


@native_built
def test_masks_the_validation_reads_otherwise_keep_their_roads():
    """A padding mask runs on its key counts, a 0/-inf float mask as the boolean mask it is,
    a float64 bias beside float32 inputs narrowed: each equal to the general road's."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((3, 2, 16, 8)).astype(np.float32) for _ in range(3))
    pad = np.arange(16) < np.array([16, 9, 3])[:, None]
    cases = {
        "padding": pad[:, None, None, :].repeat(16, axis=2),
        "0/-inf": np.where(rng.random((3, 1, 16, 16)) > 0.3, 0.0, -np.inf).astype(np.float32),
        "float64 bias": rng.standard_normal((3, 1, 16, 16)),
    }
    for name, m in cases.items():
        for _ in range(2):
            np.testing.assert_array_equal(
                qkv.attention(q, k, v, mask=m), _general(q, k, v, m), err_msg=name
            )
    # the 0/-inf mask's boolean form gives the same bits
    zero_inf = cases["0/-inf"]
    np.testing.assert_array_equal(
        qkv.attention(q, k, v, mask=zero_inf), qkv.attention(q, k, v, mask=zero_inf == 0)
    )


@native_built
@pytest.mark.parametrize("kind", ["bool", "bias"])
def test_tensors_take_the_kept_road_and_a_bias_that_requires_grad_is_refused(kind):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal((1, 4, 16, 32)).astype(np.float32) for _ in range(3)]
    q, k, v = (torch.from_numpy(a) for a in arrays)
    for _ in range(3):
        m = _mask(rng, kind, (1, 4, 16, 16), np.float32)
        got = qkv.attention(q, k, v, mask=torch.from_numpy(m))
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
        np.testing.assert_array_equal(got.numpy(), _general(*arrays, m))
    if kind == "bias":  # (a bias that requires grad: the general road refuses it by name)
        bias = torch.from_numpy(_mask(rng, kind, (1, 4, 16, 16), np.float32)).requires_grad_()
        with pytest.raises(ValueError, match="mask: qkv gives no gradient for a float mask"):
            qkv.attention(q, k, v, mask=bias)


def test_bad_masks_keep_their_messages():
    q = k = v = np.ones((1, 2, 16, 8), np.float32)
    for _ in range(2):  # (after a good call of the same shapes kept the road)
        qkv.attention(q, k, v, mask=np.ones((1, 2, 16, 16), np.float32))
        with pytest.raises(ValueError, match=r"mask: shape \(1, 3, 16, 16\) does not broadcast"):
            qkv.attention(q, k, v, mask=np.ones((1, 3, 16, 16), np.float32))
        with pytest.raises(TypeError, match="mask: expected bool"):
            qkv.attention(q, k, v, mask=np.ones((1, 2, 16, 16), np.int32))


@settings(max_examples=30, deadline=None)
@given(
    kv=st.integers(1, 2),
    group=st.sampled_from([1, 4]),
    L=st.sampled_from([2, 16, 37]),
    S=st.sampled_from([5, 16, 70]),
    d=st.sampled_from([16, 64]),
    kind=st.sampled_from(["bool", "bias", "bias, -inf"]),
    inputs=st.sampled_from(["bfloat16", "float16", "float64"]),
    bias_dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
    seed=st.integers(0, 2**31),
)
def test_16_bit_inputs_and_narrower_biases_equal_the_general_road(
    kv, group, L, S, d, kind, inputs, bias_dtype, seed
):
    """16-bit inputs (q widened, K/V read as stored) with a boolean mask or a bias, and biases
    narrower than the compute dtype (widened exactly, as the validation widens them)."""
    import ml_dtypes

    dtypes = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
    rng = np.random.default_rng(seed)
    dt = dtypes.get(inputs, np.float64)
    H = kv * group
    q = rng.standard_normal((2, H, L, d)).astype(dt)
    k, v = (rng.standard_normal((2, kv, S, d)).astype(dt) for _ in range(2))
    for _ in range(3):
        m = _mask(rng, kind, (2, 1, L, S), np.float32)
        if m.dtype != bool:
            m = m.astype(dtypes.get(bias_dtype, np.float32))
        got = qkv.attention(q, k, v, mask=m)
        assert got.dtype == q.dtype
        np.testing.assert_array_equal(got, _general(q, k, v, m))
        wide = [x.astype(np.float64) for x in (q, k, v)]
        ref = reference.attention(*wide, mask=m if m.dtype == bool else m.astype(np.float64))
        finite = np.isfinite(ref)
        np.testing.assert_allclose(
            got.astype(np.float64)[finite], ref[finite], **tol("tensor dtypes", dt)
        )


@native_built
def test_bfloat16_tensors_with_a_bfloat16_bias_take_the_kept_road(monkeypatch):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    q, k, v = (torch.randn(1, 8, 16, 64, generator=torch.Generator().manual_seed(i)).bfloat16()
               for i in range(3))  # fmt: skip
    bias = torch.from_numpy(rng.standard_normal((1, 8, 16, 16)).astype(np.float32)).bfloat16()
    first = qkv.attention(q, k, v, mask=bias)  # keeps the road
    general = []
    real = front._run
    monkeypatch.setattr(front, "_run", lambda call: general.append(1) or real(call))
    got = qkv.attention(q, k, v, mask=bias)
    assert not general and got.dtype == torch.bfloat16
    assert torch.equal(got, first)
    monkeypatch.setattr(front, "_run", real)
    want = qkv.attention(q, k, v, mask=bias, return_lse=True)[0]
    assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["bool", "bias"])
@pytest.mark.parametrize("layout", ["rows", "one row for all", "keys strided", "rows strided"])
@pytest.mark.parametrize("L", [16, 70, 130])
def test_bfloat16_masks_of_every_layout_equal_the_reference(kind, layout, L):
    """The bfloat16 prefill reads a tile's mask a word of key bits per row, and its bias 16 x
    16 blocks transposed at a time (a row's keys together where they lie in a row, else one by
    one): masks and biases whose rows lie apart or are one row broadcast to all, whose keys lie
    apart, over tiles of 64 keys and a remainder."""
    import ml_dtypes

    rng = np.random.default_rng(L)
    q, k, v = (rng.standard_normal((2, 4, L, 32)).astype(ml_dtypes.bfloat16) for _ in range(3))
    keep = _mask(rng, kind, (2, 1, L, L), np.float32)
    if layout == "one row for all":
        keep = np.broadcast_to(keep[:, :, :1], keep.shape)
    elif layout == "keys strided":
        keep = np.ascontiguousarray(keep.swapaxes(-1, -2)).swapaxes(-1, -2)
    elif layout == "rows strided":
        keep = np.pad(keep, ((0, 0), (0, 0), (0, 0), (0, 9)))[..., :L]
    got = qkv.attention(q, k, v, mask=keep)
    np.testing.assert_array_equal(got, _general(q, k, v, keep))
    wide = [x.astype(np.float64) for x in (q, k, v)]
    ref = reference.attention(*wide, mask=keep if kind == "bool" else keep.astype(np.float64))
    np.testing.assert_allclose(got.astype(np.float64), ref, **tol("tensor dtypes", "bfloat16"))
