"""A copy of a KVCache is independent of its original, and no lengths can make the native
decode step read outside its buffers (issue: a shallow copy shared the lengths array, its
growth left the original claiming rows its buffers do not have, and the step read past them)."""

from __future__ import annotations

import copy
import pickle
import warnings

import numpy as np
import pytest

import qkv
from qkv import reference
from qkv.engine import cache as cache_module
from qkv.engine.kernels import native_decode, native_lib

native = pytest.mark.skipif(
    not native_decode.available(), reason="native kernels not built (or QKV_NATIVE=0)"
)
FORMS = ["float32", "float64", "float16", "bfloat16", "int8", "float8_e4m3fn"]


def _reference(cache, q):
    """The float64 reference per sequence on what the cache holds (its stored values)."""
    out = np.zeros(q.shape[:-1] + (cache.value_dim,))
    for b, n in enumerate(cache.lengths.tolist()):
        if n:
            k, v = (x.astype(np.float64) for x in (cache.keys(b), cache.values(b)))
            out[b] = reference.attention(q[b].astype(np.float64), k, v, causal=True)
    return out


def _close(got, want, form):
    tol = 1e-10 if form == "float64" else 2e-5
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_a_copy_shares_nothing_with_its_original(form, how):
    rng = np.random.default_rng(7)
    cache = qkv.KVCache(2, 2, 8, dtype=form)
    k = rng.standard_normal((2, 2, 12, 8)).astype(np.float32)
    cache.append(k, k)
    q = rng.standard_normal((2, 4, 1, 8)).astype(np.float32)
    before = cache.attend(q)  # plans and keeps a native step where one serves
    lengths, capacity = cache.lengths.tolist(), cache.capacity
    twin = {
        "copy": copy.copy,
        "deepcopy": copy.deepcopy,
        "pickle": lambda c: pickle.loads(pickle.dumps(c)),
    }[how](cache)
    for _ in range(3):  # the twin grows its buffers twice over (16 -> 32 -> 64 rows)
        big = rng.standard_normal((2, 2, 20, 8)).astype(np.float32)
        twin.append(big, big)
    assert cache.lengths.tolist() == lengths and cache.capacity == capacity
    assert twin.lengths.tolist() == [72, 72] and twin.capacity >= 72
    again = cache.attend(q)  # the kept step, on the original's own buffers and lengths
    np.testing.assert_array_equal(again, before)
    _close(again, _reference(cache, q), form)
    _close(twin.attend(q), _reference(twin, q), form)
    # and the other way round: the original's appends leave the twin as it was
    cache.append(k[0, :, :1], k[0, :, :1], seq=0)
    assert twin.lengths.tolist() == [72, 72]
    _close(twin.attend(q), _reference(twin, q), form)
    assert type(twin) is type(cache)


def test_a_copy_of_the_public_cache_is_one_too():
    import torch

    cache = qkv.KVCache(1, 1, 4)
    cache.append(np.ones((1, 1, 3, 4)), np.ones((1, 1, 3, 4)))
    twin = copy.copy(cache)
    assert type(twin) is qkv.KVCache
    twin.append(np.ones((1, 1, 30, 4)), np.ones((1, 1, 30, 4)))
    assert cache.lengths.tolist() == [3] and twin.lengths.tolist() == [33]
    out = twin.attend(torch.ones(1, 2, 1, 4))  # a tensor in, a tensor out
    assert isinstance(out, torch.Tensor)
    np.testing.assert_allclose(out.numpy(), np.ones((1, 2, 1, 4)), rtol=1e-6)


@native
@pytest.mark.parametrize("isa", list(native_lib.ISAS))
@pytest.mark.parametrize("form", ["float32", "int8"])
@pytest.mark.parametrize("lo, hi", [([0, 0], [16, 17]), ([0, 0], [4000, 3]), ([-1, 0], [3, 3]),
                                    ([5, 0], [4, 3])])  # fmt: skip
def test_the_decode_step_refuses_runs_outside_its_buffers(isa, form, lo, hi):
    rng = np.random.default_rng(3)
    cache = qkv.KVCache(2, 1, 8, dtype=form)
    k = rng.standard_normal((2, 1, 16, 8)).astype(np.float32)
    cache.append(k, k)
    assert cache.capacity == 16
    q = rng.standard_normal((2, 2, 1, 8)).astype(np.float32)
    step = native_decode.prepare(
        q, cache._k, cache._v, 0.35, np.array(lo), np.array(hi), isa=native_lib.ISAS[isa],
        kv_format=None if form == "float32" else form, k_scale=cache._ks, v_scale=cache._vs,
    )  # fmt: skip
    assert step is not None
    with pytest.raises(qkv.InputError, match=r"lengths: .*outside its K/V buffers of 16 rows"):
        step.run(q)
    # the same step with runs inside the buffers equals the reference
    inside = native_decode.prepare(
        q, cache._k, cache._v, 0.35, np.array([0, 2]), np.array([16, 9]),
        isa=native_lib.ISAS[isa],
        kv_format=None if form == "float32" else form, k_scale=cache._ks, v_scale=cache._vs,
    )  # fmt: skip
    out, _ = inside.run(q)
    for b, (a, z) in enumerate([(0, 16), (2, 9)]):
        keys = cache.keys(b)[:, a:z].astype(np.float64)
        vals = cache.values(b)[:, a:z].astype(np.float64)
        want = reference.attention(q[b].astype(np.float64), keys, vals, scale=0.35)
        np.testing.assert_allclose(out[b], want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("form", FORMS)
def test_the_general_road_reads_only_written_rows(form, monkeypatch):
    """Ragged lengths: the general road reads every sequence up to the longest. Rows a
    sequence never wrote must not be garbage: here every fresh buffer is filled with
    signalling NaNs where it is not explicitly zeroed, and a float64 call (which widens the
    stored values) must neither warn nor differ from the reference."""
    snan = {2: (np.uint16, 0x7D00), 4: (np.uint32, 0x7FA00000), 8: (np.uint64, 0x7FF4 << 48)}

    def poisoned(shape, dtype=float, **kw):
        a = np.zeros(shape, dtype, **kw)
        if a.dtype.kind == "f":
            bits, pattern = snan[a.dtype.itemsize]
            a.view(bits).fill(pattern)  # a signalling NaN of a's own width
        elif a.size:
            a.view(np.uint8).fill(0xFF)
        return a

    rng = np.random.default_rng(5)
    cache = qkv.KVCache(3, 1, 4, dtype=form)
    monkeypatch.setattr(cache_module.np, "empty", poisoned, raising=True)
    try:
        for b, n in enumerate([2, 19, 5]):
            k = rng.standard_normal((1, n, 4))
            cache.append(k, k, seq=b)
    finally:
        monkeypatch.undo()
    q = rng.standard_normal((3, 2, 2, 4))  # float64, two rows: the general road
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = cache.attend(q, causal=False)
    want = np.stack([
        reference.attention(q[b], cache.keys(b).astype(np.float64),
                            cache.values(b).astype(np.float64))
        for b in range(3)
    ])  # fmt: skip
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
