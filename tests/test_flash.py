"""qkv.flash: FlashAttention 2's interface on the CPU, against a float64 reference written here
in flash-attn's own terms (bottom-right causal, ``window_size`` with -1 unbounded, softcap,
symmetric ALiBi ``-slope·|i + S - L - j|``, grouped heads), on flash-attn's own test matrix
scaled to a CPU: ``flash_attn_func``, ``flash_attn_varlen_func`` (packed, and paged with a
block table), ``flash_attn_with_kvcache`` (contiguous and paged caches with page sizes 1..256,
``cache_seqlens`` 0..max, new k/v appended in place, rotary, ``cache_batch_idx``,
``cache_leftpad``); tensors and arrays in four dtypes; gradients; bad input refused before any
write; ``qkv.attention(layout=...)``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.conftest import tol

import qkv
from qkv.flash import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from qkv.testing import strategies

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")

RNG = np.random.default_rng(43)

# ----- the reference: one sequence, float64, in flash-attn's terms -----


def ref_one(q, k, v, *, scale=None, causal=False, window=(-1, -1), softcap=0.0, slopes=None):
    """``q (L, H, d)``, ``k (S, Hkv, d)``, ``v (S, Hkv, dv)`` -> ``out (L, H, dv)``, ``lse (H,
    L)``; a row that sees no key gives 0 and -inf."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    L, H, d = q.shape
    S, Hkv = k.shape[:2]
    k, v = np.repeat(k, H // Hkv, axis=1), np.repeat(v, H // Hkv, axis=1)
    s = np.einsum("lhd,shd->hls", q, k) * (d**-0.5 if scale is None else scale)
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    p = S - L + np.arange(L)[:, None]
    j = np.arange(S)[None, :]
    if slopes is not None:
        s = s - np.asarray(slopes, np.float64)[:, None, None] * np.abs(p - j)
    left, right = window
    right = 0 if causal else right
    ok = np.ones((L, S), bool)
    if left >= 0:
        ok &= j >= p - left
    if right >= 0:
        ok &= j <= p + right
    s = np.where(ok, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    z = e.sum(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        w = np.where(z > 0, e / z, 0.0)
        lse = np.where(z[..., 0] > 0, np.log(z[..., 0]) + m[..., 0], -np.inf)
    return np.einsum("hls,shd->lhd", w, v), lse


def ref_batch(q, k, v, **kw):
    """``(B, L, H, d)`` layouts: ``out (B, L, H, dv)``, ``lse (B, H, L)``."""
    slopes = kw.pop("slopes", None)
    res = [
        ref_one(q[b], k[b], v[b], slopes=None if slopes is None else _row(slopes, b), **kw)
        for b in range(q.shape[0])
    ]
    return np.stack([r[0] for r in res]), np.stack([r[1] for r in res])


def _row(slopes, b):
    s = np.asarray(slopes)
    return s if s.ndim == 1 else s[b]


def _f64(x):
    if isinstance(x, torch.Tensor):
        return x.detach().double().numpy()
    return np.asarray(x).astype(np.float64)


def judge(got, want, dtype, what="out"):
    """A float32/float64 result against the reference by the table's "variants" row, a
    bfloat16/float16 one (inputs exact in the dtype) by "rounded once": qkv computes in float32
    and rounds once; a log-sum-exp (float32 for every dtype but float64) by "float32 lse"."""
    got = _f64(got)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.array_equal(np.isneginf(got), np.isneginf(want)), "-inf rows differ"
    fin = np.isfinite(want)
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if what == "lse" and name != "float64":
        np.testing.assert_allclose(got[fin], want[fin], **tol("float32 lse", np.float32))
    elif name in ("float32", "float64"):
        np.testing.assert_allclose(got[fin], want[fin], **tol("variants", name))
    else:  # computed in float32 and rounded once to the dtype
        np.testing.assert_allclose(got[fin], want[fin], **tol("rounded once", name))


DTYPES = {
    "float32": (np.float32, torch.float32),
    "float64": (np.float64, torch.float64),
    "float16": (np.float16, torch.float16),
    "bfloat16": (ml_dtypes.bfloat16, torch.bfloat16),
}


def rounded(shape, dtype, spread=1.0):
    """Random values exactly representable in ``dtype`` (a NumPy array of that dtype)."""
    return (RNG.standard_normal(shape) * spread).astype(DTYPES[dtype][0])


def _copy(x):
    """A NumPy copy of an array or CPU tensor."""
    return x.numpy().copy() if isinstance(x, torch.Tensor) else x.copy()


def as_kind(a, kind):
    """``a`` (NumPy) as the caller passes it: an array, or a CPU tensor of the same dtype."""
    if kind == "numpy":
        return a
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


MHA = {"mha": 6, "gqa": 2, "mqa": 1}  # kv heads for 6 query heads


# ----- flash_attn_func: flash-attn's output matrix -----


@pytest.mark.parametrize("seqlens", [(1, 147), (113, 203), (128, 217), (108, 64), (33, 33)])
@pytest.mark.parametrize("mha", list(MHA))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("local", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("alibi", [False, True])
def test_func_matrix_float32(seqlens, mha, causal, local, softcap, alibi):
    L, S = seqlens
    B, H, d = 2, 6, 24
    q = rounded((B, L, H, d), "float32")
    k = rounded((B, S, MHA[mha], d), "float32")
    v = rounded((B, S, MHA[mha], d + 8), "float32")  # dv differs from d
    window = (int(RNG.integers(0, S)), int(RNG.integers(0, S))) if local else (-1, -1)
    slopes = RNG.random((B, H)).astype(np.float32) * 0.3 if alibi else None
    out, lse, none = flash_attn_func(
        q, k, v, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes,
        return_attn_probs=True,
    )  # fmt: skip
    assert none is None and out.dtype == np.float32
    want, want_lse = ref_batch(
        q, k, v, causal=causal, window=window, softcap=softcap, slopes=slopes
    )
    judge(out, want, np.float32)
    judge(lse, want_lse, np.float32, "lse")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize(
    "case",
    [
        dict(causal=True),
        dict(causal=False, window_size=(7, 3), alibi=True),
        dict(causal=True, softcap=2.0, alibi=True),
        dict(causal=False, softmax_scale=0.3),
    ],
)
def test_func_dtypes_and_types(dtype, kind, case):
    case = dict(case)
    B, L, S, H, Hkv, d = 2, 19, 37, 4, 2, 16
    q, k, v = (rounded(s, dtype) for s in ((B, L, H, d), (B, S, Hkv, d), (B, S, Hkv, d)))
    slopes = (np.arange(1, H + 1) / 8).astype(np.float32) if case.pop("alibi", False) else None
    out = flash_attn_func(
        as_kind(q, kind), as_kind(k, kind), as_kind(v, kind), alibi_slopes=slopes, **case
    )
    if kind == "torch":
        assert isinstance(out, torch.Tensor) and out.dtype == DTYPES[dtype][1]
    else:
        assert isinstance(out, np.ndarray) and out.dtype == np.dtype(DTYPES[dtype][0])
    want, _ = ref_batch(
        q, k, v, causal=case.get("causal", False), window=case.get("window_size", (-1, -1)),
        softcap=case.get("softcap", 0.0), scale=case.get("softmax_scale"), slopes=slopes,
    )  # fmt: skip
    judge(out, want, dtype)


def test_func_rows_that_see_nothing_give_zero_and_minus_inf():
    # causal with more queries than keys: the first rows sit before every key
    q, k, v = rounded((1, 6, 2, 8), "float64"), *rounded((2, 1, 3, 2, 8), "float64")
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert np.all(out[0, :3] == 0) and np.all(np.isneginf(lse[0, :, :3]))
    want, want_lse = ref_batch(q, k, v, causal=True)
    judge(out, want, np.float64)
    judge(lse, want_lse, np.float64, "lse")


@settings(max_examples=40, deadline=None)
@given(
    qkv_inputs=strategies.inputs(strategies.shapes(grouped=True, L=(1, 9), S=(1, 9))),
    causal=st.booleans(),
    window=st.tuples(st.integers(-1, 5), st.integers(-1, 5)),
    softcap=st.sampled_from([0.0, 1.0, 20.0]),
    alibi=st.booleans(),
)
def test_func_property_equals_the_reference(qkv_inputs, causal, window, softcap, alibi):
    # qkv's generators draw (batch, heads, L, d): flash-attn's layout is their transpose
    q, k, v = (x.transpose(0, 2, 1, 3) for x in qkv_inputs)
    slopes = 2.0 ** -np.arange(1, q.shape[2] + 1) if alibi else None
    out, lse, _ = flash_attn_func(
        q, k, v, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes,
        return_attn_probs=True,
    )  # fmt: skip
    want, want_lse = ref_batch(
        q, k, v, causal=causal, window=window, softcap=softcap, slopes=slopes
    )
    judge(out, want, np.float64)
    judge(lse, want_lse, np.float64, "lse")


# ----- gradients -----


def _gradcheck(fn, *xs):
    ts = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in xs]
    assert torch.autograd.gradcheck(fn, ts, **tol("finite differences", np.float64))


@pytest.mark.parametrize(
    "case",
    [
        dict(causal=True),
        dict(window_size=(2, 1), softcap=3.0),
        dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625])),
        dict(causal=True, alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625]), softcap=2.0),
    ],
)
def test_func_gradients_pass_gradcheck(case):
    q, k, v = RNG.standard_normal((2, 4, 4, 5)), *RNG.standard_normal((2, 2, 6, 2, 5))
    _gradcheck(lambda q, k, v: flash_attn_func(q, k, v, **case), q, k, v)


