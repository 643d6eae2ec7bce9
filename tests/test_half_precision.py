"""bfloat16 and float16 through qkv.attention: K/V read in their own dtype where the native
decode step serves the call (no whole-array conversion), widened elsewhere; results in the
inputs' dtype, lse in float32.

Tolerance rule (as FlashAttention's and PyTorch's own suites judge a low-precision kernel
against a low-precision reference): qkv's error against the float64 reference on the same
rounded inputs must be at most PyTorch's SDPA error in the same dtype on those inputs, plus
one rounding of the output to the dtype (half a unit in the last place).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.conftest import bound, ulps

import qkv
from qkv import reference
from qkv.engine.kernels import native_decode

torch = pytest.importorskip("torch")


def _sdpa(q, k, v, causal):
    group = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(group, 1) for x in (k, v))
    if causal and q.shape[2] != k.shape[2]:  # bottom-right, as qkv's, with a mask
        L, S = q.shape[2], k.shape[2]
        keep = torch.ones(L, S, dtype=torch.bool).tril(S - L)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    L=st.sampled_from([1, 1, 2, 40]),
    S=st.integers(1, 3000),
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 3),
    d=st.sampled_from([16, 64, 128]),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_half_precision_error_is_within_sdpas(dtype, L, S, kv_heads, group, d, causal, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, kv_heads * group, L, d, generator=g).to(dtype)
    k = (torch.randn(2, kv_heads, S, d, generator=g) * 2).to(dtype)
    v = torch.randn(2, kv_heads, S, d, generator=g).to(dtype)
    out, lse = qkv.attention(q, k, v, causal=causal, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == (*q.shape[:3], d)
    want = reference.attention(*(x.double().numpy() for x in (q, k, v)), causal=causal)
    ours = np.abs(out.double().numpy() - want).max()
    theirs = np.abs(_sdpa(q, k, v, causal).double().numpy() - want).max()
    assert ours <= theirs + ulps(dtype, 0.5) * np.abs(want).max() + 1e-6


def test_decoding_step_reads_half_precision_kv_in_place(monkeypatch):
    if not native_decode.available():
        pytest.skip("native kernels not built (or QKV_NATIVE=0): K/V are widened instead")
    seen = []

    def spy_on(name):  # the step on a kept struct (an unmasked call), or the planned step
        real = getattr(native_decode, name)

        def spy(q, k, v, *rest, **kw):
            seen.append((k, v))
            return real(q, k, v, *rest, **kw)

        monkeypatch.setattr(native_decode, name, spy)

    spy_on("step")
    spy_on("_plain_step")
    for dtype in (torch.bfloat16, torch.float16):
        q = torch.randn(1, 8, 1, 128).to(dtype)
        k, v = (torch.randn(1, 2, 4096, 128).to(dtype) for _ in range(2))
        out = qkv.attention(q, k, v)
        (k_read, v_read), *_ = seen[-1:]
        # the tensors' own memory, in their own 16-bit dtype: nothing converted or copied
        assert k_read.itemsize == 2 and k_read.ctypes.data == k.data_ptr()
        assert v_read.ctypes.data == v.data_ptr()
        want = reference.attention(*(x.double().numpy() for x in (q, k, v)))
        np.testing.assert_allclose(out.double().numpy(), want, atol=bound("two roundings", dtype))


def test_numpy_bfloat16_and_float16_arrays():
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="NumPy's bfloat16 comes from ml_dtypes")
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, n, 64)) for n in (1, 5000, 5000))
    for dt in (ml_dtypes.bfloat16, np.float16):
        out, lse = qkv.attention(q.astype(dt), k.astype(dt), v.astype(dt), return_lse=True)
        assert out.dtype == dt and lse.dtype == np.float32
        want = reference.attention(*(x.astype(dt).astype(np.float64) for x in (q, k, v)))
        np.testing.assert_allclose(out.astype(np.float64), want, atol=bound("half precision", dt))
    # bfloat16 arrays everywhere else are read as float32
    w = qkv.attention_weights(q[0, 0].astype(ml_dtypes.bfloat16), k[0, 0, :3])
    assert w.dtype == np.float64 and np.allclose(w.sum(-1), 1)


def test_a_bfloat16_additive_mask_is_a_bias():
    """A bfloat16 model's additive mask (0 and -inf, or any bias, in bfloat16) is a float bias,
    read as float32: the same result as the float32 mask, and the reference's."""
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="NumPy's bfloat16 comes from ml_dtypes")
    rng = np.random.default_rng(5)
    q, k, v = (torch.from_numpy(rng.standard_normal((2, 2, 90, 64))).bfloat16() for _ in range(3))
    bias = torch.from_numpy(rng.standard_normal((2, 1, 90, 90)) * 2).bfloat16()
    bias[0, ..., 70:] = float("-inf")  # padding
    out = qkv.attention(q, k, v, mask=bias)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, qkv.attention(q, k, v, mask=bias.float()))
    want = reference.attention(*(x.double().numpy() for x in (q, k, v)), mask=bias.double().numpy())
    np.testing.assert_allclose(
        out.double().numpy(), want, atol=bound("two roundings", torch.bfloat16)
    )
    as_numpy = bias.float().numpy().astype(ml_dtypes.bfloat16)
    np.testing.assert_allclose(
        qkv.attention(*(x.float().numpy() for x in (q, k, v)), mask=as_numpy),
        qkv.attention(*(x.float().numpy() for x in (q, k, v)), mask=bias.float().numpy()),
    )
