"""KVCache.attend runs its planned native step again for calls that differ only in q's values
and the lengths: every such call equals the float64 reference on the cache's current contents
(and the checked road's bits), and any other call takes the checked road."""

from __future__ import annotations

import copy
import gc
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.conftest import bound

import qkv
from qkv import reference
from qkv.engine import cache as cache_module
from qkv.engine.kernels import native_decode

native = pytest.mark.skipif(
    not native_decode.available(), reason="native kernels not built (or QKV_NATIVE=0)"
)
FORMS = ["float32", "float64", "float16", "bfloat16", "int8", "float8_e4m3fn"]


def _reference(cache, q, **kw):
    """The float64 reference per sequence on what the cache holds now (stored values)."""
    out = np.zeros(q.shape[:-1] + (cache.value_dim,))
    for b, n in enumerate(cache.lengths.tolist()):
        if n:
            k, v = (x.astype(np.float64) for x in (cache.keys(b), cache.values(b)))
            out[b] = reference.attention(q[b].astype(np.float64), k, v, **kw)
    return out


def _checked(cache, q, **kw):
    """The same call on a copy of the cache, which has no planned step (the checked road)."""
    return copy.deepcopy(cache).attend(q, **kw)


def _filled(rng, batch, kv_heads, d, n, form="float32"):
    """A cache of ``n`` random tokens per sequence."""
    cache = qkv.KVCache(batch, kv_heads, d, dtype=form)
    k = rng.standard_normal((batch, kv_heads, n, d)).astype(np.float32)
    cache.append(k, k)
    return cache, k


def _count_checks(monkeypatch):
    calls = []
    make_plan = cache_module.make_plan
    monkeypatch.setattr(
        cache_module, "make_plan", lambda *a, **kw: calls.append(1) or make_plan(*a, **kw)
    )
    return calls


@native
@settings(max_examples=25, deadline=None)
@given(
    form=st.sampled_from(FORMS),
    group=st.sampled_from([1, 4]),
    appends=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 40)), min_size=1, max_size=6
    ),  # (sequence or 3 for all, tokens): crosses the capacity (16, 32, 64, ...) as it grows
    seed=st.integers(0, 2**16),
)
def test_planned_step_follows_appends_and_growth(form, group, appends, seed):
    rng = np.random.default_rng(seed)
    B, hkv, d = 3, 2, 16
    cache = qkv.KVCache(B, hkv, d, dtype=form)
    first = rng.standard_normal((B, hkv, 1, d)).astype(np.float32)
    cache.append(first, first)
    qdt = np.float64 if form == "float64" else np.float32
    limit = bound("decoding", qdt)
    for seq, T in appends:
        k, v = (rng.standard_normal((B, hkv, T, d)).astype(np.float32) for _ in range(2))
        if seq == 3:
            cache.append(k, v)
        else:
            cache.append(k[seq], v[seq], seq=seq)
        for _ in range(2):  # the second call runs the planned step
            q = rng.standard_normal((B, hkv * group, 1, d)).astype(qdt)
            out, lse = cache.attend(q, return_lse=True)
            assert out.dtype == qdt and lse.shape == (B, hkv * group, 1)
            np.testing.assert_allclose(out, _reference(cache, q), atol=limit, rtol=limit)
            want, want_lse = _checked(cache, q, return_lse=True)
            np.testing.assert_array_equal(out, want)
            np.testing.assert_array_equal(lse, want_lse)


@native
def test_repeated_calls_skip_the_checks_and_changed_calls_take_them(monkeypatch):
    rng = np.random.default_rng(0)
    cache, k = _filled(rng, 2, 2, 32, 50, "bfloat16")
    cache.append(k[:, :, :1], k[:, :, :1])  # the buffers grow to 100 tokens
    q = rng.standard_normal((2, 4, 1, 32)).astype(np.float32)
    checks = _count_checks(monkeypatch)
    for _ in range(3):
        cache.attend(q)
    assert len(checks) == 1  # planned by the first call, run again by the others
    cache.append(k[:, :, :1], k[:, :, :1])
    out = cache.attend(q)
    assert len(checks) == 1  # a longer cache in the same buffers: the same plan
    np.testing.assert_allclose(out, _reference(cache, q), atol=bound("decoding", np.float32))
    for kw in ({"scale": 0.5}, {"causal": False}, {"kernel": "decode"}):
        before = len(checks)
        got = cache.attend(q, **kw)
        assert len(checks) == before + 1  # another key: checked (and planned in its turn)
        np.testing.assert_allclose(
            got, _reference(cache, q, scale=kw.get("scale")), atol=bound("decoding", np.float32)
        )
    cache.attend(q)
    before = len(checks)
    got, lse = cache.attend(q, return_lse=True)
    assert len(checks) == before  # return_lse only chooses what comes back
    np.testing.assert_array_equal(got, out)
    # another dtype, layout or shape of q, a window, a variant: each checked
    calls = [(q.astype(np.float64), {}), (np.asfortranarray(q), {}), (q[:, :2], {})]
    calls += [(q, {"window": (8, None)}), (q, {"softcap": 30.0})]
    for other, kw in calls:
        before = len(checks)
        got = cache.attend(other, **kw)
        assert len(checks) > before
        np.testing.assert_allclose(
            got, _reference(cache, other, **kw), atol=bound("decoding", np.float32)
        )