@pytest.mark.parametrize("case", [dict(causal=True), dict(softcap=2.0, window_size=(1, -1))])
def test_varlen_gradients_pass_gradcheck(case):
    cu_q, cu_k = np.array([0, 2, 2, 5]), np.array([0, 3, 4, 8])
    q, k, v = RNG.standard_normal((5, 4, 3)), *RNG.standard_normal((2, 8, 2, 3))
    _gradcheck(lambda q, k, v: flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 4, **case), q, k, v)


def test_func_gradients_equal_the_vjp_in_float32():
    q, k, v = (rounded(s, "float32") for s in ((2, 9, 4, 8), (2, 12, 2, 8), (2, 12, 2, 8)))
    g = rounded((2, 9, 4, 8), "float32")
    ts = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    (flash_attn_func(*ts, causal=True) * torch.tensor(g)).sum().backward()
    tr = [x.transpose(0, 2, 1, 3) for x in (q, k, v)]
    want = qkv.attention_vjp(*tr, g.transpose(0, 2, 1, 3), causal=True)
    for t, w in zip(ts, want, strict=True):
        np.testing.assert_allclose(
            t.grad.numpy(), w.transpose(0, 2, 1, 3), **tol("backward", np.float32)
        )


# ----- flash_attn_varlen_func -----


