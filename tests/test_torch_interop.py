"""PyTorch tensors through the public API: values, dtypes, gradients, errors.

Values are checked against ``qkv.reference`` (float64) and gradients against PyTorch's own
autograd of ``scaled_dot_product_attention``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tests.conftest import bound, tol

import qkv
from qkv import reference

torch = pytest.importorskip("torch")
F = torch.nn.functional
bias = pytest.importorskip("torch.nn.attention.bias")
hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

SRC = Path(qkv.__file__).resolve().parents[1]
# The seed case "seed-full" (shared/cases/seed_cases.json): d = 4 given, not len(q).
SEED = {
    "q": [2, 1],
    "k": [[1, 0], [3, 2]],
    "v": [[1, 2], [3, 4]],
    "d": 4,
    "scaled_scores": [1, 4],
    "weights": [0.04742587317756679, 0.9525741268224334],
    "output": [2.905148253644867, 3.905148253644867],
}


def rand(*shape, dtype=torch.float64, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed + 7 * len(shape) + sum(shape))
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(grad)


def np64(t):
    return t.detach().double().numpy()


def test_importing_qkv_imports_neither_torch_nor_other_optional_packages():
    code = (
        "import sys, qkv, qkv.plot, qkv.torch_bridge, qkv.integrations.transformers\n"
        "qkv.attention([1.0, 0.0], [[1.0, 0.0]], [[2.0]])\n"
        "bad = [m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules]\n"
        "print(bad)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64, torch.bfloat16])
def test_tensors_in_tensors_out_same_dtype(dtype):
    q, k, v = rand(2, 3, 4, dtype=dtype), rand(2, 5, 4, dtype=dtype), rand(2, 5, 6, dtype=dtype)
    limit = bound("tensor dtypes", dtype)
    args = (np64(q), np64(k))

    out = qkv.attention(q, k, v, causal=True)
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and out.shape == (2, 3, 6)
    expect = reference.attention(*args, np64(v), causal=True)
    np.testing.assert_allclose(np64(out), expect, atol=limit, rtol=limit)

    w = qkv.attention_weights(q, k, window=(1, 1))
    assert isinstance(w, torch.Tensor) and w.dtype == dtype
    np.testing.assert_allclose(
        np64(w), reference.attention_weights(*args, window=(1, 1)), atol=limit
    )

    s = qkv.scores(q, k, scale=0.5)
    assert isinstance(s, torch.Tensor) and s.dtype == dtype
    np.testing.assert_allclose(
        np64(s), reference.scores(*args, scale=0.5), atol=limit * 10, rtol=limit
    )

    p = qkv.softmax(s)
    assert isinstance(p, torch.Tensor) and p.dtype == dtype
    np.testing.assert_allclose(np64(p), reference.softmax(np64(s)), atol=limit)


def test_seed_case_as_tensors():
    q, k, v = (torch.tensor(SEED[n], dtype=torch.float64) for n in "qkv")
    scale = 1 / SEED["d"] ** 0.5
    assert qkv.scores(q, k, scale=scale).tolist() == SEED["scaled_scores"]
    w = qkv.attention_weights(q, k, scale=scale)
    np.testing.assert_allclose(w.numpy(), SEED["weights"], rtol=bound("closed form", np.float64))
    out = qkv.attention(q, k, v, scale=scale)
    assert out.shape == (2,)
    np.testing.assert_allclose(out.numpy(), SEED["output"], rtol=bound("closed form", np.float64))


def test_mask_tensors_bool_and_float_and_return_lse():
    q, k, v = rand(1, 2, 4, 8), rand(1, 2, 6, 8), rand(1, 2, 6, 3)
    keep = torch.rand(1, 1, 4, 6, generator=torch.Generator().manual_seed(1)) > 0.4
    keep[..., 0] = True
    got, lse = qkv.attention(q, k, v, mask=keep, return_lse=True)
    expect, expect_lse = reference.attention(
        np64(q), np64(k), np64(v), mask=keep.numpy(), return_lse=True
    )
    np.testing.assert_allclose(got.numpy(), expect, atol=bound("float64 path", np.float64))
    assert isinstance(lse, torch.Tensor)
    np.testing.assert_allclose(lse.numpy(), expect_lse, atol=bound("float64 path", np.float64))
    additive = torch.zeros(4, 6, dtype=torch.float64).masked_fill(~keep[0, 0], float("-inf"))
    np.testing.assert_allclose(
        qkv.attention(q, k, v, mask=additive).numpy(),
        expect,
        atol=bound("float64 path", np.float64),
    )
    torch_out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    np.testing.assert_allclose(
        got.numpy(), torch_out.numpy(), atol=bound("float64 path", np.float64)
    )


def test_no_grad_result_is_plain_tensor_and_mixed_inputs_work():
    q = rand(3, 4, grad=True)
    k = np.arange(20.0).reshape(5, 4) / 10  # NumPy beside a tensor
    v = [[1.0], [2.0], [3.0], [4.0], [5.0]]  # and a list
    with torch.no_grad():
        out = qkv.attention(q, k, v)
    assert isinstance(out, torch.Tensor) and not out.requires_grad
    out = qkv.attention(q, k, v)
    assert out.requires_grad
    (dq,) = torch.autograd.grad(out.sum(), q)
    expect, _, _ = qkv.attention_vjp(np64(q), k, v, np.ones((3, 1)))
    np.testing.assert_allclose(dq.numpy(), expect, atol=bound("float64 path", np.float64))


def sdpa_grads(q, k, v, g, **kw):
    qs, ks, vs = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qs, ks, vs, **kw)
    return (out, *torch.autograd.grad(out, (qs, ks, vs), g))


def qkv_grads(q, k, v, g, **kw):
    qs, ks, vs = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = qkv.attention(qs, ks, vs, **kw)
    return (out, *torch.autograd.grad(out, (qs, ks, vs), g))


def assert_all_close(got, expect):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expect, strict=True):
        assert a.shape == b.shape, name
        np.testing.assert_allclose(
            a.detach().numpy(), b.detach().numpy(), atol=bound("backward", np.float64), err_msg=name
        )


def test_gradients_equal_torch_causal_lower_right_with_fewer_queries_than_keys():
    L, S = 3, 7
    q, k, v = rand(2, 2, L, 8), rand(2, 2, S, 8), rand(2, 2, S, 5)
    g = rand(2, 2, L, 5, seed=3)
    expect = sdpa_grads(q, k, v, g, attn_mask=bias.causal_lower_right(L, S))
    assert_all_close(qkv_grads(q, k, v, g, causal=True), expect)


def test_gradients_equal_torch_grouped_heads():
    q, k, v = rand(2, 6, 5, 4), rand(2, 2, 5, 4), rand(2, 2, 5, 4)
    g = rand(2, 6, 5, 4, seed=4)
    expect = sdpa_grads(q, k, v, g, is_causal=True, enable_gqa=True, scale=0.3)
    got = qkv_grads(q, k, v, g, causal=True, scale=0.3)
    assert got[2].shape == (2, 2, 5, 4)  # kv gradients keep the kv heads
    assert_all_close(got, expect)


def test_gradients_equal_torch_with_a_float_mask_and_broadcast_batch():
    q, k, v = rand(3, 2, 4, 6), rand(2, 5, 6), rand(2, 5, 6)  # k, v shared across the batch
    extra = rand(4, 5, seed=5)
    g = rand(3, 2, 4, 6, seed=6)
    expect = sdpa_grads(q, k.expand(3, 2, 5, 6), v.expand(3, 2, 5, 6), g, attn_mask=extra)
    got = qkv_grads(q, k, v, g, mask=extra)
    assert got[2].shape == (2, 5, 6)
    np.testing.assert_allclose(
        got[2].numpy(), expect[2].sum(0).numpy(), atol=bound("backward", np.float64)
    )
    np.testing.assert_allclose(
        got[1].numpy(), expect[1].numpy(), atol=bound("backward", np.float64)
    )


def test_gradcheck_finite_differences():
    q, k, v = rand(2, 3, 4, grad=True), rand(2, 5, 4, grad=True), rand(2, 5, 2, grad=True)

    def f(q, k, v):
        return qkv.attention(q, k, v, causal=True, window=(2, None))

    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gradient_dtypes_follow_inputs(dtype):
    q, k, v = (rand(1, 4, 3, 8, dtype=dtype, grad=True) for _ in range(3))
    qkv.attention(q, k, v).float().square().sum().backward()
    assert q.grad.dtype == k.grad.dtype == v.grad.dtype == dtype
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(q64, k64, v64).square().sum().backward()
    np.testing.assert_allclose(np64(q.grad), np64(q64.grad), **tol("autograd in the dtype", dtype))


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(
    L=st.integers(1, 5),
    extra=st.integers(0, 4),
    group=st.sampled_from([1, 2, 3]),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_gradients_equal_torch(L, extra, group, causal, seed):
    S = L + extra
    q, k, v = (
        rand(1, 2 * group, L, 3, seed=seed),
        rand(1, 2, S, 3, seed=seed + 1),
        rand(1, 2, S, 2, seed=seed + 2),
    )
    g = rand(1, 2 * group, L, 2, seed=seed + 3)
    mask = bias.causal_lower_right(L, S) if causal else None
    expect = sdpa_grads(q, k, v, g, attn_mask=mask, enable_gqa=group > 1)
    assert_all_close(qkv_grads(q, k, v, g, causal=causal), expect)


def test_tensors_not_on_the_cpu_are_refused_clearly():
    q = torch.empty(2, 4, device="meta")
    with pytest.raises(qkv.InputError, match=r"q: tensors on device meta.*\(2, 4\).*\.cpu\(\)"):
        qkv.attention(q, torch.ones(3, 4), torch.ones(3, 2))
    with pytest.raises(qkv.InputError, match="k: tensors on device meta"):
        qkv.scores(torch.ones(2, 4), torch.empty(3, 4, device="meta"))


def test_bad_tensor_input_raises_input_error_naming_shapes():
    with pytest.raises(qkv.InputError, match=r"q, k: feature size d differs.*\(2, 4\)"):
        qkv.attention(torch.ones(2, 4), torch.ones(3, 5), torch.ones(3, 2))
    with pytest.raises(qkv.InputError, match="mask: shape"):
        qkv.attention(torch.ones(2, 4), torch.ones(3, 4), torch.ones(3, 2), mask=torch.ones(5, 5))
    with pytest.raises(qkv.InputError, match="mask: qkv gives no gradient"):
        qkv.attention(rand(2, 4, grad=True), rand(3, 4), rand(3, 2), mask=rand(2, 3, grad=True))


def _lse(qs, ks):
    """The log-sum-exp of the reference scores of (heads, L, d) against (heads, S, d)."""
    s = reference.scores(qs.double().numpy(), ks.double().numpy())
    m = s.max(-1, keepdims=True)
    return m[..., 0] + np.log(np.exp(s - m).sum(-1))


def test_varlen_and_cache_give_the_lse_in_float32_for_bfloat16():
    # the lse is documented in the accumulation dtype: bfloat16 would round it to |lse|·2⁻⁹
    g = torch.Generator().manual_seed(0)
    q, k, v = (3 * torch.randn(12, 2, 8, generator=g, dtype=torch.bfloat16) for _ in range(3))
    cu = [0, 5, 12]
    out, lse = qkv.attention_varlen(q, k, v, cu, cu, return_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    want = [_lse(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1)) for a, b in ((0, 5), (5, 12))]
    np.testing.assert_allclose(
        lse.numpy(), np.concatenate(want, 1).T, **tol("float32 lse", np.float32)
    )
    cache = qkv.KVCache(1, 2, 8)
    cache.append(k.transpose(0, 1)[None], v.transpose(0, 1)[None])
    out, lse = cache.attend(q[-1:].transpose(0, 1)[None], return_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    want = _lse(q[-1:].transpose(0, 1), k.transpose(0, 1))  # the last query sees every key
    np.testing.assert_allclose(lse[0].numpy(), want, **tol("float32 lse", np.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_cache_decoding_loop_on_tensors(dtype):
    """A decoding loop's tensors through KVCache (one token appended and one query attended
    per step): tensors of the query's dtype back, the float64 reference's values, the same
    bits as the arrays' loop; a tensor that requires grad is refused by name (with gradients
    enabled) or read detached (under no_grad); a tensor beside an array is read too."""
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, 2, 12, 8, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(12, 1, 4, 1, 8, generator=g).to(dtype)
    tensors, arrays = qkv.KVCache(1, 2, 8), qkv.KVCache(1, 2, 8)
    for t in range(12):
        tensors.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        arrays.append(k[:, :, t : t + 1].numpy(), v[:, :, t : t + 1].numpy())
        out = tensors.attend(q[t])
        assert isinstance(out, torch.Tensor) and out.shape == (1, 4, 1, 8)
        np.testing.assert_array_equal(out.numpy(), arrays.attend(q[t].numpy()))
        wide = [x.double().numpy() for x in (q[t], k[:, :, : t + 1], v[:, :, : t + 1])]
        kind = "fast path" if dtype != torch.float16 else "half precision"
        np.testing.assert_allclose(
            out.double().numpy(), reference.attention(*wide), **tol(kind, np.dtype(str(dtype)[6:]))
        )
    grad = k[:, :, :1].clone().requires_grad_()
    with pytest.raises(qkv.InputError, match="^k: requires grad"):
        tensors.append(grad, v[:, :, :1])
    with pytest.raises(qkv.InputError, match="^q: requires grad"):
        tensors.attend(q[0].clone().requires_grad_())
    with torch.no_grad():
        got = tensors.attend(q[0].clone().requires_grad_())
    np.testing.assert_array_equal(got.numpy(), tensors.attend(q[0]).numpy())
    tensors.append(k[:, :, :1], v[:, :, :1].numpy())  # a tensor beside an array
    assert tensors.lengths.tolist() == [13]


FLOAT8 = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


@pytest.mark.parametrize("dtype", FLOAT8)
@pytest.mark.parametrize(
    "call, name",
    [
        (lambda x, y: qkv.attention(x, y, y), "q"),
        (lambda x, y: qkv.attention(y, x, y), "k"),
        (lambda x, y: qkv.attention(y, y, y, mask=x[0, :, :3]), "mask"),
        (lambda x, y: qkv.attention_varlen(x[0], y[0], y[0], [0, 3], [0, 3]), "q"),
        (lambda x, y: qkv.attention_vjp(y, y, x, y), "v"),
        (lambda x, y: qkv.merge([(x, y[..., 0])]), "parts[0] out"),
        (lambda x, y: qkv.attention(x.to("meta"), y.to("meta"), y.to("meta")), "q"),
    ],
)
def test_float8_tensors_are_refused_by_name(dtype, call, name):
    # they used to come back as float32 without a word, though results keep the caller's dtype
    y = torch.randn(2, 3, 4)
    x = y.to(dtype)
    with pytest.raises(qkv.InputTypeError) as info:
        call(x, y)
    text = str(info.value)
    assert text.startswith(f"{name}: float8 tensors") and str(dtype) in text
    assert "float16, bfloat16, float32 and float64" in text
