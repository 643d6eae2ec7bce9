"""A shared prompt prefix attended once per step (:mod:`qkv.engine.cascade`): paged steps whose
sequences share leading pages are split into one prefill-shaped call over the prefix and the
paged step over the rest, merged by their log-sum-exps.

Tolerance rule: every part computes in float32 (float64 for a float64 pool) from the stored
values and the merge adds one rounding of the weights, so the result must equal the float64
reference on each sequence's gathered keys to the table's ``fast path`` row, as the unsplit step.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.conftest import tol
from tests.test_paged import FORMS, _check, _expected, _pool

import qkv
from qkv import flash, reference
from qkv.engine import cascade
from qkv.engine.kernels import native, router
from qkv.engine.paged import attend_pages
from qkv.testing import strategies as qst


@pytest.fixture
def split(monkeypatch):
    """Calls of the split, counted."""
    calls: list[int] = []
    real = cascade.attend
    monkeypatch.setattr(cascade, "attend", lambda *a: calls.append(1) or real(*a))
    return calls


def _shared_case(form, page, prefix, own, *, kvh=2, H=4, d=32, Lq=1, seed=0):
    """A pool whose sequences share ``prefix`` keys (the same leading block ids), then
    ``own[b]`` keys each on pages of their own; the table shuffled over the pool."""
    rng = np.random.default_rng(seed)
    cols = -(-prefix // page)
    assert prefix % page == 0 or len(own) == 1, "a shared page is full"
    per = [-(-(prefix + n) // page) - cols for n in own]
    nb = cols + sum(per) + 2
    k, v, fmt, ks, vs, kd, vd = _pool(rng, form, nb, page, kvh, d)
    ids = rng.permutation(nb)
    table = np.zeros((len(own), cols + max(per, default=0) + 1), dtype=np.int64)
    table[:, :cols] = ids[:cols]
    at = cols
    for b, p in enumerate(per):
        table[b, cols : cols + p] = ids[at : at + p]
        at += p
    seqlens = [prefix + n for n in own]
    dt = np.float64 if form == "float64" else np.float32
    q = qst.values(rng, (len(own), H, Lq, d)).astype(dt)
    return q, k, v, fmt, ks, vs, kd, vd, table, seqlens


@pytest.mark.parametrize("form", FORMS)
def test_shared_prefix_step_equals_reference(split, form):
    q, k, v, fmt, ks, vs, kd, vd, table, seqlens = _shared_case(form, 16, 320, [0, 1, 37, 130])
    got = attend_pages(
        q, k, v, table, seqlens, kv_format=fmt, k_scale=ks, v_scale=vs, return_lse=True
    )
    assert split == [1]
    _check(got, _expected(q, kd, vd, table, seqlens), q.dtype)


@pytest.mark.parametrize("causal", [True, False])
def test_chunked_queries_grouped_heads_and_softcap(split, causal):
    """Several queries per sequence (a prefill chunk against the cache), 4 query heads per kv
    head, soft-capping: the prefix part sees every query row after the prefix."""
    q, k, v, fmt, ks, vs, kd, vd, table, seqlens = _shared_case(
        "float32", 32, 512, [3, 40, 7], kvh=2, H=8, Lq=4, seed=1
    )
    got = attend_pages(q, k, v, table, seqlens, causal=causal, softcap=5.0, return_lse=True)
    assert split == [1]
    _check(got, _expected(q, kd, vd, table, seqlens, causal=causal, softcap=5.0), q.dtype)


def test_sequences_that_are_the_prefix_alone(split):
    """Every sequence exactly the shared prompt (nothing of its own yet): the prefix part alone."""
    q, k, v, fmt, ks, vs, kd, vd, table, seqlens = _shared_case("float32", 16, 256, [0, 0, 0])
    got = attend_pages(q, k, v, table, seqlens, return_lse=True)
    assert split == [1]
    _check(got, _expected(q, kd, vd, table, seqlens), q.dtype)


def test_no_split_where_it_cannot_apply(split):
    """A window, ALiBi, one sequence, a prefix shorter than MIN_SHARED_KEYS, or a sequence
    whose queries start inside the prefix: the unsplit step, still equal to the reference."""
    q, k, v, fmt, ks, vs, kd, vd, table, seqlens = _shared_case("float32", 16, 320, [5, 9])
    for options in ({"window": (100, 0)}, {"alibi_slopes": np.array([0.1, 0.2, 0.3, 0.4])}):
        got = attend_pages(q, k, v, table, seqlens, return_lse=True, **options)
        _check(got, _expected(q, kd, vd, table, seqlens, **options), q.dtype)
    got = attend_pages(q[:1], k, v, table[:1], seqlens[:1], return_lse=True)
    _check(got, _expected(q[:1], kd, vd, table[:1], seqlens[:1]), q.dtype)
    small = _shared_case("float32", 16, 128, [5, 9])
    got = attend_pages(*small[:3], small[8], small[9], return_lse=True)
    _check(got, _expected(small[0], small[6], small[7], small[8], small[9]), np.float32)
    long_q = _shared_case("float32", 16, 320, [2, 50], Lq=70)  # the first rows in the prefix
    got = attend_pages(*long_q[:3], long_q[8], long_q[9], return_lse=True)
    _check(got, _expected(long_q[0], long_q[6], long_q[7], long_q[8], long_q[9]), np.float32)
    assert split == []


def test_split_equals_the_unsplit_step(monkeypatch):
    """The split step against the same step with splitting off: equal within the rule's
    floor (the parts add one merge's rounding)."""
    q, k, v, fmt, ks, vs, kd, vd, table, seqlens = _shared_case("float32", 16, 1024, [1, 64, 7])
    got = attend_pages(q, k, v, table, seqlens)
    monkeypatch.setattr(router, "MIN_SHARED_KEYS", 10**9)
    whole = attend_pages(q, k, v, table, seqlens)
    np.testing.assert_allclose(got, whole, **tol("fast path", np.float32))


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    page=st.sampled_from([1, 8, 16, 64]),
    shared_pages=st.integers(0, 6),
    own=st.lists(st.integers(0, 70), min_size=1, max_size=5),
    kvh=st.integers(1, 3),
    group=st.integers(1, 3),
    Lq=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_property_any_shared_prefix(monkeypatch, page, shared_pages, own, kvh, group, Lq, seed):
    monkeypatch.setattr(router, "MIN_SHARED_KEYS", 1)
    prefix = shared_pages * page
    q, k, v, fmt, ks, vs, kd, vd, table, seqlens = _shared_case(
        "float32", page, prefix, own, kvh=kvh, H=kvh * group, Lq=Lq, seed=seed
    )
    got = attend_pages(q, k, v, table, seqlens, return_lse=True)
    _check(got, _expected(q, kd, vd, table, seqlens), q.dtype)


def test_paged_cache_forks_attend_their_prompt_once(split):
    """PagedKVCache: requests forked from one prompt share its full pages, and a step over
    them splits at the prompt; each equals attention on its own keys."""
    rng = np.random.default_rng(3)
    cache = qkv.PagedKVCache(num_blocks=64, page_size=16, kv_heads=2, head_dim=32)
    root = cache.allocate()
    cache.append(root, *(rng.standard_normal((2, 2, 300, 32)).astype(np.float32)))
    seqs = [cache.fork(root) for _ in range(4)]
    for i, s in enumerate(seqs):
        cache.append(s, *(rng.standard_normal((2, 2, 1 + 5 * i, 32)).astype(np.float32)))
    q = rng.standard_normal((4, 4, 1, 32)).astype(np.float32)
    out = cache.attend(q, seqs=seqs)
    assert split == [1]
    for b, s in enumerate(seqs):
        want = reference.attention(q[b], cache.keys(s), cache.values(s), causal=True)
        np.testing.assert_allclose(out[b], want, **tol("fast path", np.float32))


def test_flash_with_kvcache_reads_a_shared_prefix_once(split):
    """flash_attn_with_kvcache with a block table whose rows share their first blocks."""
    torch = pytest.importorskip("torch")
    q, k, v, fmt, ks, vs, kd, vd, table, seqlens = _shared_case("float32", 16, 384, [3, 20, 1])
    out = flash.flash_attn_with_kvcache(
        torch.from_numpy(q.transpose(0, 2, 1, 3).copy()),  # (batch, seqlen, heads, d)
        torch.from_numpy(k),
        torch.from_numpy(v),
        cache_seqlens=torch.tensor(seqlens, dtype=torch.int32),
        block_table=torch.from_numpy(table.astype(np.int32)),
        causal=True,
    )
    assert split == [1]
    want, _ = _expected(q, kd, vd, table, seqlens)
    np.testing.assert_allclose(
        out.numpy().transpose(0, 2, 1, 3), want, **tol("fast path", np.float32)
    )


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(("page", "kvh", "d"), [(1, 1, 32), (16, 2, 64), (64, 3, 16)])
def test_prefix_pages_read_in_place_give_the_gathered_bits(monkeypatch, form, page, kvh, d):
    """The native prefill reads a shared prefix's pages in place (float32, float64 and the
    16-bit forms, widened as gathered): the same bits as the prefix gathered first, and equal
    to the reference. The 8-bit forms and a run without the native kernels gather."""
    q, k, v, fmt, ks, vs, kd, vd, table, seqlens = _shared_case(
        form, page, 512, [0, 3, 70], kvh=kvh, H=4 * kvh, d=d, seed=page + kvh
    )
    read: list[bool] = []
    real = native.attend_prefix_pages

    def spy(*a):
        found = real(*a)
        read.append(found is not None)  # (None: the caller gathers after all)
        return found

    monkeypatch.setattr(native, "attend_prefix_pages", spy)
    kw = {"kv_format": fmt, "k_scale": ks, "v_scale": vs, "return_lse": True}
    got = attend_pages(q, k, v, table, seqlens, **kw)
    _check(got, _expected(q, kd, vd, table, seqlens), q.dtype)
    in_place = form not in ("int8", "float8_e4m3fn") and native.available()[0]
    assert read == ([True] if in_place else [])
    monkeypatch.setattr(router, "prefix_in_place", lambda *a: None)  # gathered first
    gathered = attend_pages(q, k, v, table, seqlens, **kw)
    for a, b in zip(got, gathered, strict=True):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def test_prefix_pages_in_place_refuse_what_they_do_not_read():
    """attend_prefix_pages gives None (the caller gathers) for a pool of another dtype than
    the compute dtype's, or K and V pools of different dtypes, before reading anything."""
    if not native.available()[0]:
        pytest.skip("native kernels not built (or QKV_NATIVE=0)")
    from qkv.validate import make_plan, stand_in

    rng = np.random.default_rng(5)
    rows = rng.standard_normal((2, 4, 8))
    part = make_plan(rows, stand_in(np.float64, (2, 16, 8)), stand_in(np.float64, (2, 16, 8)))
    pool = rng.standard_normal((3, 16, 2, 8)).astype(np.float32)
    ids = np.array([2], np.int32)
    assert native.attend_prefix_pages(part, pool, pool, ids, "own") is None
    q32 = rows.astype(np.float32)
    part32 = make_plan(q32, stand_in(np.float32, (2, 16, 8)), stand_in(np.float32, (2, 16, 8)))
    assert native.attend_prefix_pages(part32, pool, pool.astype(np.float64), ids, "own") is None
    kv = pool[2].transpose(1, 0, 2).astype(np.float64)  # page 2's rows: (kv_heads, 16, 8)
    s = q32.astype(np.float64) @ kv.transpose(0, 2, 1) / np.sqrt(8)
    want = np.log(np.exp(s).sum(-1))
    for products in ("own", "blas"):
        out, lse = native.attend_prefix_pages(part32, pool, pool, ids, products)
        np.testing.assert_allclose(lse, want, **tol("fast path", np.float32))
        np.testing.assert_allclose(
            out, reference.attention(q32, kv, kv), **tol("fast path", np.float32)
        )


def _merged_reference(prior, q, k, v, seqlens):
    """The float64 merge of ``prior`` (grouped rows, as :meth:`DecodePlan.run_after` takes it)
    with the reference on each sequence's first ``seqlens[b]`` keys: ``(out, lse)`` as
    ``(batch, heads, L, ·)``."""
    po, pl = (np.asarray(x, np.float64) for x in prior)
    B, H, L, _ = q.shape
    kvh = k.shape[1]
    po = po.reshape(B, kvh, H // kvh, L, -1).reshape(B, H, L, -1)
    pl = pl.reshape(B, kvh, H // kvh, L).reshape(B, H, L)
    out, lse = np.empty(po.shape), np.empty(pl.shape)
    for b, n in enumerate(seqlens):
        if n:
            o, s = reference.attention(
                q[b].astype(np.float64), k[b, :, :n].astype(np.float64),
                v[b, :, :n].astype(np.float64), return_lse=True,
            )  # fmt: skip
        else:
            o, s = np.zeros(po[b].shape), np.full(pl[b].shape, -np.inf)
        out[b], lse[b] = qkv.merge([(po[b], pl[b]), (o, s)])
    return out, lse


def _check_run_after(q, k, v, seqlens, threads, prior):
    """DecodePlan.run_after on ``prior`` against :func:`_merged_reference`; None (nothing
    merged) without the native kernels."""
    plan = qkv.plan_decode(q, k, v, seqlens=seqlens, threads=threads)
    got = plan.run_after(prior, q, k, v)
    if not native.available()[0]:
        assert got is None
        return
    assert got is not None
    _check(got, _merged_reference(prior, q, k, v, seqlens), q.dtype)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    B=st.integers(1, 4),
    kvh=st.integers(1, 3),
    group=st.integers(1, 4),
    L=st.integers(1, 3),
    d=st.sampled_from([8, 32, 64, 128]),
    S=st.integers(1, 700),
    f64=st.booleans(),
    threads=st.sampled_from([1, 2]),
    empty=st.sampled_from(["none", "prior", "own", "both"]),
    seed=st.integers(0, 2**16),
)
def test_the_native_step_merges_a_prior_part(B, kvh, group, L, d, S, f64, threads, empty, seed):
    """DecodePlan.run_after: the step's own keys merged with a prior part (a shared prefix's)
    in the native step's finish, equal to qkv.merge of the prior and the float64 reference on
    each sequence's keys. Rows whose prior has no key (lse -inf) take the step's part alone,
    sequences with no key of their own the prior alone, and both empty give 0 and -inf; one
    thread (each row's piece is its result) and two (pieces merged). Without the native
    kernels nothing is merged (None): the cascade merges the parts itself."""
    rng = np.random.default_rng(seed)
    dt = np.float64 if f64 else np.float32
    H, R = kvh * group, group * L
    q = qst.values(rng, (B, H, L, d)).astype(dt)
    k, v = (qst.values(rng, (B, kvh, S, d)).astype(dt) for _ in range(2))
    seqlens = rng.integers(0, S + 1, B)
    if empty in ("own", "both"):
        seqlens[0] = 0
    # the prior as the cascade holds it: (kv_heads, B, R, ·) rows seen as (B, kv_heads, R, ·)
    po = qst.values(rng, (kvh, B, R, d)).astype(dt).transpose(1, 0, 2, 3)
    pl = (3 * rng.standard_normal((kvh, B, R))).astype(dt).transpose(1, 0, 2)
    if empty in ("prior", "both"):
        pl[0, :, :1] = -np.inf
        po[0, :, :1] = 0
    _check_run_after(q, k, v, seqlens, threads, (po, pl))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_a_prior_part_merges_with_a_long_step_split_among_threads(threads, dt):
    """Long runs of keys with two threads: each row's keys in several pieces, merged with the
    prior in one pass (one thread: the row's one piece and the prior); a sequence with no key
    of its own and rows whose prior has none among them (without the native kernels: None)."""
    rng = np.random.default_rng(threads)
    B, kvh, group, L, d, S = 3, 2, 3, 2, 64, 3000
    q = qst.values(rng, (B, kvh * group, L, d)).astype(dt)
    k, v = (qst.values(rng, (B, kvh, S, d)).astype(dt) for _ in range(2))
    seqlens = np.array([S, 0, 1777])
    po = qst.values(rng, (B, kvh, group * L, d)).astype(dt)
    pl = (3 * rng.standard_normal((B, kvh, group * L))).astype(dt)
    pl[::2, 1, 1::2] = -np.inf
    _check_run_after(q, k, v, seqlens, threads, (po, pl))


def test_run_after_leaves_what_it_cannot_merge_to_the_caller():
    """A prior of another dtype or layout, tensors, or a NaN that makes the result not finite:
    None, nothing merged (the cascade merges the parts itself); a NaN prior lse makes the
    row NaN in the kernel, which then gives the step back (status 3). Without the native
    kernels, None for every prior."""
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 4, 1, 16)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2, 40, 16)).astype(np.float32) for _ in range(2))
    plan = qkv.plan_decode(q, k, v)
    po = rng.standard_normal((2, 2, 2, 16)).astype(np.float32)
    pl = rng.standard_normal((2, 2, 2)).astype(np.float32)
    assert (plan.run_after((po, pl), q, k, v) is not None) == bool(native.available()[0])
    assert plan.run_after((po.astype(np.float64), pl), q, k, v) is None
    assert plan.run_after((po[..., ::2], pl), q, k, v) is None  # rows not contiguous
    assert plan.run_after((po[:, :1], pl[:, :1]), q, k, v) is None  # not the plan's rows
    bad = pl.copy()
    bad[1, 0, 1] = np.nan
    assert plan.run_after((po, bad), q, k, v) is None
    torch = pytest.importorskip("torch")
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    assert qkv.plan_decode(tq, tk, tv).run_after((po, pl), tq, tk, tv) is None
