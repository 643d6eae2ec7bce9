"""KVCache: ragged lengths, mixed appends, decode token by token == causal prefill, GQA."""

from __future__ import annotations

import numpy as np
import pytest
from tests.conftest import tol

import qkv
from qkv import reference


def test_token_by_token_decode_equals_causal_prefill_with_gqa():
    rng = np.random.default_rng(0)
    B, H, Hkv, N, d, dv = 2, 4, 2, 37, 8, 5
    q = rng.standard_normal((B, H, N, d))
    k, v = rng.standard_normal((B, Hkv, N, d)), rng.standard_normal((B, Hkv, N, dv))
    cache = qkv.KVCache(B, Hkv, d, value_dim=dv, dtype=np.float64)
    steps = []
    for t in range(N):
        cache.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        steps.append(cache.attend(q[:, :, t : t + 1]))
    got = np.concatenate(steps, axis=2)
    np.testing.assert_allclose(got, reference.attention(q, k, v, causal=True), atol=1e-12)
    assert cache.lengths.tolist() == [N, N]


def test_chunked_prefill_then_decode_with_window_equals_reference():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, 30, 4)) for _ in range(3))
    cache = qkv.KVCache(1, 2, 4, dtype=np.float64)
    outs, start = [], 0
    for T in (7, 1, 11, 1, 1, 9):
        cache.append(k[:, :, start : start + T], v[:, :, start : start + T])
        outs.append(cache.attend(q[:, :, start : start + T], window=(5, None)))
        start += T
    want = reference.attention(q, k, v, causal=True, window=(5, None))
    np.testing.assert_allclose(np.concatenate(outs, axis=2), want, atol=1e-12)


def test_ragged_lengths_with_mixed_single_and_batch_appends():
    rng = np.random.default_rng(2)
    B, Hkv, H, d = 3, 1, 3, 6
    cache = qkv.KVCache(B, Hkv, d, dtype=np.float64)
    keys = [np.zeros((Hkv, 0, d)) for _ in range(B)]
    vals = [np.zeros((Hkv, 0, d)) for _ in range(B)]

    def add(b, T):
        k, v = rng.standard_normal((Hkv, T, d)), rng.standard_normal((Hkv, T, d))
        keys[b] = np.concatenate([keys[b], k], axis=1)
        vals[b] = np.concatenate([vals[b], v], axis=1)
        return k, v

    for b, T in ((0, 5), (2, 1), (0, 3), (1, 20)):
        cache.append(*add(b, T), seq=b)
    kb, vb = zip(*(add(b, 2) for b in range(B)), strict=True)
    cache.append(np.stack(kb), np.stack(vb))  # every sequence, each after its own end
    cache.append(*add(2, 40), seq=2)  # forces growth past the others
    assert cache.lengths.tolist() == [10, 22, 43]
    for b in range(B):
        np.testing.assert_array_equal(cache.keys(b), keys[b])
        np.testing.assert_array_equal(cache.values(b), vals[b])
    for Lq in (1, 2, 4):
        q = rng.standard_normal((B, H, Lq, d))
        out, lse = cache.attend(q, return_lse=True)
        for b in range(B):
            ref_out, ref_lse = reference.attention(
                q[b], keys[b], vals[b], causal=True, return_lse=True
            )
            np.testing.assert_allclose(out[b], ref_out, atol=1e-12)
            np.testing.assert_allclose(lse[b], ref_lse, atol=1e-12)


def test_empty_sequence_and_more_queries_than_tokens():
    cache = qkv.KVCache(2, 1, 2, dtype=np.float64)
    cache.append(np.array([[[1.0, 0.0], [0.0, 1.0]]]), np.array([[[1.0, 2.0], [3.0, 4.0]]]), seq=1)
    q = np.ones((2, 1, 3, 2))
    out = cache.attend(q)
    assert np.all(out[0] == 0)  # sequence 0 holds nothing
    # 3 queries, 2 tokens: the first query sits before the sequence and sees nothing
    np.testing.assert_allclose(
        out[1, 0], reference.attention(q[1, 0], [[1, 0], [0, 1]], [[1, 2], [3, 4]], causal=True)
    )
    assert np.all(out[1, 0, 0] == 0)


def test_not_causal_scale_and_kernels_agree():
    rng = np.random.default_rng(3)
    cache = qkv.KVCache(2, 2, 4, dtype=np.float64)
    k, v = rng.standard_normal((2, 2, 50, 4)), rng.standard_normal((2, 2, 50, 4))
    cache.append(k, v)
    q = rng.standard_normal((2, 2, 3, 4))
    want = reference.attention(q, k, v, scale=0.3)
    for kernel in ("auto", "dense", "tiled", "decode"):
        got = cache.attend(q, causal=False, scale=0.3, kernel=kernel)
        np.testing.assert_allclose(got, want, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_storage_dtypes(dtype):
    rng = np.random.default_rng(4)
    k, v, q = (rng.standard_normal((1, 2, 9, 4)) for _ in range(3))
    cache = qkv.KVCache(1, 2, 4, dtype=dtype)
    cache.append(k, v)
    out = cache.attend(q.astype(dtype))
    assert out.dtype == dtype and cache.keys(0).dtype == dtype
    want = reference.attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), causal=True)
    np.testing.assert_allclose(out.astype(float), want, atol=3e-3 if dtype == np.float16 else 1e-5)