def _pack(lengths, tail, dtype="float32"):
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return rounded((int(cu[-1]), *tail), dtype), cu


@pytest.mark.parametrize("mha", list(MHA))
@pytest.mark.parametrize(
    "case",
    [
        dict(),
        dict(causal=True),
        dict(window_size=(5, 2)),
        dict(causal=True, softcap=4.0),
        dict(alibi=True),
        dict(causal=True, alibi=True, window_size=(9, -1)),
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_varlen_against_each_sequence(mha, case, dtype):
    case = dict(case)
    lq, lk = [5, 0, 33, 1, 17], [9, 4, 33, 70, 0]
    H, Hkv, d = 6, MHA[mha], 16
    q, cu_q = _pack(lq, (H, d), dtype)
    k, cu_k = _pack(lk, (Hkv, d), dtype)
    v, _ = _pack(lk, (Hkv, d), dtype)
    slopes = RNG.random((len(lq), H)) * 0.2 if case.pop("alibi", False) else None
    out, lse, _ = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lq), max(lk), alibi_slopes=slopes, return_attn_probs=True,
        **case,
    )  # fmt: skip
    assert out.shape == (sum(lq), H, d) and lse.shape == (H, sum(lq))
    for b in range(len(lq)):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        want, want_lse = ref_one(
            q[sq], k[sk], v[sk], causal=case.get("causal", False),
            window=case.get("window_size", (-1, -1)), softcap=case.get("softcap", 0.0),
            slopes=None if slopes is None else slopes[b],
        )  # fmt: skip
        judge(out[sq], want, dtype)
        judge(lse[:, sq], want_lse, dtype, "lse")


@pytest.mark.parametrize("tensors", [False, True])
def test_varlen_soft_capped_decoding_steps_take_one_decode_step(monkeypatch, tensors):
    import qkv.flash as flash

    served = []
    step = flash.decode_steps
    monkeypatch.setattr(
        flash, "decode_steps", lambda *a, **kw: served.append(a[3].tolist()) or step(*a, **kw)
    )
    lq, lk = [1, 6, 1, 0, 1], [40, 9, 1, 3, 0]  # decoding steps beside a prompt, and empties
    H, Hkv, d = 4, 2, 16
    q, cu_q = _pack(lq, (H, d))
    k, cu_k = _pack(lk, (Hkv, d))
    v, _ = _pack(lk, (Hkv, d))
    args = (q, k, v, cu_q, cu_k)
    if tensors:
        args = tuple(torch.from_numpy(np.ascontiguousarray(x)) for x in args)
    out, lse, _ = flash_attn_varlen_func(
        *args, max(lq), max(lk), causal=True, softcap=2.5, return_attn_probs=True
    )
    from qkv.engine.kernels import native_decode

    if native_decode.available():
        assert served == [[0, 7]], "the decoding steps were not one call"
    out, lse = (np.asarray(x) for x in (out, lse))
    for b in range(len(lq)):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if sq.stop == sq.start:
            continue
        want, want_lse = ref_one(q[sq], k[sk], v[sk], causal=True, softcap=2.5)
        judge(out[sq], want, "float32")
        judge(lse[:, sq], want_lse, "float32", "lse")


def test_varlen_tensors_in_tensors_out():
    q, cu = _pack([3, 4], (2, 8))
    t = torch.from_numpy(q)
    out, lse, _ = flash_attn_varlen_func(
        t, t, t, torch.from_numpy(cu), torch.from_numpy(cu), 4, 4, causal=True,
        return_attn_probs=True,
    )  # fmt: skip
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    assert isinstance(lse, torch.Tensor) and lse.shape == (2, 7)
    want = flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, causal=True)
    np.testing.assert_allclose(out.numpy(), want, **tol("rule floor", np.float32))
    # the longest lengths as 0-d integer tensors (cu_seqlens.diff().max()) are read too
    n = torch.from_numpy(np.diff(cu)).max()
    again = flash_attn_varlen_func(t, t, t, torch.from_numpy(cu), torch.from_numpy(cu), n, n)
    assert again.shape == (7, 2, 8)


