"""Cases for the Triton kernels (qkv.gpu) run by Triton's interpreter on CPU tensors.

Not collected by a plain ``pytest`` run: tests/test_gpu_triton.py runs this file in a
subprocess with ``TRITON_INTERPRET=1``, which must be set before Triton is first imported
(its own library functions are compiled or interpreted from then on), so it never leaks
into the other tests. Every kernel is compared with :mod:`qkv.reference` (forward) or
:func:`qkv.attention_vjp` (gradients); every size is deliberately not a multiple of the
16-wide blocks used under the interpreter.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by tests/test_gpu_triton.py with TRITON_INTERPRET=1", allow_module_level=True)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tests.conftest import bound, tol  # noqa: E402

import qkv  # noqa: E402
from qkv import reference  # noqa: E402
from qkv.gpu import _kernels, api, launch  # noqa: E402

assert _kernels.INTERPRETED

TOL = tol("triton")


def _inputs(shape_q, shape_k, shape_v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(s, generator=g).to(dtype) for s in (shape_q, shape_k, shape_v))


def _np(t):
    return None if t is None else (t.numpy() if t.dtype == torch.bool else t.double().numpy())


def _check(out, lse, ref_out, ref_lse, dtype):
    assert out.dtype == dtype and lse.dtype == torch.float32
    np.testing.assert_allclose(out.double().numpy(), ref_out, **TOL[dtype])
    empty = np.isneginf(ref_lse)
    assert (np.isneginf(lse.numpy()) == empty).all()
    assert (out.double().numpy()[empty] == 0).all()
    np.testing.assert_allclose(
        lse.numpy()[~empty], ref_lse[~empty], **tol("triton lse", torch.float32)
    )


# (Hq, Hkv, L, S, d, dv, causal, window): grouped heads, L < S and L > S (rows with no key),
# windows on one or both sides, d and dv not powers of two.
CASES = {
    "plain": (2, 2, 20, 37, 12, 10, False, None),
    "causal_L<S_gqa": (4, 2, 19, 45, 12, 12, True, None),
    "causal_L>S_empty_rows": (2, 1, 37, 20, 8, 8, True, None),
    "sliding_window": (2, 2, 33, 33, 16, 16, True, (5, None)),
    "window_both_sides": (2, 2, 21, 40, 12, 12, False, (3, 4)),
}


@pytest.mark.parametrize("name", CASES)
def test_prefill_equals_reference_float32(name):
    hq, hkv, L, S, d, dv, causal, window = CASES[name]
    q, k, v = _inputs((2, hq, L, d), (2, hkv, S, d), (2, hkv, S, dv), torch.float32)
    out, lse = api.attention(q, k, v, causal=causal, window=window, return_lse=True, kernel="tiled")
    ref = reference.attention(_np(q), _np(k), _np(v), causal=causal, window=window, return_lse=True)
    _check(out, lse, *ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["causal_L<S_gqa", "causal_L>S_empty_rows"])
def test_prefill_half_precisions(name, dtype):
    hq, hkv, L, S, d, dv, causal, window = CASES[name]
    q, k, v = _inputs((1, hq, L, d), (1, hkv, S, d), (1, hkv, S, dv), dtype, seed=1)
    out, lse = api.attention(q, k, v, causal=causal, window=window, return_lse=True, kernel="tiled")
    ref = reference.attention(_np(q), _np(k), _np(v), causal=causal, window=window, return_lse=True)
    _check(out, lse, *ref, dtype)


def test_float16_scores_beyond_float16_range_do_not_overflow():
    q = torch.full((1, 1, 3, 16), 60.0, dtype=torch.float16)
    k = torch.full((1, 1, 5, 16), 60.0, dtype=torch.float16)  # q·k = 57600 > float16 max
    v = torch.arange(5 * 4, dtype=torch.float16).reshape(1, 1, 5, 4)
    out = api.attention(q, k, v, scale=1.0)
    ref = reference.attention(_np(q), _np(k), _np(v), scale=1.0)
    np.testing.assert_allclose(out.double().numpy(), ref, **TOL[torch.float16])


@pytest.mark.parametrize(
    ("L", "causal", "window", "dtype"),
    [
        (1, False, None, torch.float32),
        (3, True, None, torch.float32),
        (2, True, (20, None), torch.float16),
        (3, False, (30, 0), torch.bfloat16),
    ],
)
def test_decode_split_k_equals_reference(L, causal, window, dtype):
    # 8 query heads share 2 kv heads; 3 key splits of 48 keys over S = 130, merged after
    q, k, v = _inputs((2, 8, L, 12), (2, 2, 130, 12), (2, 2, 130, 10), dtype, seed=2)
    opts = launch.Options(12**-0.5, causal, *(window or (None, None)), group=4)
    out, lse = launch.decode(q, k, v, opts, splits=3)
    ref = reference.attention(_np(q), _np(k), _np(v), causal=causal, window=window, return_lse=True)
    _check(out, lse, *ref, dtype)


def test_decode_through_the_api_chooses_it_for_few_queries(monkeypatch):
    calls = []
    real = launch.decode
    monkeypatch.setattr(launch, "decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = _inputs((3, 4, 1, 20), (3, 1, 70, 20), (3, 1, 70, 20), torch.float32, seed=3)
    out, lse = api.attention(q, k, v, return_lse=True)  # auto: group·L = 4 rows -> decode
    assert calls == [1]
    _check(out, lse, *reference.attention(_np(q), _np(k), _np(v), return_lse=True), torch.float32)


@pytest.mark.parametrize("kernel", ["tiled", "decode"])
def test_bool_mask_and_float_bias_with_fully_masked_rows(kernel):
    q, k, v = _inputs((2, 2, 3, 8), (2, 2, 23, 8), (2, 2, 23, 8), torch.float32, seed=4)
    g = torch.Generator().manual_seed(5)
    mask = torch.rand((3, 23), generator=g) > 0.4  # broadcast over batch and heads
    mask[1] = False  # a row that may attend nothing
    bias = torch.randn((2, 1, 3, 23), generator=g)  # broadcast over heads
    bias[0, 0, 2] = -torch.inf
    for m in (mask, bias):
        out, lse = api.attention(q, k, v, mask=m, causal=True, return_lse=True, kernel=kernel)
        ref = reference.attention(_np(q), _np(k), _np(v), mask=_np(m), causal=True, return_lse=True)
        _check(out, lse, *ref, torch.float32)


def test_mask_given_as_an_array_beside_tensors_is_applied():
    q, k, v = _inputs((1, 2, 4, 8), (1, 2, 9, 8), (1, 2, 9, 8), torch.float32, seed=12)
    mask = np.arange(9)[None, :] % 2 == np.arange(4)[:, None] % 2  # as a NumPy array
    out, lse = api.attention(q, k, v, mask=mask, return_lse=True)
    ref = reference.attention(_np(q), _np(k), _np(v), mask=mask, return_lse=True)
    _check(out, lse, *ref, torch.float32)


def test_shapes_one_dimensional_query_and_broadcast_batch():
    g = torch.Generator().manual_seed(6)
    q = torch.randn(12, generator=g)
    k, v = torch.randn(17, 12, generator=g), torch.randn(17, 5, generator=g)
    out = api.attention(q, k, v)
    assert out.shape == (5,)
    np.testing.assert_allclose(
        out.numpy(), reference.attention(_np(q), _np(k), _np(v)), rtol=TOL[torch.float32]["rtol"]
    )
    q2 = torch.randn(2, 3, 4, 12, generator=g)  # k, v broadcast over the leading batch of 2
    out = api.attention(q2, k[None, None].expand(1, 3, 17, 12), v, causal=True)
    ref = reference.attention(_np(q2), _np(k)[None, None], _np(v), causal=True)
    np.testing.assert_allclose(out.numpy(), ref, **TOL[torch.float32])


GRAD_CASES = {
    "gqa_causal_L<S": ((1, 4, 19, 12), (1, 2, 30, 12), (1, 2, 30, 10), True, None),
    "causal_L>S_empty_rows": ((1, 2, 25, 8), (1, 1, 17, 8), (1, 1, 17, 8), True, None),
    "window": ((2, 1, 21, 12), (2, 1, 21, 12), (2, 1, 21, 12), False, (4, 2)),
}


@pytest.mark.parametrize("name", GRAD_CASES)
def test_gradients_equal_attention_vjp(name):
    sq, sk, sv, causal, window = GRAD_CASES[name]
    q, k, v = (t.requires_grad_() for t in _inputs(sq, sk, sv, torch.float32, seed=7))
    out = api.attention(q, k, v, causal=causal, window=window)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(8))
    out.backward(g)
    want = qkv.attention_vjp(
        _np(q.detach()), _np(k.detach()), _np(v.detach()), g.double().numpy(),
        causal=causal, window=window,
    )  # fmt: skip
    for got, ref in zip((q.grad, k.grad, v.grad), want, strict=True):
        np.testing.assert_allclose(
            got.double().numpy(), ref, **tol("triton backward", torch.float32)
        )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gradients_half_precisions_with_mask_and_broadcast_kv(dtype):
    q, k, v = _inputs((2, 2, 18, 8), (1, 2, 21, 8), (1, 2, 21, 8), dtype, seed=9)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = torch.rand((18, 21), generator=torch.Generator().manual_seed(10)) > 0.3
    mask[4] = False
    out = api.attention(q, k, v, mask=mask, causal=True)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(11)).to(dtype)
    out.backward(g)
    want = qkv.attention_vjp(
        *(_np(t.detach()) for t in (q, k, v)), g.double().numpy(), mask=mask.numpy(), causal=True
    )
    for got, ref in zip((q.grad, k.grad, v.grad), want, strict=True):
        assert got.dtype == dtype and got.shape == ref.shape
        np.testing.assert_allclose(got.double().numpy(), ref, **tol("triton backward", dtype))


def test_uncovered_dtype_falls_back_to_the_cpu_with_a_warning():
    q, k, v = _inputs((1, 2, 5, 4), (1, 2, 6, 4), (1, 2, 6, 4), torch.float64)
    with pytest.warns(api.GpuFallbackWarning, match="float64"):
        out = api.attention(q, k, v, causal=True)
    assert out.dtype == torch.float64
    np.testing.assert_allclose(
        out.numpy(),
        reference.attention(q, k, v, causal=True),
        rtol=bound("float64 path", torch.float64),
    )


def test_bad_input_is_refused_with_the_projects_errors():
    q, k, v = _inputs((1, 3, 5, 4), (1, 2, 6, 4), (1, 2, 6, 4), torch.float32)
    with pytest.raises(qkv.InputError, match="3 query heads cannot share 2 kv heads"):
        api.attention(q, k, v)
    q = q[:, :2]
    with pytest.raises(qkv.InputTypeError, match="mask"):
        api.attention(q, k, v, mask=torch.ones(5, 6, dtype=torch.int64))
    with pytest.raises(qkv.InputError, match="k not a tensor"):
        api.attention(q, k.numpy(), v)
    with pytest.raises(qkv.InputError, match="kernel"):
        api.attention(q, k, v, kernel="fast")
