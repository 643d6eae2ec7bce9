"""Attention variants: softcap, sinks, ALiBi, score_mod and mask_mod.

The reference is checked against a literal float64 implementation written here (one query and
one key at a time); every kernel, the VJPs, merge and the KV cache against the reference;
gradients against central finite differences; block-mask skipping by counting the tiles the
tiled kernel computes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.conftest import bound, tol

import qkv
from qkv import reference
from qkv.engine.grad import reference_attention_vjp
from qkv.engine.kernels import dispatch, mods, tiled
from qkv.validate import make_plan
from qkv.variants import and_masks, causal, document, or_masks, prefix_lm, sliding_window

RNG = np.random.default_rng(13)
TOL = tol("variants")  # a fast path against the float64 reference on the same inputs


def literal(
    q,
    k,
    v,
    *,
    scale,
    causal=False,
    softcap=None,
    sinks=None,
    alibi=None,
    score_mod=None,
    mask_mod=None,
):
    """Attention of ``q (H, L, d)`` over ``k, v (H, S, ·)``, one score at a time, in float64.

    Returns the output and the lse (the sink included)."""
    H, L, _ = q.shape
    S = k.shape[1]
    out = np.zeros((H, L, v.shape[-1]))
    lse = np.zeros((H, L))
    for h in range(H):
        for i in range(L):
            p = S - L + i
            logits, values = [], []
            for j in range(S):
                s = float(np.dot(q[h, i], k[h, j])) * scale
                if softcap is not None:
                    s = softcap * math.tanh(s / softcap)
                if alibi is not None and j <= p:
                    s -= alibi[h] * (p - j)
                if score_mod is not None:
                    s = float(score_mod(np.float64(s), 0, h, p, j))
                if (causal and j > p) or (mask_mod is not None and not mask_mod(0, h, p, j)):
                    continue
                logits.append(s)
                values.append(v[h, j])
            if sinks is not None:
                logits.append(float(sinks[h]))
                values.append(np.zeros(v.shape[-1]))
            if not logits:
                lse[h, i] = -np.inf
                continue
            top = max(logits)
            e = [math.exp(x - top) for x in logits]
            total = sum(e)
            out[h, i] = sum(w / total * val for w, val in zip(e, values, strict=True))
            lse[h, i] = top + math.log(total)
    return out, lse


def bias_mod(s, b, h, q_idx, kv_idx):
    """A relative-position bias that depends on the head and the distance."""
    return s + 0.25 * np.cos(0.7 * (q_idx - kv_idx)) - 0.1 * h


def problem(L, S, d=8, dv=5, heads=4, kv_heads=2, batch=2, dtype=np.float64):
    q = RNG.standard_normal((batch, heads, L, d)).astype(dtype)
    k = RNG.standard_normal((batch, kv_heads, S, d)).astype(dtype)
    v = RNG.standard_normal((batch, kv_heads, S, dv)).astype(dtype)
    return q, k, v


IDS = np.repeat(np.arange(10), [3, 5, 1, 7, 2, 6, 4, 9, 2, 30])  # 69 positions, uneven documents

VARIANTS = {
    "softcap": {"softcap": 0.8},
    "sinks": {"sinks": np.array([0.5, -1.0, 2.0, 0.0])},
    "alibi": {"alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625])},
    "score_mod": {"score_mod": bias_mod},
    "document": {"mask_mod": document(IDS)},
    "all": {
        "softcap": 1.5,
        "sinks": np.array([0.3, 0.2, -0.4, 1.0]),
        "alibi_slopes": np.array([0.2, 0.1, 0.05, 0.025]),
        "score_mod": bias_mod,
        "mask_mod": or_masks(document(IDS), sliding_window(2, 0)),
    },
}


# ----- the reference, against the literal definition -----


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("is_causal", [False, True])
def test_reference_equals_literal_definition(name, is_causal):
    kw = VARIANTS[name]
    L, S = 6, 9
    q, k, v = (RNG.standard_normal((4, n, 3)) for n in (L, S, S))
    got, got_lse = reference.attention(q, k, v, causal=is_causal, return_lse=True, **kw)
    lit_kw = {key.replace("alibi_slopes", "alibi"): x for key, x in kw.items()}
    expect, lse = literal(q, k, v, scale=3**-0.5, causal=is_causal, **lit_kw)
    np.testing.assert_allclose(got, expect, **tol("float64 path", np.float64))
    np.testing.assert_allclose(got_lse, lse, **tol("float64 path", np.float64))


def test_sink_row_with_no_key_gives_zero_and_the_sinks_lse():
    q, k, v = problem(3, 5, heads=2, kv_heads=2, batch=1)
    sinks = np.array([1.5, -2.0])
    nothing = np.zeros((1, 1, 3, 5), dtype=bool)
    for kernel in ("dense", "tiled", "decode"):
        out, lse = qkv.attention(q, k, v, mask=nothing, sinks=sinks, return_lse=True, kernel=kernel)
        assert np.all(out == 0)
        np.testing.assert_array_equal(lse, np.broadcast_to(sinks[None, :, None], lse.shape))
    w = qkv.attention_weights(q, k, sinks=sinks)
    expect = reference.attention_weights(q, k, sinks=sinks)
    np.testing.assert_allclose(w, expect, rtol=bound("float64 path", np.float64))
    assert np.all(w.sum(-1) < 1)  # the sink takes its share


# ----- every kernel, against the reference -----


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("kernel", ["dense", "tiled", "decode"])
@pytest.mark.parametrize(("L", "S"), [(23, 69), (69, 69), (3, 69)])
def test_kernels_equal_reference(name, kernel, L, S):
    q, k, v = problem(L, S)
    for is_causal, window in ((False, None), (True, None), (True, (9, 0))):
        kw = dict(causal=is_causal, window=window, **VARIANTS[name])
        expect, lse = reference.attention(q, k, v, return_lse=True, **kw)
        plan = make_plan(q, k, v, **kw)
        if kernel == "tiled":  # tiles of 7 queries and 10 keys divide neither L nor S
            got, got_lse = mods.with_sinks(plan, *tiled.attend(plan, block_q=7, block_k=10))
        else:
            got, got_lse = dispatch.attend(plan, kernel)
        np.testing.assert_allclose(got, expect, **TOL[np.dtype(np.float64)])
        np.testing.assert_allclose(got_lse, lse, **TOL[np.dtype(np.float64)])


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_dtypes_keep_their_dtype_and_equal_reference(dtype):
    q, k, v = problem(40, 50, dtype=dtype)
    kw = dict(causal=True, mask=RNG.random((40, 50)) > 0.2, **VARIANTS["all"])
    expect = reference.attention(q, k, v, **kw)
    for kernel in ("dense", "tiled", "decode"):
        got = qkv.attention(q, k, v, kernel=kernel, **kw)
        assert got.dtype == dtype
        np.testing.assert_allclose(got, expect, **TOL[np.dtype(dtype)])


def test_softcap_bounds_the_logits_and_is_identity_for_large_caps():
    q, k, v = problem(5, 7)
    big = qkv.attention(q * 30, k, v, softcap=1.0, return_lse=True)
    assert np.all(big[1] <= 1.0 + np.log(7) + 1e-12)  # every logit is at most c
    np.testing.assert_allclose(
        qkv.attention(q, k, v, softcap=1e9),
        qkv.attention(q, k, v),
        **tol("float64 path", np.float64),
    )


def test_alibi_equals_its_float_bias():
    q, k, v = problem(6, 10)
    slopes = np.array([1.0, 0.5, 0.25, 0.125])
    p = np.arange(6)[:, None] + 4
    j = np.arange(10)[None, :]
    bias = -slopes[:, None, None] * np.maximum(p - j, 0)
    np.testing.assert_allclose(
        qkv.attention(q, k, v, alibi_slopes=slopes, causal=True),
        qkv.attention(q, k, v, mask=bias, causal=True),
        rtol=bound("float64 path", np.float64),
    )


def test_mask_helpers_match_the_builtin_masks():
    q, k, v = problem(12, 20)
    pairs = [
        ({"mask_mod": causal}, {"causal": True}),
        ({"mask_mod": sliding_window(3, 1)}, {"window": (3, 1)}),
        (
            {"mask_mod": and_masks(causal, sliding_window(4, None))},
            {"causal": True, "window": (4, 0)},
        ),
    ]
    for mod, builtin in pairs:
        np.testing.assert_allclose(
            qkv.attention(q, k, v, kernel="tiled", **mod), reference.attention(q, k, v, **builtin)
        )
    pos = np.arange(12)[:, None] + 8
    j = np.arange(20)[None, :]
    np.testing.assert_allclose(
        qkv.attention(q, k, v, mask_mod=prefix_lm(10)),
        reference.attention(q, k, v, mask=(j < 10) | (j <= pos)),
    )


def test_document_ids_per_batch_and_score_mod_sees_batch_and_head():
    q, k, v = problem(9, 9)
    ids = np.array([[0, 0, 0, 1, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 1, 2]])
    same = ids[:, None, :, None] == ids[:, None, None, :]
    np.testing.assert_allclose(
        qkv.attention(q, k, v, mask_mod=document(ids), kernel="tiled"),
        reference.attention(q, k, v, mask=same),
    )
    seen = qkv.attention(q, k, v, score_mod=lambda s, b, h, qi, kj: s + 0 * b + 10.0 * (b == 1))
    np.testing.assert_allclose(
        seen, reference.attention(q, k, v), rtol=bound("float64 path", np.float64)
    )  # a row constant


# ----- block mask: empty tiles are never computed -----


@pytest.mark.parametrize(("doc", "full"), [(16, True), (8, False)])
def test_block_mask_skips_empty_tiles_and_full_tiles_pay_no_mask(doc, full):
    ids = np.repeat(np.arange(96 // doc), doc)  # 96 tokens in documents of `doc`
    q, k, v = problem(96, 96, heads=1, kv_heads=1, batch=1)
    keep = document(ids)
    mask_calls, score_calls = [], []

    def counted_mask(b, h, qi, kj):
        mask_calls.append(1)
        return keep(b, h, qi, kj)

    def counted_score(s, b, h, qi, kj):
        score_calls.append(s.shape)
        return s

    plan = make_plan(q, k, v, mask_mod=counted_mask, score_mod=counted_score)
    blocks = mods.block_mask(plan, 16, 16)
    assert (blocks != mods.EMPTY).sum() == 6  # the diagonal tiles of 16 × 16
    assert (blocks == mods.FULL).sum() == (6 if full else 0)
    mask_calls.clear()
    out, _ = tiled.attend(plan, block_q=16, block_k=16, threads=1)
    np.testing.assert_allclose(
        out, reference.attention(q, k, v, mask_mod=keep), rtol=bound("float64 path", np.float64)
    )
    # rows in tiles of 16 see only their own 16 keys: 6 of the 36 tiles are computed
    assert len(score_calls) == 6 and all(s == (16, 16) for s in score_calls)
    # the block mask evaluates every tile once; only partial tiles evaluate it again
    assert len(mask_calls) == 36 + (0 if full else 6)


# ----- gradients -----


def finite_differences(f, args, eps=1e-6):
    grads = []
    for i, a in enumerate(args):
        g = np.zeros_like(a)
        for ix in np.ndindex(a.shape):
            up, down = [x.copy() for x in args], [x.copy() for x in args]
            up[i][ix] += eps
            down[i][ix] -= eps
            g[ix] = (f(*up) - f(*down)) / (2 * eps)
        grads.append(g)
    return grads


@pytest.mark.parametrize("name", ["softcap", "sinks", "all_but_score_mod"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_gradients_equal_finite_differences(name, is_causal):
    kw = dict(VARIANTS["all"]) if name == "all_but_score_mod" else dict(VARIANTS[name])
    kw.pop("score_mod", None)
    kw.pop("mask_mod", None)
    q, k, v = problem(4, 6, d=3, dv=2, batch=1)
    go = RNG.standard_normal((1, 4, 4, 2))
    sinks = kw.pop("sinks", None)
    args = [q, k, v] + ([] if sinks is None else [sinks])

    def loss(q, k, v, *s):
        extra = {"sinks": s[0]} if s else {}
        return float(np.sum(reference.attention(q, k, v, causal=is_causal, **kw, **extra) * go))

    fd = finite_differences(loss, args)
    extra = {} if sinks is None else {"sinks": sinks}
    exact = reference_attention_vjp(q, k, v, go, causal=is_causal, **kw, **extra)
    out, lse = qkv.attention(q, k, v, causal=is_causal, return_lse=True, **kw, **extra)
    fast = qkv.attention_vjp(q, k, v, go, causal=is_causal, **kw, **extra)
    tiles = qkv.attention_vjp(
        q, k, v, go, causal=is_causal, out=out, lse=lse, block=3, **kw, **extra
    )
    assert len(exact) == len(args) == len(fast) == len(tiles)
    for e, f, a, t in zip(exact, fd, fast, tiles, strict=True):
        np.testing.assert_allclose(e, f, atol=tol("finite differences", np.float64)["atol"])
        np.testing.assert_allclose(a, e, atol=bound("float64 path", np.float64))
        np.testing.assert_allclose(t, e, atol=bound("float64 path", np.float64))


def test_vjp_refuses_score_mod():
    q, k, v = problem(2, 3)
    with pytest.raises(qkv.InputError, match="score_mod"):
        qkv.attention_vjp(q, k, v, np.ones((2, 4, 2, 5)), score_mod=bias_mod)


# ----- merge and the KV cache -----


def test_merge_with_sinks_counts_the_sink_once():
    q, k, v = problem(5, 30, heads=4, kv_heads=4)
    sinks = np.array([1.0, -0.5, 3.0, 0.0])
    expect, lse = qkv.attention(q, k, v, sinks=sinks, causal=True, return_lse=True)
    pos = np.arange(5)[:, None] + 25
    parts = [
        qkv.attention(
            q,
            k[..., a:b, :],
            v[..., a:b, :],
            return_lse=True,
            mask=np.arange(a, b)[None, :] <= pos,  # causal over the whole sequence
        )
        for a, b in ((0, 7), (7, 20), (20, 30))
    ]
    out, got_lse = qkv.merge(parts, sinks=sinks)
    np.testing.assert_allclose(out, expect, **tol("float64 path", np.float64))
    np.testing.assert_allclose(got_lse, lse, rtol=bound("float64 path", np.float64))
    empty = qkv.merge([(np.zeros((4, 1, 5)), np.full((4, 1), -np.inf))], sinks=sinks)
    assert np.all(empty[0] == 0) and np.all(empty[1][:, 0] == sinks)


def test_kv_cache_attend_with_variants_equals_attention():
    cache = qkv.KVCache(batch=2, kv_heads=2, head_dim=8, value_dim=5, dtype=np.float64)
    k0, v0 = RNG.standard_normal((2, 11, 8)), RNG.standard_normal((2, 11, 5))
    k1, v1 = RNG.standard_normal((2, 17, 8)), RNG.standard_normal((2, 17, 5))
    cache.append(k0, v0, seq=0)
    cache.append(k1, v1, seq=1)
    q = RNG.standard_normal((2, 4, 2, 8))
    kw = dict(VARIANTS["all"])
    kw["mask_mod"] = lambda b, h, qi, kj: (kj % 2 == b) | (kj == qi)
    got = cache.attend(q, **kw)
    for b, (kk, vv) in enumerate(((k0, v0), (k1, v1))):
        fixed = dict(kw, mask_mod=lambda _, h, qi, kj, b=b: kw["mask_mod"](b, h, qi, kj))
        np.testing.assert_allclose(got[b], reference.attention(q[b], kk, vv, causal=True, **fixed))


# ----- errors -----


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"softcap": 0.0}, "softcap: must be finite and > 0"),
        ({"softcap": float("nan")}, "softcap"),
        ({"alibi_slopes": [1.0, np.inf, 0, 0]}, "alibi_slopes: must be finite"),
        ({"alibi_slopes": [1.0, 2.0, 3.0]}, r"alibi_slopes: shape \(3,\)"),
        ({"sinks": np.ones((5,))}, "sinks: shape"),
        ({"score_mod": lambda s, b, h, qi, kj: s[..., :2]}, "score_mod: returned shape"),
        ({"score_mod": lambda s, b, h, qi, kj: s > 0}, "score_mod: must return float"),
        ({"mask_mod": lambda b, h, qi, kj: qi - kj}, "mask_mod: must return bool"),
        ({"mask_mod": lambda b, h, qi, kj: np.ones(3, bool)}, "mask_mod: returned shape"),
    ],
)
def test_invalid_variants_raise_input_error_naming_the_argument(kw, match):
    q, k, v = problem(20, 30)
    for kernel in ("dense", "tiled", "decode"):
        with pytest.raises(qkv.InputError, match=match):
            qkv.attention(q, k, v, kernel=kernel, **kw)


def test_non_callable_mods_raise_type_error():
    with pytest.raises(qkv.InputTypeError, match="mask_mod"):
        qkv.attention([1.0], [[1.0]], [[1.0]], mask_mod=np.ones((1, 1), bool))


# ----- properties -----


@settings(max_examples=25, deadline=None)
@given(
    L=st.integers(1, 12),
    S=st.integers(0, 14),
    cap=st.floats(0.05, 50),
    sink=st.floats(-20, 20),
    slope=st.floats(0, 2),
    is_causal=st.booleans(),
    block=st.integers(1, 6),
)
def test_tiled_with_variants_equals_reference(L, S, cap, sink, slope, is_causal, block):
    rng = np.random.default_rng(L * 100 + S)
    q, k, v = (
        rng.standard_normal((2, L, 3)),
        rng.standard_normal((2, S, 3)),
        rng.standard_normal((2, S, 2)),
    )
    kw = dict(causal=is_causal, softcap=cap, sinks=[sink, -sink], alibi_slopes=[slope, 2 * slope])
    expect, lse = reference.attention(q, k, v, return_lse=True, **kw)
    plan = make_plan(q, k, v, **kw)
    out, got_lse = mods.with_sinks(plan, *tiled.attend(plan, block_q=block, block_k=block + 1))
    np.testing.assert_allclose(out, expect, **TOL[np.float64])
    np.testing.assert_allclose(got_lse, lse, **TOL[np.float64])


# ----- the torch bridge -----


def test_torch_autograd_through_softcap_and_sinks():
    torch = pytest.importorskip("torch")
    q, k, v = problem(5, 7, batch=1)
    go = RNG.standard_normal((1, 4, 5, 5))
    kw = {"softcap": 0.9, "alibi_slopes": [0.1, 0.2, 0.3, 0.4], "causal": True}
    sinks = np.array([0.5, -0.5, 1.0, 2.0])
    ts = [torch.tensor(x, requires_grad=True) for x in (q, k, v, sinks)]
    out = qkv.attention(*ts[:3], sinks=ts[3], **kw)
    assert isinstance(out, torch.Tensor)
    np.testing.assert_allclose(
        out.detach().numpy(), reference.attention(q, k, v, sinks=sinks, **kw)
    )
    (out * torch.tensor(go)).sum().backward()
    expect = reference_attention_vjp(q, k, v, go, sinks=sinks, **kw)
    for t, e in zip(ts, expect, strict=True):
        np.testing.assert_allclose(t.grad.numpy(), e, atol=bound("float64 path", np.float64))
    with pytest.raises(qkv.InputError, match="score_mod"):
        qkv.attention(*ts[:3], score_mod=bias_mod)


# ----- explain -----


def test_explain_shows_each_variants_step_and_equals_reference():
    q, k, v = (RNG.standard_normal((n, 3)) for n in (4, 6, 6))
    kw = {
        "softcap": 0.7,
        "sinks": 0.4,
        "alibi_slopes": 0.3,
        "score_mod": lambda s, b, h, qi, kj: s + 0.05 * kj,
        "mask_mod": prefix_lm(1),
    }
    t = qkv.explain(q, k, v, **kw)
    scaled = q @ k.T / np.sqrt(3)
    capped = 0.7 * np.tanh(scaled / 0.7)
    p, j = np.arange(4)[:, None] + 2, np.arange(6)[None, :]
    alibi = -0.3 * np.maximum(p - j, 0)
    np.testing.assert_allclose(t.steps["softcap"], capped, rtol=bound("float64 path", np.float64))
    np.testing.assert_allclose(t.steps["alibi"], alibi, atol=bound("few roundings", np.float64))
    np.testing.assert_allclose(
        t.steps["score_mod"], capped + alibi + 0.05 * j, rtol=bound("float64 path", np.float64)
    )
    expect, lse = reference.attention(q, k, v, return_lse=True, **kw)
    np.testing.assert_allclose(t.output, expect, rtol=bound("float64 path", np.float64))
    np.testing.assert_allclose(t.lse, lse, rtol=bound("float64 path", np.float64))
    np.testing.assert_allclose(
        t.sink_share, np.exp(0.4 - lse), rtol=bound("float64 path", np.float64)
    )
    np.testing.assert_allclose(
        t.weights.sum(-1) + t.sink_share, 1.0, rtol=bound("float64 path", np.float64)
    )
    assert t.reasons(0, 5) == ["mask_mod"]
    text = t.to_text()
    assert "c·tanh(s/c)" in text and "+ ALiBi" in text and "score_mod" in text
    assert "sink = 0.4" in text and "mask_mod is False" in text
    for fmt in ("markdown", "latex", "html"):
        assert "ALiBi" in t.render(fmt)
    doc = t.to_dict()
    assert doc["sink"] == 0.4 and set(doc["steps"]) == {"softcap", "alibi", "score_mod"}
    with pytest.raises(qkv.InputError, match="exact: not available"):
        qkv.explain(q, k, v, exact=True, softcap=1.0)
