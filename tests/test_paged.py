"""Paged K/V: attention through a block table (the native step reading pages in place, and the
NumPy road that gathers them) and the pool of pages, :class:`qkv.PagedKVCache`.

Tolerance rule: both roads compute in float32 (float64 for a float64 pool) from the stored
values, so they must equal the float64 reference applied to each sequence's gathered,
dequantized keys and values to that dtype's rounding: the table's ``fast path`` row.
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.conftest import tol

import qkv
from qkv import reference
from qkv.engine.kernels import native_decode
from qkv.engine.paged import PagedKVCache, attend_pages
from qkv.errors import InputError, InputTypeError
from qkv.testing import strategies as qst

FORMS = ["float32", "float64", "bfloat16", "float16", "int8", "float8_e4m3fn"]
PAGES = [1, 3, 16, 64, 256]
TOL32, TOL64 = tol("fast path", np.float32), tol("fast path", np.float64)
native = pytest.mark.skipif(
    not native_decode.available(), reason="native kernels not built (or QKV_NATIVE=0)"
)


def _pool(rng, form, nb, page, kvh, d, dv=None):
    """A pool in ``form``: (k_pages, v_pages, kv_format, k_scale, v_scale, stored k, stored v),
    the stored values in float64."""
    dv = d if dv is None else dv
    kx = qst.values(rng, (nb, page, kvh, d)).astype(np.float32)
    vx = qst.values(rng, (nb, page, kvh, dv)).astype(np.float32)
    if form in ("float32", "float64", "float16"):
        k, v = kx.astype(form), vx.astype(form)
        return k, v, None, None, None, k.astype(np.float64), v.astype(np.float64)
    (k, ks), (v, vs) = qkv.quantize_kv(kx, form), qkv.quantize_kv(vx, form)
    kd = qkv.dequantize_kv(k, ks, form).astype(np.float64)
    vd = qkv.dequantize_kv(v, vs, form).astype(np.float64)
    return k, v, form, ks, vs, kd, vd


def _table(rng, seqlens, page, nb):
    """A block table over a shuffled pool: each sequence its own pages, drawn at random."""
    per = [-(-int(n) // page) for n in seqlens]
    width = max(max(per, default=0), 1)
    ids = rng.permutation(nb)
    table = np.full((len(seqlens), width), -1, dtype=np.int64)  # unused entries: not pages
    at = 0
    for b, p in enumerate(per):
        table[b, :p] = ids[at : at + p]
        at += p
    return table


def _expected(q, kd, vd, table, seqlens, **options):
    """The float64 reference per sequence on its gathered pages: (out, lse)."""
    B, H, Lq, _ = q.shape
    page = kd.shape[1]
    out = np.zeros((B, H, Lq, vd.shape[-1]))
    lse = np.full((B, H, Lq), -np.inf)
    slopes = options.pop("alibi_slopes", None)
    options.setdefault("causal", True)  # attend_pages' default
    for b, n in enumerate(seqlens):
        if n == 0:
            continue
        pos = np.arange(n)
        at = (table[b, pos // page], pos % page)
        k, v = kd[at].transpose(1, 0, 2), vd[at].transpose(1, 0, 2)
        extra = {} if slopes is None else {"alibi_slopes": np.broadcast_to(slopes, (B, H))[b]}
        o, s = reference.attention(
            q[b].astype(np.float64), k, v, return_lse=True, **options, **extra
        )
        out[b], lse[b] = o, s
    return out, lse


def _check(got, want, dtype):
    t = TOL64 if dtype == np.float64 else TOL32
    np.testing.assert_allclose(got[0], want[0], **t)
    finite = np.isfinite(want[1])
    assert np.array_equal(np.isfinite(got[1]), finite)
    np.testing.assert_allclose(np.asarray(got[1])[finite], want[1][finite], **t)


def _case(form, page, d=64, kvh=2, H=4, seqlens=(0, 1, 37, 300), seed=0):
    rng = np.random.default_rng(seed)
    seqlens = list(seqlens)
    nb = sum(-(-n // page) for n in seqlens) + 3
    k, v, fmt, ks, vs, kd, vd = _pool(rng, form, nb, page, kvh, d)
    table = _table(rng, seqlens, page, nb)
    dt = np.float64 if form == "float64" else np.float32
    q = qst.values(rng, (len(seqlens), H, 1, d)).astype(dt)
    return q, k, v, fmt, ks, vs, kd, vd, table, seqlens


# --- the native step: pages read in place ----------------------------------------------------


@native
@pytest.mark.parametrize("isa", ["baseline", "avx2", ""])
@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("form", FORMS)
def test_native_paged_step_equals_reference(monkeypatch, form, page, isa):
    monkeypatch.setenv("QKV_NATIVE_ISA", isa)
    for d in (
        64,
        128,
        32,
        256,
        40,
    ):  # unrolled head sizes (32, 256: float32 and bfloat16), the general loop
        q, k, v, fmt, ks, vs, kd, vd, table, seqlens = _case(form, page, d=d)
        n = np.array(seqlens)
        got = native_decode.paged_step(
            q,
            k,
            v,
            table.clip(0).astype(np.int32),
            np.zeros_like(n),
            n,
            d**-0.5,
            kv_format=fmt if fmt != "float16" else None,
            k_scale=ks,
            v_scale=vs,
        )
        assert got is not None, "the native step must read these pages"
        _check(got, _expected(q, kd, vd, table, seqlens), q.dtype)
        assert np.all(got[0][0] == 0) and np.all(got[1][0] == -np.inf)  # no key: 0, -inf
        pub = attend_pages(
            q,
            k,
            v,
            table,
            n,
            return_lse=True,
            kv_format=fmt if fmt != "float16" else None,
            k_scale=ks,
            v_scale=vs,
        )
        _check(pub, _expected(q, kd, vd, table, seqlens), q.dtype)


@native
@pytest.mark.parametrize("isa", ["baseline", "avx2", ""])
@pytest.mark.parametrize("form", ["float32", "bfloat16", "int8"])
def test_native_step_many_sequences_split_keys(monkeypatch, form, isa):
    # one long sequence (its keys split into pieces over the threads) and a batch of them
    monkeypatch.setenv("QKV_NATIVE_ISA", isa)
    for seqlens in ((3000,), (0, 2000, 5, 2048, 64)):
        q, k, v, fmt, ks, vs, kd, vd, table, seqlens = _case(
            form, 16, d=128, kvh=2, H=8, seqlens=seqlens
        )
        got = attend_pages(
            q, k, v, table, seqlens, return_lse=True, kv_format=fmt, k_scale=ks, v_scale=vs
        )
        _check(got, _expected(q, kd, vd, table, seqlens), q.dtype)


@native
@pytest.mark.parametrize("form", ["float32", "float8_e4m3fn"])
def test_gqa_softcap_window_on_the_native_step(form):
    q, k, v, fmt, ks, vs, kd, vd, table, seqlens = _case(form, 16, d=64, kvh=2, H=8)
    for options in ({"softcap": 2.0}, {"window": (20, None)}, {"window": (0, 3), "scale": 0.3}):
        got = attend_pages(
            q,
            k,
            v,
            table,
            seqlens,
            return_lse=True,
            kv_format=fmt,
            k_scale=ks,
            v_scale=vs,
            **options,
        )
        _check(got, _expected(q, kd, vd, table, seqlens, causal=True, **options), q.dtype)


def test_strided_pages_and_a_float64_query():
    # pages that are a view (every other block of a larger pool), a float64 q over float32 pages
    q, k, v, fmt, ks, vs, kd, vd, table, seqlens = _case("float32", 16, d=64)
    big_k = np.zeros((2 * k.shape[0], *k.shape[1:]), np.float32)
    big_v = np.zeros_like(big_k)
    big_k[::2], big_v[::2] = k, v
    got = attend_pages(
        q.astype(np.float64), big_k[::2], big_v[::2], table, seqlens, return_lse=True
    )
    assert got[0].dtype == np.float64
    _check(got, _expected(q, kd, vd, table, seqlens), np.float32)


# --- the NumPy road: gathered pages on the general road ----------------------------------------


@pytest.mark.parametrize("page", [1, 3, 16, 256])
@pytest.mark.parametrize("form", FORMS)
def test_numpy_road_equals_reference(monkeypatch, form, page):
    monkeypatch.setenv("QKV_NATIVE", "0")
    q, k, v, fmt, ks, vs, kd, vd, table, seqlens = _case(form, page, d=32)
    got = attend_pages(
        q, k, v, table, seqlens, return_lse=True, kv_format=fmt, k_scale=ks, v_scale=vs
    )
    _check(got, _expected(q, kd, vd, table, seqlens), q.dtype)


@pytest.mark.parametrize("form", ["float32", "int8"])
def test_several_queries_alibi_and_no_causal(form):
    # Lq > 1 (chunked prefill against the pages) and ALiBi always take the NumPy road
    rng = np.random.default_rng(3)
    seqlens = [0, 4, 40, 70]
    k, v, fmt, ks, vs, kd, vd = _pool(rng, form, 30, 16, 2, 32)
    table = _table(rng, seqlens, 16, 30)
    q = qst.values(rng, (4, 4, 5, 32)).astype(np.float32)
    slopes = np.array([0.5, 0.25, 0.125, 0.0625])
    for options in (
        {"causal": True},
        {"causal": False},
        {"causal": True, "window": (6, 0)},
        {"causal": True, "alibi_slopes": slopes},
        {"causal": True, "alibi_slopes": np.tile(slopes, (4, 1)) * np.arange(1, 5)[:, None]},
        {"causal": False, "softcap": 1.5},
    ):
        got = attend_pages(
            q,
            k,
            v,
            table,
            seqlens,
            return_lse=True,
            kv_format=fmt,
            k_scale=ks,
            v_scale=vs,
            **options,
        )
        _check(got, _expected(q, kd, vd, table, seqlens, **options), np.float32)


@settings(max_examples=40, deadline=None)
@given(
    page=st.sampled_from([1, 2, 3, 5, 16]),
    lengths=st.lists(st.integers(0, 60), min_size=1, max_size=4),
    kvh=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3]),
    Lq=st.sampled_from([1, 1, 2]),
    form=st.sampled_from(FORMS),
    seed=st.integers(0, 2**16),
)
def test_property_any_pool_equals_reference(page, lengths, kvh, group, Lq, form, seed):
    rng = np.random.default_rng(seed)
    nb = sum(-(-n // page) for n in lengths) + 2
    k, v, fmt, ks, vs, kd, vd = _pool(rng, form, nb, page, kvh, 16)
    table = _table(rng, lengths, page, nb)
    dt = np.float64 if form == "float64" else np.float32
    q = qst.values(rng, (len(lengths), kvh * group, Lq, 16)).astype(dt)
    got = attend_pages(
        q, k, v, table, lengths, return_lse=True, kv_format=fmt, k_scale=ks, v_scale=vs
    )
    _check(got, _expected(q, kd, vd, table, lengths), dt)


# --- bad input -------------------------------------------------------------------------------


def test_bad_input_is_named():
    q, k, v, fmt, ks, vs, kd, vd, table, seqlens = _case("float32", 16, d=64)
    n = np.array(seqlens)
    bad = table.copy()
    bad[3, 2] = k.shape[0]  # a page past the pool
    with pytest.raises(InputError, match=r"block_table: entry \[3, 2\].*pool of"):
        attend_pages(q, k, v, bad, n)
    bad[3, 2] = -2
    with pytest.raises(InputError, match="block_table"):
        attend_pages(q, k, v, bad, n)
    cap = table.shape[1] * 16  # the table's 19 pages hold 304 keys
    with pytest.raises(InputError, match="seqlens: sequence 3 holds 305 keys, which need 20"):
        attend_pages(q, k, v, table, n + [0, 0, 0, cap + 1 - 300])
    with pytest.raises(InputError, match="seqlens: .*negative"):
        attend_pages(q, k, v, table, n - [1, 0, 0, 0])
    with pytest.raises(InputError, match=r"block_table: expected shape \(batch=4"):
        attend_pages(q, k, v, table[:3], n)
    with pytest.raises(InputError, match=r"seqlens: expected shape"):
        attend_pages(q, k, v, table, n[:3])
    with pytest.raises(InputError, match="q: expected shape"):
        attend_pages(q[..., :32], k, v, table, n)
    with pytest.raises(InputError, match="query heads cannot share"):
        attend_pages(q[:, :3], k, v, table, n)
    with pytest.raises(InputError, match="k_pages, v_pages"):
        attend_pages(q, k, v[:, :8], table, n)
    with pytest.raises(InputTypeError, match="block_table: expected integers"):
        attend_pages(q, k, v, table.astype(float), n)
    with pytest.raises(InputTypeError, match="kv_format"):
        attend_pages(q, k, v, table, n, kv_format="int8")
    codes, scales = qkv.quantize_kv(k, "int8")
    with pytest.raises(InputError, match="v_scale"):
        attend_pages(q, codes, codes, table, n, kv_format="int8", k_scale=scales)


@native
def test_native_step_refuses_a_block_outside_the_pool_before_reading():
    q, k, v, fmt, ks, vs, kd, vd, table, seqlens = _case("float32", 16, d=64)
    t = table.clip(0).astype(np.int32)
    t[2, 1] = 10**6
    with pytest.raises(InputError, match="block_table: qkv native decode"):
        native_decode.paged_step(q, k, v, t, np.zeros(4, np.int64), np.array(seqlens), 0.125)


# --- the pool --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8", "float8_e4m3fn"])
def test_pool_equals_a_kv_cache_holding_the_same_tokens(dtype):
    rng = np.random.default_rng(5)
    kvh, d, H = 2, 64, 4
    pool = PagedKVCache(40, 16, kvh, d, dtype=dtype)
    flat = qkv.KVCache(3, kvh, d, dtype=dtype)
    a, b = pool.allocate(), pool.allocate()
    ka, va = qst.values(rng, (2, kvh, 37, d))
    pool.append(a, ka, va)
    flat.append(ka, va, seq=0)
    kb, vb = qst.values(rng, (2, kvh, 5, d))
    pool.append(b, kb, vb)
    flat.append(kb, vb, seq=1)
    c = pool.fork(a, upto=21)  # one full page shared, the partial one copied
    flat.append(ka[:, :21], va[:, :21], seq=2)
    for _ in range(3):  # decode a few tokens each
        step = qst.values(rng, (2, 3, kvh, 1, d))
        for i, s in enumerate((a, b, c)):
            pool.append(s, step[0, i], step[1, i])
        flat.append(step[0], step[1])
        q = qst.values(rng, (3, H, 1, d)).astype(np.float32)
        got = pool.attend(q, seqs=[a, b, c], return_lse=True)
        want = flat.attend(q, return_lse=True)
        np.testing.assert_allclose(got[0], want[0], **TOL32)
        np.testing.assert_allclose(got[1], want[1], **TOL32)
    assert pool.lengths.tolist() == flat.lengths.tolist() == [40, 8, 24]
    for i, s in enumerate((a, b, c)):
        np.testing.assert_array_equal(pool.keys(s), flat.keys(i))
        np.testing.assert_array_equal(pool.values(s), flat.values(i))
    # a's appends after the fork did not reach c's copy of the shared prefix, and back
    np.testing.assert_array_equal(pool.keys(c)[:, :21], flat.keys(0)[:, :21])


def test_fork_shares_pages_and_free_gives_them_back():
    rng = np.random.default_rng(6)
    pool = PagedKVCache(10, 4, 1, 8)
    a = pool.allocate()
    k, v = qst.values(rng, (2, 1, 10, 8))
    pool.append(a, k, v)  # 3 pages, the last half full
    assert pool.free_blocks == 7
    b = pool.fork(a)  # 2 shared + 1 copied
    c = pool.fork(a, upto=8)  # 2 shared, nothing copied
    assert pool.free_blocks == 6
    tab = pool.block_table
    assert tab[0, :2].tolist() == tab[1, :2].tolist() == tab[2, :2].tolist()
    assert tab[1, 2] != tab[0, 2]
    pool.free(a)
    assert pool.free_blocks == 7  # a's own last page; the shared two still held
    np.testing.assert_array_equal(pool.keys(b), k)
    np.testing.assert_array_equal(pool.keys(c), k[:, :8])
    pool.free(b)
    pool.free(c)
    assert pool.free_blocks == 10 and pool.seqs == []


def test_refused_calls_leave_the_pool_unchanged():
    rng = np.random.default_rng(7)
    pool = PagedKVCache(4, 4, 1, 8, dtype="int8")
    a = pool.allocate()
    pool.append(a, *qst.values(rng, (2, 1, 6, 8)))
    before = copy.deepcopy(pool)

    def state(p):
        return (p.k_pages.copy(), p.v_pages.copy(), p.k_scale.copy(), p.block_table, p.lengths)

    with pytest.raises(InputError, match="needs 3 more blocks of 4 tokens, 2 of 4 are free"):
        pool.append(a, *qst.values(rng, (2, 1, 11, 8)))
    with pytest.raises(InputError, match="k: expected shape"):
        pool.append(a, np.ones((2, 1, 8)), np.ones((2, 1, 8)))
    with pytest.raises(InputError, match="upto: 7 is beyond"):
        pool.fork(a, upto=7)
    with pytest.raises(InputError, match="seq: 5 is not a live sequence"):
        pool.free(5)
    with pytest.raises(InputError, match="block_table|q: expected"):
        pool.attend(np.ones((1, 1, 1, 4)))
    for x, y in zip(state(pool), state(before), strict=True):
        np.testing.assert_array_equal(x, y)
    assert pool.free_blocks == before.free_blocks == 2
    b = pool.fork(a, upto=5)  # a partial page copied: 1 free left
    c = pool.fork(a)  # and the last
    d = pool.fork(b, upto=4)  # one full page shared: nothing to copy
    with pytest.raises(InputError, match="fork: the pool is exhausted: it needs 1 more blocks"):
        pool.fork(a)  # a's partial page would need a copy
    assert pool.seqs == [a, b, c, d] and pool.free_blocks == 0


def test_copies_are_independent_and_repr_names_the_pool():
    pool = PagedKVCache(4, 2, 1, 4)
    a = pool.allocate()
    pool.append(a, np.ones((1, 3, 4)), np.ones((1, 3, 4)))
    for twin in (copy.copy(pool), copy.deepcopy(pool), pickle.loads(pickle.dumps(pool))):
        twin.append(a, np.zeros((1, 1, 4)), np.zeros((1, 1, 4)))
        assert twin.lengths.tolist() == [4] and pool.lengths.tolist() == [3]
        assert pool.keys(a).shape == (1, 3, 4)
    assert repr(pool) == (
        "PagedKVCache(num_blocks=4, page_size=2, kv_heads=1, head_dim=4, value_dim=4, "
        "dtype=float32, seqs=[0], lengths=[3], free_blocks=2)"
    )
    with pytest.raises(InputTypeError, match="did you mean 'bfloat16'"):
        PagedKVCache(4, 2, 1, 4, dtype="bf16")
    assert not pool.k_pages.flags.writeable


def test_tensors_in_tensors_out():
    torch = pytest.importorskip("torch")
    pool = qkv.PagedKVCache(8, 4, 2, 16)
    a = pool.allocate()
    k, v = torch.randn(2, 2, 6, 16)
    pool.append(a, k, v)
    q = torch.randn(1, 4, 1, 16)
    out = pool.attend(q)
    assert isinstance(out, torch.Tensor) and out.shape == (1, 4, 1, 16)
    want = qkv.attention(q[0], k.repeat_interleave(2, 0), v.repeat_interleave(2, 0))
    torch.testing.assert_close(out[0], want, **TOL32)


def test_ml_dtypes_bfloat16_pages_on_both_roads(monkeypatch):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, k, v, fmt, ks, vs, kd, vd, table, seqlens = _case("float32", 16, d=64)
    kb, vb = k.astype(ml_dtypes.bfloat16), v.astype(ml_dtypes.bfloat16)  # values: exact
    want = _expected(q, kd, vd, table, seqlens)
    _check(attend_pages(q, kb, vb, table, seqlens, return_lse=True), want, np.float32)
    monkeypatch.setenv("QKV_NATIVE", "0")
    _check(attend_pages(q, kb, vb, table, seqlens, return_lse=True), want, np.float32)


def test_paged_cache_attend_names_a_mistyped_keyword():
    """attend passes its options on to attend_pages: a mistyped one is still refused by the
    method's name, with the nearest keyword it takes."""
    cache = qkv.PagedKVCache(num_blocks=8, page_size=4, kv_heads=1, head_dim=8)
    s = cache.allocate()
    cache.append(s, np.ones((1, 5, 8), np.float32), np.ones((1, 5, 8), np.float32))
    q = np.ones((1, 2, 1, 8), np.float32)
    with pytest.raises(qkv.InputTypeError, match=r"PagedKVCache.attend\(\).*did you mean 'scale'"):
        cache.attend(q, scael=0.5)
    with pytest.raises(qkv.InputTypeError, match="kv_format"):
        cache.attend(q, kv_format="int8")  # the pool's form is the cache's own
    want = qkv.attention(q[0], np.ones((1, 5, 8)), np.ones((1, 5, 8)), scale=0.5)
    np.testing.assert_allclose(cache.attend(q, scale=0.5)[0], want, **tol("fast path", np.float32))