@native
def test_a_planned_cache_still_refuses_bad_calls_by_name():
    rng = np.random.default_rng(1)
    cache, _ = _filled(rng, 1, 2, 8, 20)
    q = rng.standard_normal((1, 2, 1, 8)).astype(np.float32)
    cache.attend(q, scale=0.25)
    with pytest.raises(qkv.InputError, match="scale"):
        cache.attend(q, scale=-0.25)
    with pytest.raises(qkv.InputError, match="kernel"):
        cache.attend(q, scale=0.25, kernel="fastest")
    with pytest.raises(qkv.InputError, match=r"q: expected shape"):
        cache.attend(q[:, :, :, :4], scale=0.25)
    with pytest.raises(TypeError, match="return_lse"):
        cache.attend(q, scale=0.25, return_lse=1)


@native
def test_non_finite_queries_after_planning_follow_the_checked_road():
    rng = np.random.default_rng(2)
    cache, _ = _filled(rng, 2, 1, 8, 12)
    q = rng.standard_normal((2, 1, 1, 8)).astype(np.float32)
    cache.attend(q)
    q[1, 0, 0, 3] = np.nan
    out = cache.attend(q)
    np.testing.assert_array_equal(out, _checked(cache, q))  # the planned step declines it
    assert np.all(np.isnan(out[1])) and np.all(np.isfinite(out[0]))


@native
def test_switching_native_off_after_planning_is_obeyed(monkeypatch):
    rng = np.random.default_rng(3)
    cache, _ = _filled(rng, 1, 2, 16, 30)
    q = rng.standard_normal((1, 2, 1, 16)).astype(np.float32)
    cache.attend(q)
    launches = []
    run = native_decode.Template.run  # a planned step's one native call
    monkeypatch.setattr(
        native_decode.Template, "run", lambda *a, **kw: launches.append(1) or run(*a, **kw)
    )
    monkeypatch.setenv("QKV_NATIVE", "0")
    out = cache.attend(q)
    assert launches == []
    np.testing.assert_allclose(out, _reference(cache, q), atol=bound("decoding", np.float32))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_a_planned_cache_reads_its_own_buffers(how):
    rng = np.random.default_rng(4)
    cache, k = _filled(rng, 2, 2, 16, 40, "int8")
    q = rng.standard_normal((2, 2, 1, 16)).astype(np.float32)
    want = cache.attend(q)
    twin = copy.deepcopy(cache) if how == "deepcopy" else pickle.loads(pickle.dumps(cache))
    del cache
    gc.collect()
    np.testing.assert_array_equal(twin.attend(q), want)
    twin.append(k[:, :, :3], k[:, :, :3])
    np.testing.assert_allclose(
        twin.attend(q), _reference(twin, q), atol=bound("decoding", np.float32)
    )


@native
def test_torch_queries_run_the_planned_step_and_come_back_as_tensors(monkeypatch):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    cache, _ = _filled(rng, 2, 2, 16, 30, "bfloat16")
    q = torch.from_numpy(rng.standard_normal((2, 4, 1, 16)).astype(np.float32))
    checks = _count_checks(monkeypatch)
    first = cache.attend(q)
    out, lse = cache.attend(q, return_lse=True)
    assert len(checks) == 1  # the second call ran the planned step
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    assert isinstance(lse, torch.Tensor)
    assert torch.equal(out, first)
    np.testing.assert_allclose(
        out.numpy(), _reference(cache, q.numpy()), atol=bound("decoding", np.float32)
    )
    with pytest.raises(qkv.InputError, match="q"):
        cache.attend(q.requires_grad_())
