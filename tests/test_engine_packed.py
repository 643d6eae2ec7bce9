"""The packed kernel (kernels/packed.py) and attention_varlen's walk over it.

Sizes are chosen not to divide the tiles (small tiles, odd lengths); ``WALK_FLOPS = 0`` sends
every sequence through the walk, which otherwise serves only sequences with enough work. The
native kernels are switched off here (``attention_varlen`` would run their packed walk instead;
``tests/test_engine_native.py`` tests that one).
"""

from __future__ import annotations

import numpy as np
import pytest
from tests.conftest import bound

import qkv
from qkv import reference
from qkv.engine import varlen
from qkv.engine.kernels import packed
from qkv.validate import make_plan

LQ = [5, 0, 1, 13, 37, 3, 1, 70, 0, 29, 1]
LK = [5, 4, 1, 13, 41, 0, 9, 70, 0, 29, 1]  # L < S, L == S, no keys, no queries, length 1
TOL = bound("packed walk")


def make(rng, lq, lk, heads, kv_heads, d=8, dv=5, dtype=np.float64):
    cq, ck = (np.concatenate([[0], np.cumsum(x, dtype=np.int64)]) for x in (lq, lk))
    q = rng.standard_normal((cq[-1], heads, d)).astype(dtype)
    k = rng.standard_normal((ck[-1], kv_heads, d)).astype(dtype)
    v = rng.standard_normal((ck[-1], kv_heads, dv)).astype(dtype)
    return q, k, v, cq, ck


def reference_per_sequence(q, k, v, cq, ck, **kw):
    """qkv.reference on each sequence alone, in float64, packed back: output and lse."""
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]))
    lse = np.full(q.shape[:2], -np.inf)
    for b in range(len(cq) - 1):
        qs, ks, vs = (
            x[c[b] : c[b + 1]].astype(np.float64).transpose(1, 0, 2)
            for x, c in ((q, cq), (k, ck), (v, ck))
        )
        o, s = reference.attention(qs, ks, vs, return_lse=True, **kw)
        out[cq[b] : cq[b + 1]] = o.transpose(1, 0, 2)
        lse[cq[b] : cq[b + 1]] = s.T
    return out, lse


@pytest.fixture(autouse=True)
def numpy_walk(monkeypatch):
    monkeypatch.setenv("QKV_NATIVE", "0")


@pytest.fixture
def walk_everything(monkeypatch):
    monkeypatch.setattr(varlen, "WALK_FLOPS", 0)


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize(
    "causal, window", [(False, None), (True, None), (True, (3, None)), (False, (2, 1))]
)
def test_walk_equals_reference_with_grouped_heads_and_windows(group, causal, window):
    rng = np.random.default_rng(group)
    q, k, v, cq, ck = make(rng, LQ, LK, 8, 8 // group)
    out, lse = packed.attend(
        q, k, v, cq, ck, scale=0.3, causal=causal, window=window, block_rows=12, block_k=7
    )
    want, want_lse = reference_per_sequence(
        q, k, v, cq, ck, causal=causal, window=window, scale=0.3
    )
    np.testing.assert_allclose(out, want, atol=TOL[np.float64])
    np.testing.assert_allclose(lse, want_lse, atol=TOL[np.float64])


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_varlen_walk_dtypes_equal_reference_and_per_sequence_attention(dtype, walk_everything):
    rng = np.random.default_rng(3)
    q, k, v, cq, ck = make(rng, LQ, LK, 4, 2, dtype=dtype)
    out, lse = qkv.attention_varlen(q, k, v, cq, ck, causal=True, window=(9, None), return_lse=True)
    assert out.dtype == dtype
    want, want_lse = reference_per_sequence(q, k, v, cq, ck, causal=True, window=(9, None))
    np.testing.assert_allclose(out, want, atol=bound("packed walk, reference", dtype))
    np.testing.assert_allclose(lse, want_lse, atol=bound("packed walk, reference", dtype))
    for b in range(len(LQ)):
        if LQ[b]:
            one = qkv.attention(
                *(x[c[b] : c[b + 1]].transpose(1, 0, 2) for x, c in ((q, cq), (k, ck), (v, ck))),
                causal=True,
                window=(9, None),
            )
            np.testing.assert_allclose(
                out[cq[b] : cq[b + 1]], one.transpose(1, 0, 2), atol=TOL[dtype]
            )


def test_varlen_walk_equals_torch_causal_lower_right(walk_everything):
    torch = pytest.importorskip("torch")
    from torch.nn.attention.bias import causal_lower_right

    rng = np.random.default_rng(6)
    lq, lk = [3, 1, 8, 20, 45], [9, 5, 8, 31, 45]
    q, k, v, cq, ck = make(rng, lq, lk, 8, 2, dv=8)
    got = qkv.attention_varlen(q, k, v, cq, ck, causal=True)
    for b in range(len(lq)):
        qs, ks, vs = (
            torch.from_numpy(np.ascontiguousarray(x[c[b] : c[b + 1]].transpose(1, 0, 2)))[None]
            for x, c in ((q, cq), (k, ck), (v, ck))
        )
        want = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=causal_lower_right(lq[b], lk[b]), enable_gqa=True
        )
        np.testing.assert_allclose(
            got[cq[b] : cq[b + 1]], want[0].numpy().transpose(1, 0, 2), atol=TOL[np.float64]
        )


