"""One options value per call, one kernel decision per plan (issue: one decision per rule)."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest
from tests.conftest import bound, tol

import qkv
from qkv import reference
from qkv.call import build
from qkv.engine.kernels import dense, dispatch, packed, tiled
from qkv.options import NAMES, VARIANTS, Options
from qkv.validate import make_plan


def test_options_are_one_frozen_value_in_the_public_order():
    o = Options(scale=0.5, causal=True, softcap=30.0)
    assert NAMES == ("scale", "causal", "mask", "window", *VARIANTS)
    assert o.keywords() == {"scale": 0.5, "causal": True, "softcap": 30.0}
    assert o.variants() == {"softcap": 30.0}
    assert o.simple is False and Options(scale=2.0, causal=True).simple is True
    assert o.replace(softcap=None).simple is True and o.replace(softcap=None) == Options(0.5, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.causal = False  # type: ignore[misc]
    with pytest.raises(TypeError):
        Options(casual=True)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    "fn", [qkv.attention, qkv.attention_weights, qkv.attention_vjp, qkv.reference.attention]
)
def test_public_signatures_list_the_options_in_one_order(fn):
    params = list(inspect.signature(fn).parameters)
    seen = [n for n in NAMES if n in params]
    assert seen == sorted(seen, key=NAMES.index) and params.index("scale") < params.index("causal")


def test_ring_varlen_and_cache_take_scale_before_causal():
    from qkv.distributed import ring_attention, ring_attention_varlen
    from qkv.engine.cache import KVCache

    for fn in (ring_attention, ring_attention_varlen, qkv.attention_varlen, KVCache.attend):
        params = list(inspect.signature(fn).parameters)
        assert params.index("scale") < params.index("causal") < params.index("window"), fn


def test_the_call_carries_the_options_it_was_built_from():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, 2, 5, 4))
    mask = rng.random((5, 5)) > 0.3
    call = build("attention", q, k, v, scale=0.25, causal=True, mask=mask, window=None, softcap=2.0)
    assert call.options == Options(0.25, True, mask, None, softcap=2.0)
    again = build("attention", q, k, v, call.options)  # the GPU fallback's road: the same call
    np.testing.assert_allclose(
        qkv.engine.run.run("attention", again.plan),
        reference.attention(q, k, v, scale=0.25, causal=True, mask=mask, softcap=2.0),
        **tol("float64 path", np.float64),
    )
    assert build("attention", q, k, v, call.options, causal=False).plan.causal is False


def test_make_plan_takes_the_value_or_its_keywords_alike():
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((3, 4, 6))
    a = make_plan(q, k, v, Options(scale=0.3, causal=True, window=(2, 0)))
    b = make_plan(q, k, v, scale=0.3, causal=True, window=(2, 0))
    assert (a.scale, a.causal, a.window) == (b.scale, b.causal, b.window) == (0.3, True, (2, 0))


def test_choose_returns_the_runner_and_the_sizes_it_chose_by():
    small = make_plan(np.ones((4, 8)), np.ones((4, 8)), np.ones((4, 8)))
    c = dispatch.choose(small)
    assert (c.name, c.run, c.first) == ("dense", dense.attend, dense.attend_plain_finite)
    assert c.kv_bytes == dispatch.kv_bytes(small) == 4 * (8 + 8) * 8 and c.scores == 16
    forced = dispatch.choose(small, "tiled")
    assert (forced.name, forced.run, forced.first) == ("tiled", tiled.attend, None)
    long = make_plan(*np.ones((3, 2, 500, 8)))
    runs = (packed.attend_plan, dispatch.stacked.attend, dispatch.stacked.attend_own)
    assert dispatch.choose(long).run in runs
    big = make_plan(np.ones((1, 8)), np.ones((200_000, 8)), np.ones((200_000, 8)))
    assert (
        dispatch.choose(big).name == "decode" and dispatch.choose(big).kv_bytes == 200_000 * 16 * 8
    )
    with pytest.raises(qkv.InputError, match="kernel"):
        dispatch.choose(small, "fast")


def test_native_decode_support_is_asked_once_per_call(monkeypatch):
    calls = []
    real = dispatch.router.first

    def counted(table, ask):  # the forward table's walks (not the compiled-decode table's)
        if table[-1].name == "tiled":
            calls.append(1)
        return real(table, ask)

    monkeypatch.setattr(dispatch.router, "first", counted)
    q, kv = np.ones((2, 1, 8)), np.ones((2, 100_000, 8))
    out = dispatch.attend(make_plan(q, kv, kv))
    assert len(calls) == 1
    np.testing.assert_allclose(
        out[0], reference.attention(q, kv, kv), **tol("float64 path", np.float64)
    )


def test_attend_many_runs_each_plans_own_choice(monkeypatch):
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 40, 8))  # 40 queries: not decode; 40 x 600 scores: tiled
    kvs = [rng.standard_normal((2, 2, n, 8)) for n in (600, 700)]
    ran = []
    real = packed.attend_plan
    monkeypatch.setattr(packed, "attend_plan", lambda plan: ran.append(1) or real(plan))
    monkeypatch.setenv("QKV_NATIVE", "0")  # the router then refuses the native prefill
    plans = [make_plan(q, k, v) for k, v in kvs]
    outs = dispatch.attend_many(plans)
    assert len(ran) == 2  # the packed walk choose() picked, not the general tiled kernel
    for (o, _), (k, v) in zip(outs, kvs, strict=True):
        np.testing.assert_allclose(o, reference.attention(q, k, v), **tol("fast path", np.float64))


def test_the_torch_ring_refuses_what_the_numpy_ring_refuses():
    torch = pytest.importorskip("torch")
    from qkv.distributed import ring_attention

    q = torch.ones(2, 4, 8)
    with pytest.raises(TypeError, match="mask"):
        ring_attention(q, q, q, mask=None)
    with pytest.raises(TypeError, match="mask"):
        ring_attention(q.numpy(), q.numpy(), q.numpy(), mask=None)
    out = ring_attention(q, q, q, scale=0.5, causal=True)
    np.testing.assert_allclose(
        out.numpy(),
        qkv.attention(q.numpy(), q.numpy(), q.numpy(), scale=0.5, causal=True),
        atol=bound("rule floor", np.float32),
    )
