"""One router decides which kernel runs: its walk names the condition that refused each faster
kernel, and what it picks is what runs (and equals the reference)."""

from __future__ import annotations

import numpy as np
import pytest

from qkv import reference
from qkv.engine.kernels import dispatch, native_decode, router
from qkv.validate import make_plan


def _plan(L, S, d=16, heads=4, kv_heads=2, **options):
    rng = np.random.default_rng(L * 1000 + S)
    q = rng.standard_normal((1, heads, L, d)).astype(np.float32)
    k, v = (rng.standard_normal((1, kv_heads, S, d)).astype(np.float32) for _ in range(2))
    return (q, k, v), make_plan(q, k, v, **options)


CASES = [
    dict(L=1, S=16),  # a small call: the native step (dense without the library)
    dict(L=1, S=20_000),  # a decoding step over a large cache
    dict(L=1, S=20_000, window=(64, 0)),  # a window: not the native step
    dict(L=300, S=300, causal=True),  # prefill
    dict(L=300, S=300, softcap=5.0),  # a score variant: no native prefill
    dict(L=40, S=40, causal=True),  # short causal prompt
]


@pytest.mark.parametrize("case", CASES)
def test_what_the_router_picks_is_what_runs_and_equals_the_reference(case, monkeypatch):
    (q, k, v), plan = _plan(**case)
    said = router.explain(plan)
    chosen, why = said[-1]
    assert why == "" and all(w for _, w in said[:-1])
    choice = dispatch.choose(plan)
    assert choice.kernel == chosen == router.forward(plan).name
    ran = []
    real = choice.run
    monkeypatch.setattr(dispatch, "choose", lambda p, k="auto": choice._replace(
        run=lambda pl: ran.append(1) or real(pl)))  # fmt: skip
    out, _ = dispatch.attend(plan)
    # a shorter road first (a plain dense problem, an unmasked native step) serves it alone
    assert ran == ([] if choice.first is not None else [1])
    options = {n: case[n] for n in ("causal", "window", "softcap") if n in case}
    want = reference.attention(q.astype(float), k.astype(float), v.astype(float), **options)
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)


@pytest.mark.skipif(not native_decode.available(), reason="native kernels not built")
def test_the_walk_names_the_condition_that_refused_each_faster_kernel(monkeypatch):
    _, windowed = _plan(L=1, S=20_000, window=(64, 0))
    refused = dict(router.explain(windowed))
    assert refused["native decode"].startswith("a window given")
    _, variant = _plan(L=300, S=300, softcap=5.0)
    refused = dict(router.explain(variant))
    assert "score variant" in refused["native prefill"]
    assert router.explain(variant)[-1] == ("tiled", "")
    monkeypatch.setenv("QKV_NATIVE", "0")
    _, prefill = _plan(L=300, S=300, causal=True)
    walk = router.explain(prefill)
    assert dict(walk)["native prefill"] == "switched off (QKV_NATIVE=0)"
    assert walk[-1] == ("packed walk", "")


def test_a_forced_kernel_is_a_row_of_the_same_table():
    _, plan = _plan(L=300, S=300, causal=True)
    assert router.explain(plan, "dense") == [("dense (forced)", "")]
    assert dispatch.choose(plan, "decode").kernel == "decode (forced)"


def test_every_row_of_the_forward_table_has_a_runner():
    assert {row.name for row in router.FORWARD} == set(dispatch.RUNNERS)
    for table in (router.FORWARD, router.BACKWARD, router.PACKED, router.DECODE_PLAN):
        assert table[-1].conditions == ()  # the last row takes everything


def test_qkv_route_says_which_kernel_a_call_runs_and_why_not_the_faster_ones():
    import qkv

    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 4, 1, 16)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 20_000, 16)).astype(np.float32) for _ in range(2))
    r = qkv.route(q, k, v, window=(64, 0))
    (_, plan) = _plan(L=1, S=20_000, window=(64, 0))
    assert (r.kernel, r.family) == (dispatch.choose(plan).kernel, dispatch.choose(plan).name)
    assert dict(r.refused)["native decode"].startswith("a window given")
    assert str(r).startswith(f"runs: {r.kernel}")
    assert qkv.route(q, k, v, kernel="tiled").kernel == "tiled (forced)"
    with pytest.raises(qkv.InputError, match="kernel"):
        qkv.route(q, k, v, kernel="fast")
    with pytest.raises(qkv.InputError, match="q, k"):
        qkv.route(q, k[..., :8], v)