def test_growth_is_amortised_doubling():
    cache = qkv.KVCache(1, 1, 2)
    buffers, caps = set(), []
    for t in range(1000):
        cache.append(np.full((1, 1, 1, 2), t), np.full((1, 1, 1, 2), t))
        buffers.add(id(cache._k))
        caps.append(cache.capacity)
    assert len(set(caps)) <= 8  # 16, 32, ..., 1024: a reallocation only on each doubling
    assert 1000 <= cache.capacity < 2 * 1000
    np.testing.assert_array_equal(cache.keys(0)[0, :, 0], np.arange(1000))


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda c: c.append(np.ones((2, 2, 1, 4)), np.ones((2, 2, 1, 4))),
            r"k: expected shape \(3, 2",
        ),
        (
            lambda c: c.append(np.ones((3, 2, 1, 5)), np.ones((3, 2, 1, 4))),
            r"head_dim=4.*\(3, 2, 1, 5\)",
        ),
        (lambda c: c.append(np.ones((3, 2, 1, 4)), np.ones((3, 2, 1, 3))), r"v: .*value_dim=4"),
        (lambda c: c.append(np.ones((3, 2, 2, 4)), np.ones((3, 2, 1, 4))), "token counts"),
        (lambda c: c.append(np.ones((3, 2, 0, 4)), np.ones((3, 2, 0, 4))), "T >= 1"),
        (
            lambda c: c.append(np.ones((2, 1, 4)), np.ones((2, 1, 4)), seq=3),
            "seq: 3 is out of range",
        ),
        (lambda c: c.append(np.ones((3, 2, 1, 4)), np.ones((3, 2, 1, 4)), seq=0), r"seq=0"),
        (lambda c: c.attend(np.ones((3, 2, 1, 3))), r"q: expected shape \(batch=3"),
        (lambda c: c.attend(np.ones((3, 3, 1, 4))), "3 query heads cannot share 2 kv heads"),
        (lambda c: c.attend(np.ones((3, 2, 1, 4)), kernel="x"), "kernel"),
        (lambda c: c.attend(np.ones((3, 2, 1, 4)), scale=-1.0), "scale"),
    ],
)
def test_bad_arguments_raise_input_error(call, match):
    cache = qkv.KVCache(3, 2, 4)
    with pytest.raises(qkv.InputError, match=match):
        call(cache)


def test_bad_construction_and_types():
    with pytest.raises(qkv.InputTypeError, match="dtype"):
        qkv.KVCache(1, 1, 2, dtype=np.int32)
    with pytest.raises(qkv.InputError, match="kv_heads"):
        qkv.KVCache(1, 0, 2)
    with pytest.raises(qkv.InputTypeError, match="batch"):
        qkv.KVCache(1.5, 1, 2)
    cache = qkv.KVCache(2, 1, 2)
    with pytest.raises(qkv.InputTypeError, match="seq"):
        cache.append(np.ones((1, 1, 2)), np.ones((1, 1, 2)), seq=True)
    with pytest.raises(qkv.InputTypeError, match="k"):
        cache.append(np.array([[["a", "b"]]]), np.ones((1, 1, 2)), seq=0)
    assert "lengths=[0, 0]" in repr(cache)


def test_runs_of_equal_lengths_in_a_ragged_batch():
    rng = np.random.default_rng(5)
    lengths = [4, 4, 9, 9, 9, 2]
    cache = qkv.KVCache(len(lengths), 1, 3, dtype=np.float64)
    kv = [(rng.standard_normal((1, n, 3)), rng.standard_normal((1, n, 3))) for n in lengths]
    for b, (k, v) in enumerate(kv):
        cache.append(k, v, seq=b)
    q = rng.standard_normal((len(lengths), 2, 2, 3))
    out = cache.attend(q, window=(2, None))
    for b, (k, v) in enumerate(kv):
        want = reference.attention(q[b], k, v, causal=True, window=(2, None))
        np.testing.assert_allclose(out[b], want, atol=1e-12)


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize(
    ("Lq", "options"),
    [
        (1, {}),
        (1, {"window": (8, 0)}),
        (1, {"softcap": 30.0}),
        (3, {"causal": True}),
        (3, {"causal": False}),
    ],
)
def test_one_make_plan_per_attend_call(monkeypatch, native, Lq, options):
    """A call's checks run once: the native step's plan on stand-ins serves the general road
    too where the buffers hold the compute dtype (issue 41: one make_plan per call)."""
    import qkv.engine.cache as cache_module
    import qkv.engine.decoding as decoding_module

    monkeypatch.setenv("QKV_NATIVE", native)
    calls = []
    real = cache_module.make_plan

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    for module in (cache_module, decoding_module):
        if hasattr(module, "make_plan"):
            monkeypatch.setattr(module, "make_plan", spy)
    rng = np.random.default_rng(Lq)
    kc = qkv.KVCache(batch=2, kv_heads=2, head_dim=16)
    k, v = (rng.standard_normal((2, 2, 40, 16)).astype(np.float32) for _ in range(2))
    kc.append(k, v)
    q = rng.standard_normal((2, 4, Lq, 16)).astype(np.float32)
    calls.clear()
    out = kc.attend(q, **options)
    assert len(calls) <= 1
    want = reference.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                               **options)  # fmt: skip
    np.testing.assert_allclose(out, want, **tol("fast path", np.float32))
