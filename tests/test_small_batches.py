"""Large batches of short sequences (issue 42): the native prefill's threads take them from
``router.DENSE_MAX_WORK`` of work, the dense kernel below it, and both equal the reference."""

from __future__ import annotations

import numpy as np
import pytest
from tests.conftest import tol

import qkv
from qkv import reference
from qkv.engine import run
from qkv.engine.kernels import native, router
from qkv.testing.strategies import values
from qkv.validate import make_plan


@pytest.mark.parametrize(
    ("B", "H", "kv", "L", "d"), [(32, 12, 12, 53, 32), (32, 8, 2, 120, 64), (8, 12, 3, 16, 64)]
)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("off", [False, True], ids=["native", "QKV_NATIVE=0"])
def test_batches_of_short_sequences(monkeypatch, B, H, kv, L, d, causal, off):
    monkeypatch.setenv("QKV_NATIVE", "0" if off else "1")
    rng = np.random.default_rng(L)
    q = values(rng, (B, H, L, d)).astype(np.float32)
    k, v = (values(rng, (B, kv, L, d)).astype(np.float32) for _ in range(2))
    work = B * H * L * L * 2 * d
    route = qkv.route(q, k, v, causal=causal)
    if not off and native.available()[0]:  # (unmasked: at any size)
        assert route.kernel == "native prefill, own tiles"  # before the dense kernel
    elif work >= router.DENSE_MAX_WORK and not off and native.available()[0]:
        assert route.kernel == "native prefill"
        assert "native prefill's threads" in dict(route.refused)["dense"]
    else:
        assert route.kernel == "dense"
    want = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), causal=causal)
    got = qkv.attention(q, k, v, causal=causal)
    np.testing.assert_allclose(got, want, **tol("fast path", np.float32))


@pytest.mark.skipif(not native.available()[0], reason="the native prefill is not built here")
@pytest.mark.parametrize("sinks", [False, True])
def test_grouped_heads_share_their_key_tiles(monkeypatch, sinks):
    """Without causal, window or mask, the query heads of a kv head run as one block of
    rows in the native prefill (one product per key tile for the group)."""
    from qkv.engine.kernels import stacked

    monkeypatch.delenv("QKV_NATIVE", raising=False)
    rng = np.random.default_rng(7)
    B, H, kv, L, d = 32, 8, 2, 53, 32
    q = values(rng, (B, H, L, d)).astype(np.float32)
    k, v = (values(rng, (B, kv, L, d)).astype(np.float32) for _ in range(2))
    extra = {"sinks": values(rng, (H,))} if sinks else {}
    seen: list[bool] = []
    real = native.attend
    monkeypatch.setattr(
        native, "attend", lambda p, **kw: seen.append(kw.get("stack", False)) or real(p, **kw)
    )
    got = qkv.attention(q, k, v, **extra)
    assert seen == [True]  # one call, the heads of each kv head stacked
    want = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), **extra)
    np.testing.assert_allclose(got, want, **tol("fast path", np.float32))
    seen.clear()
    run.forget()  # (a set-up kept by an earlier call would skip native.attend)
    qkv.attention(q, k, v, causal=True)  # causal: each head's rows on their own
    assert seen == [False]
    assert not stacked.stacks(make_plan(q, k, v, causal=True))