def test_walk_non_finite_rows_as_the_numpy_kernels(walk_everything):
    """NaN in a query makes its row NaN, in a key every row that sees it; a row that sees
    overflowing float32 scores are redone per sequence and stay finite."""
    rng = np.random.default_rng(8)
    q, k, v, cq, ck = make(rng, [6, 9], [6, 9], 2, 1)
    q[1, 0, 0] = np.nan  # sequence 0, query 1, head 0
    k[6 + 4, 0, 2] = np.nan  # sequence 1, key 4: causal rows 4.. see it
    out = qkv.attention_varlen(q, k, v, [0, 6, 15], [0, 6, 15], causal=True)
    for a, z in ((0, 6), (6, 15)):
        one = qkv.attention(*(x[a:z].transpose(1, 0, 2) for x in (q, k, v)), causal=True)
        np.testing.assert_allclose(
            out[a:z], one.transpose(1, 0, 2), atol=TOL[np.float64]
        )  # NaN = NaN
    assert np.isnan(out[1, 0]).all() and not np.isnan(out[1, 1]).any()
    assert np.isnan(out[6 + 4 :]).all() and np.isfinite(out[6 : 6 + 4]).all()
    qb, kb, vb, cq2, ck2 = make(rng, [7, 20], [7, 20], 2, 2, dtype=np.float32)
    qb, kb = qb * np.float32(1e20), kb * np.float32(1e20)  # q·k near 1e40: beyond float32
    got = qkv.attention_varlen(qb, kb, vb, cq2, ck2, causal=True, scale=1.0)
    want2, _ = reference_per_sequence(qb, kb, vb, cq2, ck2, causal=True, scale=1.0)
    assert got.dtype == np.float32 and np.isfinite(got).all()
    np.testing.assert_allclose(got, want2, atol=TOL[np.float32])


def test_walk_serves_long_sequences_and_buckets_the_short(monkeypatch):
    """With the default threshold the long sequences go through the walk, the short ones to
    buckets; both agree with the reference in one call."""
    seen = []
    real = packed.attend

    def spy(*args, **kw):
        seen.append(np.asarray(kw["seqs"]).tolist())
        return real(*args, **kw)

    monkeypatch.setattr(packed, "attend", spy)
    rng = np.random.default_rng(9)
    lens = [3, 200, 2, 150, 0]
    q, k, v, cq, ck = make(rng, lens, lens, 4, 2, d=16, dv=16, dtype=np.float32)
    got = qkv.attention_varlen(q, k, v, cq, ck, causal=True)
    want, _ = reference_per_sequence(q, k, v, cq, ck, causal=True)
    assert seen == [[1, 3]]
    np.testing.assert_allclose(got, want, atol=TOL[np.float32])


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize(
    "L, S, causal, window",
    [(37, 53, True, None), (53, 37, True, None), (29, 29, False, (4, 2)), (1, 9, True, (3, 0))],
)
def test_plan_walk_equals_reference(group, L, S, causal, window):
    """A batched prefill (batch 2, 8 query heads) through the walk, in tiles that divide
    nothing, with queries cut into runs across 3 threads."""
    rng = np.random.default_rng(L + group)
    q = rng.standard_normal((2, 8, L, 8))
    k, v = rng.standard_normal((2, 2, 8 // group, S, 8))
    plan = make_plan(q, k, v, causal=causal, window=window, scale=0.4)
    out, lse = packed.attend_plan(plan, block_rows=12, block_k=7, threads=3)
    want, want_lse = reference.attention(
        q, k, v, causal=causal, window=window, scale=0.4, return_lse=True
    )
    np.testing.assert_allclose(out, want, atol=TOL[np.float64])
    np.testing.assert_allclose(lse, want_lse, atol=TOL[np.float64])


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_auto_prefill_takes_the_walk_and_equals_reference(dtype, monkeypatch):
    monkeypatch.setenv("QKV_NATIVE", "0")  # where the native kernel is built, auto runs it
    calls = []
    real = packed.attend_plan
    monkeypatch.setattr(packed, "attend_plan", lambda plan: calls.append(1) or real(plan))
    rng = np.random.default_rng(11)
    q = rng.standard_normal((4, 300, 16)).astype(dtype)
    k, v = (rng.standard_normal((2, 300, 16)).astype(dtype) for _ in range(2))
    q[1, 7, 3] = np.nan  # head 1, query 7: its row is NaN, the others are not
    got = qkv.attention(q, k, v, causal=True)
    want = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), causal=True)
    assert calls and got.dtype == dtype
    np.testing.assert_allclose(got, want, atol=TOL[dtype])  # NaN where the reference has NaN
    forced = qkv.attention(q, k, v, causal=True, kernel="tiled")
    np.testing.assert_allclose(got, forced, atol=TOL[dtype])


def test_plan_walk_empty_and_single_keys():
    q = np.ones((2, 0, 4))
    out, lse = packed.attend_plan(make_plan(q, np.ones((2, 3, 4)), np.ones((2, 3, 4))))
    assert out.shape == (2, 0, 4) and lse.shape == (2, 0)
    rng = np.random.default_rng(12)
    q, k, v = rng.standard_normal((3, 2, 5, 4))
    plan = make_plan(q, k[:, :1], v[:, :1], causal=True)  # one key: only the last row sees it
    out, lse = packed.attend_plan(plan)
    want, want_lse = reference.attention(q, k[:, :1], v[:, :1], causal=True, return_lse=True)
    np.testing.assert_allclose(out, want, atol=TOL[np.float64])
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    assert (out[:, :-1] == 0).all()