@pytest.mark.parametrize("page", [1, 3, 16])
def test_varlen_reads_keys_through_a_block_table(page):
    lq, lk = [1, 4, 3], [7, 4, 20]
    H, Hkv, d = 4, 2, 8
    q, cu_q = _pack(lq, (H, d))
    k, cu_k = _pack(lk, (Hkv, d))
    v, _ = _pack(lk, (Hkv, d))
    blocks = [-(-n // page) for n in lk]
    num = sum(blocks) + 3
    perm = RNG.permutation(num)
    table = np.full((3, max(blocks) + 1), -1, np.int32)  # unused entries are never read
    kp, vp = np.zeros((2, num, page, Hkv, d), np.float32)
    at = 0
    for b, n in enumerate(lk):
        for i in range(blocks[b]):
            table[b, i] = perm[at]
            rows = slice(i * page, min((i + 1) * page, n))
            kp[perm[at], : rows.stop - rows.start] = k[cu_k[b] + rows.start : cu_k[b] + rows.stop]
            vp[perm[at], : rows.stop - rows.start] = v[cu_k[b] + rows.start : cu_k[b] + rows.stop]
            at += 1
    got = flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, 4, 20, causal=True, block_table=table)
    want = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 20, causal=True)
    np.testing.assert_allclose(got, want, **tol("packed walk", np.float32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", [dict(causal=True), dict(window_size=(6, 0), softcap=3.0)])
def test_varlen_decoding_batch_through_a_block_table_is_one_step(monkeypatch, dtype, case):
    import qkv.flash as flash

    calls = []
    pages = flash._attend_pages
    monkeypatch.setattr(flash, "_attend_pages", lambda *a, **kw: calls.append(1) or pages(*a, **kw))
    lk, page, H, Hkv, d = [7, 0, 33, 16, 1], 4, 4, 2, 8
    q, cu_q = _pack([1] * len(lk), (H, d), dtype)
    k, cu_k = _pack(lk, (Hkv, d), dtype)
    v, _ = _pack(lk, (Hkv, d), dtype)
    blocks = [-(-n // page) for n in lk]
    perm = RNG.permutation(sum(blocks) + 2)
    table = np.zeros((len(lk), max(blocks)), np.int32)
    kp, vp = (np.zeros((perm.size, page, Hkv, d), k.dtype) for _ in range(2))
    at = 0
    for b, n in enumerate(lk):
        for i in range(blocks[b]):
            table[b, i] = perm[at]
            rows = slice(cu_k[b] + i * page, cu_k[b] + min((i + 1) * page, n))
            kp[perm[at], : rows.stop - rows.start] = k[rows]
            vp[perm[at], : rows.stop - rows.start] = v[rows]
            at += 1
    got, lse, _ = flash_attn_varlen_func(
        q, kp, vp, cu_q, cu_k, 1, 33, block_table=table, return_attn_probs=True, **case
    )
    assert calls == [1], "not one call for the whole batch"
    assert got.dtype == q.dtype and lse.shape == (H, len(lk))
    for b, n in enumerate(lk):  # each sequence against flash_attn_func on its keys
        if n == 0:
            assert not got[b].astype(np.float32).any() and np.isneginf(lse[:, b]).all()
            continue
        keys = slice(cu_k[b], cu_k[b + 1])
        want, want_lse, _ = flash_attn_func(
            q[b : b + 1, None].astype(np.float64), k[None, keys].astype(np.float64),
            v[None, keys].astype(np.float64), return_attn_probs=True, **case,
        )  # fmt: skip
        t = 2e-2 if dtype == "bfloat16" else 1e-5
        np.testing.assert_allclose(got[b].astype(np.float64), want[0, 0], rtol=t, atol=t)
        np.testing.assert_allclose(lse[:, b], want_lse[0, :, 0], rtol=t, atol=t)


@settings(max_examples=25, deadline=None)
@given(
    lq=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    extra=st.lists(st.integers(0, 9), min_size=4, max_size=4),
    causal=st.booleans(),
    left=st.integers(-1, 6),
    right=st.integers(-1, 6),
    group=st.sampled_from([1, 2, 4]),
)
def test_varlen_property_equals_the_reference(lq, extra, causal, left, right, group):
    lk = [a + b for a, b in zip(lq, extra, strict=False)]
    q, cu_q = _pack(lq, (4, 8), "float64")
    k, cu_k = _pack(lk, (4 // group, 8), "float64")
    v, _ = _pack(lk, (4 // group, 8), "float64")
    out = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, 9, 18, causal=causal, window_size=(left, right)
    )
    for b in range(len(lq)):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        want, _ = ref_one(q[sq], k[sk], v[sk], causal=causal, window=(left, right))
        judge(out[sq], want, np.float64)


# ----- flash_attn_with_kvcache: flash-attn's kvcache matrix -----


def rotary_ref(x, cos, sin, pos, interleaved):
    """flash-attn's ``apply_rotary_emb`` formulation (rotate_half), in float64."""
    x = np.asarray(x, np.float64)
    r = 2 * cos.shape[1]
    c, s = np.asarray(cos, np.float64)[pos], np.asarray(sin, np.float64)[pos]  # (B, L, r/2)
    if interleaved:
        c, s = np.repeat(c, 2, -1), np.repeat(s, 2, -1)
        x1, x2 = x[..., 0:r:2], x[..., 1:r:2]
        half = np.stack([-x2, x1], -1).reshape(*x.shape[:-1], r)
    else:
        c, s = np.concatenate([c, c], -1), np.concatenate([s, s], -1)
        half = np.concatenate([-x[..., r // 2 : r], x[..., : r // 2]], -1)
    out = x.copy()
    out[..., :r] = x[..., :r] * c[:, :, None] + half * s[:, :, None]
    return out


def _cache_case(B, S_cap, Hkv, d, page, seqlens, Lnew, dtype, batch_idx=None):
    """Contiguous cache ``(B_cache, S_cap, Hkv, d)`` or (``page``) a pool of blocks with a
    random block table; the logical contents of each sequence (float64) for the reference."""
    B_cache = B if batch_idx is None else int(max(batch_idx)) + 2
    logical_k = rounded((B_cache, S_cap, Hkv, d), dtype)
    logical_v = rounded((B_cache, S_cap, Hkv, d), dtype)
    if page is None:
        return logical_k.copy(), logical_v.copy(), None, logical_k, logical_v
    width = -(-S_cap // page)
    num = B * width + 2
    perm = RNG.permutation(num)[: B * width].reshape(B, width)
    kp, vp = rounded((num, page, Hkv, d), dtype), rounded((num, page, Hkv, d), dtype)
    for b in range(B):
        for i in range(width):
            n = min(page, S_cap - i * page)
            kp[perm[b, i], :n] = logical_k[b, i * page : i * page + n]
            vp[perm[b, i], :n] = logical_v[b, i * page : i * page + n]
    return kp, vp, perm.astype(np.int32), logical_k, logical_v


KV_CASES = [
    # (seqlen_q, seqlen_new or 0, page size or None, leftpad, batch_idx)
    (1, 1, None, False, False),
    (1, 0, None, False, False),
    (3, 3, None, False, True),
    (4, 2, None, True, False),
    (1, 1, 1, False, False),
    (3, 3, 3, False, False),
    (5, 5, 16, False, False),
    (2, 1, 256, False, False),
    (7, 0, 16, False, False),
]


# the rotary embedding applies with new k/v only
KV_ROTARY = [(s, r) for s in KV_CASES for r in (None, "interleaved", "halves") if s[1] or not r]


@pytest.mark.parametrize("shape, rotary", KV_ROTARY)
@pytest.mark.parametrize("mha", ["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("local", [False, True])
@pytest.mark.parametrize("alibi", [False, True])
def test_kvcache_matrix(shape, rotary, mha, causal, local, alibi):
    Lq, Lnew, page, has_leftpad, has_batch_idx = shape
    B, H, d, S_cap = 3, 6, 16, 40
    Hkv = MHA[mha]
    seqlens = RNG.integers(0, S_cap - Lnew + 1, size=B)
    seqlens[0] = S_cap - Lnew  # one sequence fills its cache
    seqlens[1] = 0  # and one starts empty
    batch_idx = RNG.permutation(B + 1)[:B] if has_batch_idx else None
    kc, vc, table, logical_k, logical_v = _cache_case(
        B, S_cap, Hkv, d, page, seqlens, Lnew, "float32", batch_idx
    )
    leftpad = np.minimum(RNG.integers(0, 5, size=B), seqlens) if has_leftpad else None
    q = rounded((B, Lq, H, d), "float32")
    kn, vn = (rounded((B, Lnew, Hkv, d), "float32") for _ in range(2)) if Lnew else (None, None)
    window = (int(RNG.integers(0, 10)), int(RNG.integers(0, 4))) if local else (-1, -1)
    slopes = RNG.random(H).astype(np.float32) * 0.3 if alibi else None
    rot = {}
    if rotary:
        angle = RNG.random((S_cap + Lq, d // 4)) * 2 * math.pi  # rotary_dim = d / 2
        rot = dict(
            rotary_cos=np.cos(angle).astype(np.float32),
            rotary_sin=np.sin(angle).astype(np.float32),
            rotary_interleaved=rotary == "interleaved",
        )
    kc0, vc0 = kc.copy(), vc.copy()
    out, lse = flash_attn_with_kvcache(
        q, kc, vc, kn, vn, cache_seqlens=seqlens.astype(np.int32), block_table=table,
        cache_batch_idx=batch_idx, cache_leftpad=leftpad, causal=causal, window_size=window,
        alibi_slopes=slopes, return_softmax_lse=True, **rot,
    )  # fmt: skip
    rows = np.arange(B) if batch_idx is None else batch_idx
    for b in range(B):
        s0 = int(seqlens[b])
        keys, vals = logical_k[rows[b], :s0], logical_v[rows[b], :s0]
        qb = q[b : b + 1]
        if Lnew:
            kb = kn[b : b + 1]
            if rotary:
                each = causal or local
                qpos = s0 + (np.arange(Lq) if each else np.zeros(Lq, int))
                cos, sin, inter = rot["rotary_cos"], rot["rotary_sin"], rotary == "interleaved"
                qb = rotary_ref(qb, cos, sin, qpos[None], inter)
                kb = rotary_ref(kb, cos, sin, (s0 + np.arange(Lnew))[None], inter)
                kb = kb.astype(np.float32)  # the cache stores the rotated keys in its dtype
            keys = np.concatenate([keys, kb[0]], 0)
            vals = np.concatenate([vals, vn[b]], 0)
        start = 0 if leftpad is None else int(leftpad[b])
        want, want_lse = ref_one(
            qb[0], keys[start:], vals[start:], causal=causal, window=window, slopes=slopes
        )
        judge(out[b], want, np.float32)
        judge(lse[b], want_lse, np.float32, "lse")
        # the cache: the new keys where they belong, nothing else changed
        if Lnew:
            for j in range(Lnew):
                pos = s0 + j
                if table is None:
                    where = (rows[b], pos)
                else:
                    where = (table[b, pos // page], pos % page)
                np.testing.assert_allclose(kc[where], keys[s0 + j], **tol("rule floor", np.float32))
                np.testing.assert_array_equal(vc[where], vn[b, j])
                kc0[where], vc0[where] = kc[where], vc[where]
    np.testing.assert_array_equal(kc, kc0)  # nothing else was written
    np.testing.assert_array_equal(vc, vc0)


@pytest.mark.parametrize("page", [1, 2, 5, 16, 64, 256])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_kvcache_paged_decode_steps_in_every_dtype_and_page_size(page, dtype, kind):
    # decoding: one token per step appended and attended, page sizes 1..256
    B, H, Hkv, d, steps = 2, 4, 2, 8, 3
    prompt = [5, 300 if page >= 64 else 30]
    width = -(-(max(prompt) + steps) // page)
    num = B * width
    kp = as_kind(np.zeros((num, page, Hkv, d), DTYPES[dtype][0]), kind)
    vp = as_kind(np.zeros((num, page, Hkv, d), DTYPES[dtype][0]), kind)
    table = as_kind(RNG.permutation(num).reshape(B, width).astype(np.int32), kind)
    keys = [rounded((n, Hkv, d), dtype) for n in prompt]
    vals = [rounded((n, Hkv, d), dtype) for n in prompt]
    # the prompt goes in through the call itself: one sequence at a time, a 1-query chunk
    for b in range(B):
        flash_attn_with_kvcache(
            as_kind(rounded((1, 1, H, d), dtype), kind), kp, vp,
            as_kind(keys[b][None], kind), as_kind(vals[b][None], kind),
            cache_seqlens=0, block_table=table[b : b + 1],
        )  # fmt: skip
    seqlens = np.array(prompt, dtype=np.int32)
    for _ in range(steps):
        q = rounded((B, 1, H, d), dtype)
        kn, vn = rounded((B, 1, Hkv, d), dtype), rounded((B, 1, Hkv, d), dtype)
        out = flash_attn_with_kvcache(
            as_kind(q, kind), kp, vp, as_kind(kn, kind), as_kind(vn, kind),
            cache_seqlens=as_kind(seqlens, kind), block_table=table, causal=True,
        )  # fmt: skip
        if kind == "torch":
            assert isinstance(out, torch.Tensor) and out.dtype == DTYPES[dtype][1]
        else:
            assert isinstance(out, np.ndarray) and out.dtype == np.dtype(DTYPES[dtype][0])
        for b in range(B):
            keys[b] = np.concatenate([keys[b], kn[b]], 0)
            vals[b] = np.concatenate([vals[b], vn[b]], 0)
            want, _ = ref_one(q[b], keys[b], vals[b], causal=True)
            judge(out[b], want, dtype)
        seqlens += 1


@settings(max_examples=30, deadline=None)
@given(
    page=st.integers(1, 8),
    lens=st.lists(st.integers(0, 12), min_size=1, max_size=3),
    Lq=st.integers(1, 4),
    new=st.booleans(),
    causal=st.booleans(),
)
def test_kvcache_property_paged_equals_contiguous(page, lens, Lq, new, causal):
    # the same logical cache, paged (random blocks) and contiguous: the same answers and the
    # same written keys
    B, Hkv, H, d, cap = len(lens), 1, 2, 4, 16
    Lnew = Lq if new else 0
    seqlens = np.minimum(np.array(lens), cap - Lnew)
    kc, vc, table, lk, lv = _cache_case(B, cap, Hkv, d, page, seqlens, Lnew, "float64")
    ck, cv = lk[:B].copy(), lv[:B].copy()
    q = rounded((B, Lq, H, d), "float64")
    kn, vn = (rounded((B, Lnew, Hkv, d), "float64") for _ in range(2)) if new else (None, None)
    kw = dict(cache_seqlens=seqlens, causal=causal, return_softmax_lse=True)
    got = flash_attn_with_kvcache(q, kc, vc, kn, vn, block_table=table, **kw)
    want = flash_attn_with_kvcache(q, ck, cv, kn, vn, **kw)
    np.testing.assert_allclose(got[0], want[0], **tol("float64 path", np.float64))
    np.testing.assert_allclose(got[1], want[1], **tol("float64 path", np.float64))
    for b in range(B):
        for j in range(int(seqlens[b]) + Lnew):
            blk = table[b, j // page]
            np.testing.assert_array_equal(kc[blk, j % page], ck[b, j])


# ----- bad input: refused by name, before anything is written -----


def _paged(B=2, num=6, page=4, Hkv=2, d=8):
    kp = rounded((num, page, Hkv, d), "float32")
    return kp, rounded((num, page, Hkv, d), "float32")


BAD = [
    ("block_table", dict(block_table=[[0, 9], [2, 3]]), "outside the pool"),
    ("block_table", dict(block_table=[[0, -1], [2, 3]]), "outside the pool"),
    ("block_table", dict(block_table=[[0, 0], [2, 3]]), "would overwrite"),
    ("block_table", dict(block_table=[[0, 1], [1, 3]]), "would overwrite"),
    ("block_table", dict(block_table=[[0], [2]]), "needs 2 pages"),
    ("cache_seqlens", dict(cache_seqlens=[3, -1]), ">= 0"),
    ("cache_seqlens", dict(cache_seqlens=[3, 2.0]), "integers"),
    ("cache_batch_idx", dict(cache_batch_idx=[0, 1]), "not with block_table"),
    ("cache_leftpad", dict(cache_leftpad=[0, 1]), "not with block_table"),
    ("rotary_cos", dict(rotary_cos=np.ones((2, 2))), "give both"),
    ("dropout_p", dict(dropout_p=0.1), "unexpected keyword"),  # flash-attn's has none
    ("k_cache, v_cache", dict(v_cache=np.zeros((6, 2, 2, 8), np.float32)), "sizes differ"),
]


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize(
    "name, change, text", BAD, ids=[f"{n}-{i}" for i, (n, *_) in enumerate(BAD)]
)
def test_kvcache_bad_input_is_refused_before_any_write(name, change, text, kind):
    kp, vp = (as_kind(x, kind) for x in _paged())
    before = [_copy(x) for x in (kp, vp)]
    args = dict(
        k=rounded((2, 2, 2, 8), "float32"), v=rounded((2, 2, 2, 8), "float32"),
        cache_seqlens=[3, 5], block_table=[[0, 1], [2, 3]], v_cache=vp,
    )  # fmt: skip
    q = rounded((2, 1, 4, 8), "float32")
    # the unchanged call is accepted (on copies): each case below breaks one thing
    flash_attn_with_kvcache(q, _copy(kp), **dict(args, v_cache=_copy(vp)))
    args.update(change)
    with pytest.raises((qkv.InputError, qkv.InputTypeError)) as info:
        flash_attn_with_kvcache(q, kp, **args)
    message = str(info.value)
    assert message.startswith(name), message
    assert text in message, message
    np.testing.assert_array_equal(_copy(kp), before[0])
    np.testing.assert_array_equal(_copy(vp), before[1])


def test_kvcache_contiguous_bad_input_writes_nothing():
    kc, vc = rounded((2, 2, 10, 2, 8), "float32")
    before = kc.copy()
    q, kn = rounded((2, 1, 4, 8), "float32"), rounded((2, 3, 2, 8), "float32")
    cases = [
        (dict(cache_seqlens=[3, 8]), "cache_seqlens", "beyond the cache"),
        (dict(cache_seqlens=[3, 1], cache_batch_idx=[1, 1]), "cache_batch_idx", "repeats"),
        (dict(cache_seqlens=[3, 1], cache_batch_idx=[0, 2]), "cache_batch_idx", "0 .. 1"),
        (dict(cache_seqlens=[3, 1], cache_leftpad=[4, 0]), "cache_leftpad", "0 .. cache_seqlens"),
        (dict(), "cache_seqlens", "required"),
        (dict(cache_seqlens=3, window_size=(1,)), "window_size", "(left, right)"),
    ]
    for kw, name, text in cases:
        with pytest.raises((qkv.InputError, qkv.InputTypeError)) as info:
            flash_attn_with_kvcache(q, kc, vc, kn, kn, **kw)
        assert str(info.value).startswith(name) and text in str(info.value), str(info.value)
        np.testing.assert_array_equal(kc, before)
    with pytest.raises(qkv.InputError, match="k_cache.*read-only"):
        ro = kc.copy()
        ro.flags.writeable = False
        flash_attn_with_kvcache(q, ro, vc, kn, kn, cache_seqlens=1)
    with pytest.raises(qkv.InputError, match="^k_cache, v_cache: the first three sizes differ"):
        flash_attn_with_kvcache(q, kc, vc[:, :4], cache_seqlens=1)
    with pytest.raises(qkv.InputError, match="^k_cache: .*requires grad"):
        t = torch.zeros((2, 10, 2, 8), requires_grad=True)
        flash_attn_with_kvcache(q, t, torch.zeros((2, 10, 2, 8)), kn, kn, cache_seqlens=1)


def test_varlen_and_func_bad_input():
    q, cu = _pack([3, 4], (2, 8))
    with pytest.raises(qkv.InputError, match="^cu_seqlens_q: must be non-decreasing"):
        flash_attn_varlen_func(q, q, q, [0, 4, 3, 7], cu, 4, 4)
    with pytest.raises(qkv.InputError, match="^cu_seqlens_k: must end at total_k = 7"):
        flash_attn_varlen_func(q, q, q, cu, [0, 3, 6], 4, 4)
    with pytest.raises(qkv.InputError, match="^max_seqlen_q: 3 is less than the longest"):
        flash_attn_varlen_func(q, q, q, cu, cu, 3, 4)
    with pytest.raises(qkv.InputError, match="^dropout_p: .*not supported on the CPU"):
        flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, dropout_p=0.5)
    x = rounded((1, 4, 2, 8), "float32")
    with pytest.raises(qkv.InputError, match="^q: expected shape \\(batch, seqlen_q, heads, d\\)"):
        flash_attn_func(x[0], x, x)
    with pytest.raises(
        qkv.InputError, match="^alibi_slopes: expected shape \\(2,\\) or \\(1, 2\\)"
    ):
        flash_attn_func(x, x, x, alibi_slopes=np.ones(3))
    with pytest.raises(qkv.InputError, match="^softcap: expected 0"):
        flash_attn_func(x, x, x, softcap=-1.0)
    with pytest.raises(qkv.InputTypeError, match="did you mean 'causal'"):
        flash_attn_func(x, x, x, casual=True)
    # accepted and documented: deterministic (the CPU road is), num_splits (ignored)
    a = flash_attn_func(x, x, x, deterministic=True)
    np.testing.assert_array_equal(a, flash_attn_func(x, x, x))


# ----- qkv.attention(layout=...) -----


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_attention_layout_blhd_equals_the_transposed_call(kind):
    q, k, v = rounded((2, 5, 4, 8), "float32"), *rounded((2, 2, 7, 2, 8), "float32")
    got, lse = qkv.attention(
        *(as_kind(x, kind) for x in (q, k, v)), causal=True, layout="blhd", return_lse=True
    )
    t = [x.swapaxes(1, 2) for x in (q, k, v)]
    want, want_lse = qkv.attention(*t, causal=True, return_lse=True)
    assert tuple(got.shape) == (2, 5, 4, 8) and tuple(lse.shape) == (2, 5, 4)
    np.testing.assert_allclose(_f64(got), want.swapaxes(1, 2), **tol("rule floor", np.float32))
    np.testing.assert_allclose(_f64(lse), want_lse.swapaxes(1, 2), **tol("rule floor", np.float32))


def test_attention_layout_gradients_flow():
    q, k, v = RNG.standard_normal((1, 3, 2, 4)), *RNG.standard_normal((2, 1, 5, 1, 4))
    _gradcheck(lambda q, k, v: qkv.attention(q, k, v, causal=True, layout="blhd"), q, k, v)


def test_attention_layout_that_disagrees_with_the_shapes_is_refused():
    x = np.ones((2, 5, 8))
    with pytest.raises(qkv.InputError, match="^layout: 'blhd' reads q as"):
        qkv.attention(x[0], x[0], x[0], layout="blhd")
    # (batch, heads, L, d) arrays given as blhd: 3 "heads" against 2 do not group
    q, k = np.ones((1, 6, 3, 8)), np.ones((1, 2, 2, 8))
    with pytest.raises(qkv.InputError, match="^layout: .*do not group.*leave layout='bhld'"):
        qkv.attention(q, k, k, layout="blhd")
    with pytest.raises(qkv.InputError, match="^layout: expected 'bhld'"):
        qkv.attention(x, x, x, layout="bshd")
