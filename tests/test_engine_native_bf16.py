"""The native bfloat16 prefill, backward and packed varlen (vdpbf16ps tile products) against
the float64 reference.

Tolerance rule: the kernel computes in float32 from the exact bfloat16 inputs and rounds one
thing, the weights P, to bfloat16 for the second product (as FlashAttention and PyTorch's
bfloat16 kernels do). Each weight's relative error is then at most 2**-9, so the output's error
is at most 2**-9 · max|v|; the bound allows twice that (FlashAttention's suites allow a
low-precision kernel twice the error of a same-precision reference), plus the output's own
rounding to bfloat16 (half a unit, 2**-8 of it). The lse takes no bfloat16 rounding: float32's
bound applies.
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
from qkv.engine.grad import reference_attention_vjp
from qkv.engine.kernels import native_bf16, router
from qkv.validate import make_plan

BF16 = ml_dtypes.bfloat16
pytestmark = pytest.mark.skipif(
    not native_bf16.available(),
    reason="no AVX512_BF16 here, the library is not built, or QKV_NATIVE_ISA forces a clone",
)


def _inputs(rng, B, kv_heads, group, L, S, d, dv, spread=1.0):
    q = rng.standard_normal((B, kv_heads * group, L, d)).astype(BF16)
    k = (rng.standard_normal((B, kv_heads, S, d)) * spread).astype(BF16)
    v = rng.standard_normal((B, kv_heads, S, dv)).astype(BF16)
    return q, k, v


MASKS = ["mask", "bias", "bias with -inf"]
MASK_SHAPES = ["full", "per row", "per key", "strided"]


def _mask(rng, kind, shape, scores):
    """A boolean mask (``kind`` "mask") or a float bias (with -inf entries: "bias with
    -inf") for scores of shape ``(B, H, L, S)``, given whole, per row, per key, or with a key
    stride of 2; None for ``kind`` None."""
    if kind is None:
        return None
    B, H, L, S = scores
    full = {"full": scores, "per row": (L, 1), "per key": (S,), "strided": (B, 1, L, 2 * S)}
    m = rng.random(full[shape]) < 0.7 if kind == "mask" else rng.standard_normal(full[shape]) * 3
    if kind == "bias with -inf":
        m[rng.random(m.shape) < 0.3] = -np.inf
    return m[..., ::2] if shape == "strided" else m


def _check(out, lse, q, k, v, **options):
    want, want_lse = reference.attention(
        *(x.astype(np.float64) for x in (q, k, v)), return_lse=True, **options
    )
    assert out.dtype == BF16 and lse.dtype == np.float32
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=0, atol=_bound(v, want))
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    seen = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[seen], want_lse[seen], **tol("fast path", np.float32))


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 2),
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 3),
    L=st.integers(1, 150),
    S=st.integers(0, 300),
    d=st.sampled_from([2, 8, 64, 128]),
    dv=st.sampled_from([1, 7, 64, 96]),
    causal=st.booleans(),
    window=st.sampled_from([None, (0, 0), (5, 0), (40, 3), (None, 0)]),
    threads=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_equals_the_reference(B, kv_heads, group, L, S, d, dv, causal, window, threads, seed):
    q, k, v = _inputs(np.random.default_rng(seed), B, kv_heads, group, L, S, d, dv, spread=2.0)
    options = dict(causal=causal, window=window)
    plan = make_plan(q, k, v, keep_stored=True, **options)
    assert router.holds(router.BF16, plan)
    out, lse = native_bf16.attend(plan, threads=threads)
    _check(out, lse, q, k, v, **options)


def test_strided_and_broadcast_kv():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((3, 4, 130, 64)).astype(BF16)
    kv = rng.standard_normal((1, 2, 200, 2, 64)).astype(BF16)  # k and v interleaved
    k, v = kv[..., 0, :], kv[..., 1, :]  # row stride 256 elements, batch broadcast
    plan = make_plan(q, k, v, causal=True, keep_stored=True)
    assert router.holds(router.BF16, plan)
    out, lse = native_bf16.attend(plan)
    _check(out, lse, q, np.broadcast_to(k, (3, 2, 200, 64)), np.broadcast_to(v, (3, 2, 200, 64)),
           causal=True)  # fmt: skip


def test_attention_runs_it_and_keeps_the_dtype(monkeypatch):
    calls = []
    run = native_bf16.attend
    monkeypatch.setattr(native_bf16, "attend", lambda plan: calls.append(plan) or run(plan))
    q, k, v = _inputs(np.random.default_rng(0), 1, 2, 2, 300, 300, 64, 64)
    out, lse = qkv.attention(q, k, v, causal=True, return_lse=True)
    assert len(calls) == 1 and out.dtype == BF16 and lse.dtype == np.float32
    want = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), causal=True)
    np.testing.assert_allclose(out.astype(np.float64), want, atol=_bound(v, want))


def _bound(v, want):
    """The kernel's bound plus the output's rounding to bfloat16 (half a unit, 2**-8).

    The module's own rule (its docstring), not a row of the tests' table: it scales with this
    input's max |v| and |out|, and it is tighter for bfloat16 than the library's rule
    (:func:`qkv.testing.tolerance.allowed` allows FLOOR_ULPS = 8 units, 2**-4 of max |v|).
    """
    big = np.abs(v.astype(np.float64)).max(initial=0.0) + np.abs(want).max(initial=0.0)
    return 2.0**-8 * big + 1e-5


def test_a_forced_clone_takes_the_widening_road(monkeypatch):
    q, k, v = _inputs(np.random.default_rng(1), 1, 1, 2, 200, 200, 32, 32)
    fast = qkv.attention(q, k, v, causal=True).astype(np.float64)
    monkeypatch.setenv("QKV_NATIVE_ISA", "avx512")
    assert not native_bf16.available()
    monkeypatch.setattr(native_bf16, "attend", None)  # would raise if called
    slow = qkv.attention(q, k, v, causal=True).astype(np.float64)
    want = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), causal=True)
    assert np.abs(fast - want).max() <= _bound(v, want)
    assert np.abs(slow - want).max() <= 2.0**-8 * np.abs(want).max() + 1e-6


def test_non_finite_inputs_follow_the_float32_rules():
    q, k, v = _inputs(np.random.default_rng(2), 1, 1, 1, 200, 200, 16, 16)
    k[0, 0, 5, 3] = np.inf
    v[0, 0, 7, 0] = np.nan
    out = qkv.attention(q, k, v, causal=True)
    f32 = qkv.attention(*(x.astype(np.float32) for x in (q, k, v)), causal=True)
    np.testing.assert_array_equal(np.isnan(out.astype(np.float32)), np.isnan(f32))


@settings(max_examples=30, deadline=None)
@given(
    B=st.integers(1, 2),
    group=st.integers(1, 2),
    L=st.integers(1, 140),
    S=st.integers(1, 200),
    d=st.sampled_from([2, 64]),
    dv=st.sampled_from([3, 64]),
    kind=st.sampled_from(MASKS),
    shape=st.sampled_from(MASK_SHAPES),
    causal=st.booleans(),
    window=st.sampled_from([None, (20, 0)]),
    seed=st.integers(0, 2**16),
)
def test_masks_and_biases_equal_the_reference(
    B, group, L, S, d, dv, kind, shape, causal, window, seed
):
    """A boolean mask or a float bias, broadcast in each way a caller may give one, with the
    bounds: the bias adds to the scaled score, a hidden key is -inf whatever its bias (rows
    that see no key give 0 and lse -inf, as the reference)."""
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, B, 2, group, L, S, d, dv, spread=2.0)
    options = dict(mask=_mask(rng, kind, shape, (B, 2 * group, L, S)), causal=causal, window=window)
    plan = make_plan(q, k, v, keep_stored=True, **options)
    assert router.holds(router.BF16, plan)
    out, lse = native_bf16.attend(plan, threads=2)
    _check(out, lse, q, k, v, **options)


def test_attention_takes_a_mask_on_the_tile_products(monkeypatch):
    """qkv.attention with a padding mask on bfloat16 runs the bfloat16 kernel (no widening)
    and equals the reference; its gradient takes the float32 backward."""
    rng = np.random.default_rng(8)
    q, k, v = _inputs(rng, 2, 2, 2, 200, 200, 64, 64)
    keep = np.ones((2, 1, 1, 200), dtype=bool)
    keep[0, ..., 150:] = False  # the first sequence is padded
    calls = []
    real = native_bf16.attend
    monkeypatch.setattr(native_bf16, "attend", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out = qkv.attention(q, k, v, mask=keep, causal=True)
    assert calls and out.dtype == BF16
    want = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), mask=keep, causal=True)
    np.testing.assert_allclose(out.astype(np.float64), want, atol=_bound(v, want))


def test_variants_are_not_taken():
    q, k, v = _inputs(np.random.default_rng(4), 1, 1, 1, 64, 64, 16, 16)
    for options in (dict(softcap=5.0), dict(causal=True, alibi_slopes=[0.5])):
        assert not router.holds(router.BF16, make_plan(q, k, v, keep_stored=True, **options))
    assert not router.holds(router.BF16, make_plan(q, k, v.astype(np.float32), keep_stored=True))
    odd = make_plan(q[..., :15], k[..., :15], v, keep_stored=True)
    assert not router.holds(router.BF16, odd)  # an odd head size


def test_training_forward_runs_it_and_the_gradients_hold(monkeypatch):
    torch = pytest.importorskip("torch")
    calls = []
    run = native_bf16.attend
    monkeypatch.setattr(native_bf16, "attend", lambda plan: calls.append(plan) or run(plan))
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 4, 200, 32, generator=g).to(torch.bfloat16) for _ in range(4))
    ours = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = qkv.attention(*ours, causal=True)
    out.backward(dout)
    assert len(calls) == 1 and out.dtype == torch.bfloat16
    exact = [x.double().requires_grad_(True) for x in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*exact, is_causal=True).backward(dout.double())
    theirs = [x.clone().requires_grad_(True) for x in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*theirs, is_causal=True).backward(dout)
    for a, b, want in zip(ours, theirs, exact, strict=True):
        assert a.grad.dtype == torch.bfloat16
        err = (a.grad.double() - want.grad).abs().max().item()
        their_err = (b.grad.double() - want.grad).abs().max().item()
        # the tolerance rule of tests/test_half_precision.py: PyTorch's error plus a rounding
        assert err <= their_err + 2.0**-8 * want.grad.abs().max().item() + 1e-6


@settings(max_examples=30, deadline=None)
@given(
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 3),
    L=st.integers(1, 150),
    S=st.integers(1, 200),
    d=st.sampled_from([2, 16, 64, 96]),
    dv=st.sampled_from([2, 8, 64]),
    causal=st.booleans(),
    window=st.sampled_from([None, (0, 0), (40, 3), (None, 0)]),
    threads=st.integers(1, 3),
    masking=st.sampled_from([None, None, *MASKS]),
    shape=st.sampled_from(MASK_SHAPES),
    seed=st.integers(0, 2**16),
)
def test_backward_equals_the_reference(
    kv_heads, group, L, S, d, dv, causal, window, threads, masking, shape, seed
):
    """The gradients' bound: P, dS and dO are bfloat16 (relative 2**-9 each) in products
    whose terms may cancel, so each gradient element is judged against the sum of its terms'
    sizes (scale·|dS|·|K| for dq, scale·|dS|ᵀ·|Q| for dk, |P|ᵀ·|dO| for dv, with |dS| taken
    before dP − δ cancels): 2**-7 of that, four times the rounding, plus 2**-7 of the largest
    exact gradient."""
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, 1, kv_heads, group, L, S, d, dv, spread=2.0)
    dout = rng.standard_normal((1, kv_heads * group, L, dv)).astype(BF16)
    mask = _mask(rng, masking, shape, (1, kv_heads * group, L, S))
    options = dict(causal=causal, window=window, mask=mask)
    plan = make_plan(q, k, v, keep_stored=True, **options)
    assert router.backward(plan).name == "native bfloat16 backward"
    wide = [x.astype(np.float64) for x in (q, k, v, dout)]
    # the exact forward, in float32: the backward alone is judged (the bfloat16 output's own
    # rounding reaches the gradients through delta; the test against PyTorch above covers it)
    out, lse = (
        x.astype(np.float32) for x in reference.attention(*wide[:3], return_lse=True, **options)
    )
    grads = native_bf16.backward(plan, dout.astype(np.float32), (out, lse), threads=threads)
    sizes = _term_sizes(*wide, group, **options)
    for got, want, size in zip(
        grads, reference_attention_vjp(*wide, **options), sizes, strict=True
    ):
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_array_less(
            np.abs(got - want), 2.0**-7 * (size + np.abs(want).max()) + 1e-6
        )


def _term_sizes(q, k, v, dout, group, **options):
    """The sums of the absolute terms of dq, dk and dv (float64 inputs, K/V with one head per
    ``group`` query heads): the scale the bfloat16 roundings inside each product are
    relative to."""
    kk, vv = (np.repeat(x, group, axis=1) for x in (k, v))
    p = reference.attention_weights(q, kk, **options)
    dp = dout @ np.swapaxes(vv, -1, -2)
    delta = (dp * p).sum(-1, keepdims=True)
    ds = p * (np.abs(dp) + np.abs(delta)) * q.shape[-1] ** -0.5  # dS = P (dP - delta), uncancelled
    dq = ds @ np.abs(kk)
    heads = (q.shape[0], k.shape[1], group)
    dk = (np.swapaxes(ds, -1, -2) @ np.abs(q)).reshape(heads + k.shape[2:]).sum(2)
    dv = (np.swapaxes(p, -1, -2) @ np.abs(dout)).reshape(heads + v.shape[2:]).sum(2)
    return dq, dk, dv


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(0, 90), st.integers(0, 130)), min_size=1, max_size=4),
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 2),
    d=st.sampled_from([2, 16, 64]),
    dv=st.sampled_from([1, 8, 64]),
    causal=st.booleans(),
    window=st.sampled_from([None, (7, 0), (None, 0)]),
    seed=st.integers(0, 2**16),
)
def test_packed_varlen_equals_the_reference(lengths, kv_heads, group, d, dv, causal, window, seed):
    rng = np.random.default_rng(seed)
    cq, ck = (np.concatenate([[0], np.cumsum(n)]) for n in zip(*lengths, strict=True))
    q = rng.standard_normal((cq[-1], kv_heads * group, d)).astype(BF16)
    k = (rng.standard_normal((ck[-1], kv_heads, d)) * 2).astype(BF16)
    v = rng.standard_normal((ck[-1], kv_heads, dv)).astype(BF16)
    assert router.packed(q, k, v, np.dtype(np.float32)).name == "native bfloat16 packed walk"
    options = dict(causal=causal, window=window)
    out, lse = qkv.attention_varlen(q, k, v, cq, ck, return_lse=True, **options)
    assert out.dtype == BF16 and lse.dtype == np.float32
    for b in range(len(lengths)):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        one = [x.transpose(1, 0, 2).astype(np.float64) for x in (q[sq], k[sk], v[sk])]
        if one[0].shape[1] == 0 or one[1].shape[1] == 0:
            assert (out[sq].astype(np.float32) == 0).all()
            continue
        want = reference.attention(*one, **options).transpose(1, 0, 2)
        np.testing.assert_allclose(out[sq].astype(np.float64), want, atol=_bound(v, want))


def test_packed_varlen_redoes_a_sequence_that_is_not_finite():
    rng = np.random.default_rng(5)
    cu = np.array([0, 70, 200])
    q, k, v = (rng.standard_normal((200, 2, 16)).astype(BF16) for _ in range(3))
    k[100, 0, 3] = np.inf
    out = qkv.attention_varlen(q, k, v, cu, cu, causal=True).astype(np.float32)
    wide = qkv.attention_varlen(*(x.astype(np.float32) for x in (q, k, v)), cu, cu, causal=True)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(wide))
    assert np.isfinite(out[:70]).all()
