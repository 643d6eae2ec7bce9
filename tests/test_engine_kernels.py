"""Every kernel equals qkv.reference: tile-edge sizes, causal, windows, masks, GQA, dtypes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.conftest import bound

import qkv
from qkv import reference
from qkv.engine.kernels import decode, dispatch, tiled
from qkv.validate import make_plan

# Tolerances against the float64 reference, relative to the values' size.
TOL = bound("kernels")


def check(out, lse, q, k, v, dtype=np.float64, **kw):
    """Assert (out, lse) equal the reference on the dtype-rounded inputs."""
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
    tol = TOL[dtype]
    scale = max(1.0, float(np.max(np.abs(v)))) if np.size(v) else 1.0
    np.testing.assert_allclose(out, ref_out, rtol=tol, atol=tol * scale)
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=tol, atol=tol)


def rand(rng, shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)


# Sizes around the tiles used below (block_q=4, block_k=8): 1, tile-1, tile+1, odd primes.
SIZES = [1, 3, 5, 7, 9, 13, 17]
STRUCTURE = [
    dict(),
    dict(causal=True),
    dict(window=(2, 1)),
    dict(window=(0, None)),
    dict(causal=True, window=(3, None)),
]


@pytest.mark.parametrize("L, S", [(L, S) for L in SIZES for S in SIZES if (L + S) % 2 == 0])
@pytest.mark.parametrize("kw", STRUCTURE, ids=str)
def test_tiled_equals_reference_at_tile_edges(L, S, kw):
    rng = np.random.default_rng(L * 100 + S)
    q, k, v = rand(rng, (2, 4, L, 6)), rand(rng, (2, 2, S, 6)), rand(rng, (2, 2, S, 3))
    out, lse = tiled.attend(make_plan(q, k, v, **kw), block_q=4, block_k=8)
    check(out, lse, q, k, v, **kw)


@pytest.mark.parametrize("L", [1, 2, 3, 16])
@pytest.mark.parametrize("S", [1, 8, 13, 2053])
@pytest.mark.parametrize("kw", STRUCTURE, ids=str)
def test_decode_equals_reference(L, S, kw):
    rng = np.random.default_rng(L * 7 + S)
    q, k, v = rand(rng, (1, 4, L, 6)), rand(rng, (1, 2, S, 6)), rand(rng, (1, 2, S, 5))
    out, lse = decode.attend(make_plan(q, k, v, **kw))
    check(out, lse, q, k, v, **kw)


def test_decode_splits_keys_when_heads_are_few(monkeypatch):
    monkeypatch.setattr(decode, "MIN_SPLIT", 8)
    monkeypatch.setattr(decode, "PARALLEL_BYTES", 0)
    rng = np.random.default_rng(3)
    q, k, v = rand(rng, (1, 1, 1, 4)), rand(rng, (1, 1, 101, 4)), rand(rng, (1, 1, 101, 2))
    plan = make_plan(q, k, v, window=(50, None))
    items = decode._Problem(plan).items(threads=4)
    assert len(items) == 4 and len({it[3] for it in items}) == 4  # four key ranges
    out, lse = decode.attend(plan, threads=4)
    check(out, lse, q, k, v, window=(50, None))


@pytest.mark.parametrize("kernel", ["dense", "tiled", "decode"])
@pytest.mark.parametrize("mask_kind", ["bool", "float", "bool+causal", "float+window"])
def test_masks(kernel, mask_kind):
    rng = np.random.default_rng(11)
    L, S = (2, 23) if kernel == "decode" else (11, 23)
    q, k, v = rand(rng, (2, 2, L, 4)), rand(rng, (2, 2, S, 4)), rand(rng, (2, 2, S, 3))
    kw = {}
    if mask_kind.startswith("bool"):
        kw["mask"] = rng.random((2, 1, L, S)) > 0.4
        kw["mask"][0, 0, 0] = False  # one row that may attend nothing
    else:
        kw["mask"] = rand(rng, (L, S)) * 3
        kw["mask"][0, :5] = -np.inf
    if "causal" in mask_kind:
        kw["causal"] = True
    if "window" in mask_kind:
        kw["window"] = (4, 2)
    out, lse = qkv.attention(q, k, v, kernel=kernel, return_lse=True, **kw)
    check(out, lse, q, k, v, **kw)
    if mask_kind == "bool":
        assert np.all(out[0, :, 0] == 0) and np.all(np.isneginf(lse[0, :, 0]))


@pytest.mark.parametrize("kernel", ["dense", "tiled", "decode"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_dtypes(kernel, dtype):
    rng = np.random.default_rng(5)
    L = 3 if kernel == "decode" else 37
    q, k, v = (
        rand(rng, (2, L, 8), dtype),
        rand(rng, (2, 41, 8), dtype),
        rand(rng, (2, 41, 5), dtype),
    )
    out, lse = qkv.attention(q, k, v, causal=True, kernel=kernel, return_lse=True)
    assert out.dtype == dtype
    check(out.astype(np.float64), lse, q, k, v, dtype=dtype, causal=True)


@pytest.mark.parametrize("kernel", ["tiled", "decode"])
def test_float16_dot_products_beyond_65504_do_not_overflow(kernel):
    q = np.full((1, 4), 200.0, dtype=np.float16)  # q·k = 160000 > float16 max
    k = np.array([[200.0] * 4, [199.0] * 4, [-200.0] * 4], dtype=np.float16)
    v = np.array([[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]], dtype=np.float16)
    out = qkv.attention(q, k, v, scale=1.0, kernel=kernel)
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(
        out.astype(float),
        reference.attention(q, k, v, scale=1.0),
        atol=bound("rounded once", np.float16),
    )


@pytest.mark.parametrize("kernel", ["tiled", "decode"])
def test_large_logits_and_large_values(kernel):
    rng = np.random.default_rng(8)
    L = 2 if kernel == "decode" else 30
    q, k = rand(rng, (L, 8), np.float32) * 40, rand(rng, (50, 8), np.float32) * 40
    v = rand(rng, (50, 3), np.float32) * 1e30
    out, lse = qkv.attention(q, k, v, causal=True, kernel=kernel, return_lse=True)
    assert np.all(np.isfinite(out))
    check(out / 1e30, lse, q, k, v / 1e30, dtype=np.float32, causal=True)


@pytest.mark.parametrize("tau", [0.0, 1.0])
def test_tiled_running_max_rescales_exactly(monkeypatch, tau):
    """Keys whose scores grow block by block force the offset to move (and rescale) often."""
    monkeypatch.setattr(tiled, "TAU", tau)
    rng = np.random.default_rng(9)
    q = rand(rng, (1, 20, 4)) * 3
    k = rand(rng, (1, 40, 4)) * np.linspace(0.1, 6, 40)[:, None]
    v = rand(rng, (1, 40, 2))
    for kw in (dict(), dict(causal=True), dict(window=(5, 5))):
        out, lse = tiled.attend(make_plan(q, k, v, **kw), block_q=3, block_k=4)
        check(out, lse, q, k, v, **kw)


SIZES = [(3, 50), (50, 3), (1, 1), (256, 255), (255, 1025), (257, 1023)]


# decode keeps L x S scores and is meant for few queries, so it only gets the small-L sizes
@pytest.mark.parametrize(
    "L, S, kernel",
    [
        (L, S, kern)
        for L, S in SIZES
        for kern in ("tiled", "decode", "auto")
        if kern != "decode" or L <= 16
    ],
)
def test_default_tiles_and_l_versus_s(L, S, kernel):
    rng = np.random.default_rng(L + S)
    q, k, v = rand(rng, (L, 4)), rand(rng, (S, 4)), rand(rng, (S, 4))
    for causal in (False, True):
        out, lse = qkv.attention(q, k, v, causal=causal, kernel=kernel, return_lse=True)
        check(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("kernel", ["tiled", "decode"])
def test_broadcast_batches_and_1d_query(kernel):
    rng = np.random.default_rng(12)
    q, k, v = rand(rng, (3, 1, 2, 6)), rand(rng, (4, 9, 6)), rand(rng, (1, 9, 2))
    check(*qkv.attention(q, k, v, kernel=kernel, return_lse=True), q, k, v)
    q1 = rand(rng, (6,))
    out, lse = qkv.attention(q1, k[0], v[0], kernel=kernel, return_lse=True)
    assert out.shape == (2,) and lse.shape == ()
    check(out, lse, q1, k[0], v[0])


@pytest.mark.parametrize("kernel", ["tiled", "decode", "dense", "auto"])
def test_no_keys_gives_zeros(kernel):
    out, lse = qkv.attention(
        np.ones((2, 3)), np.ones((0, 3)), np.ones((0, 2)), kernel=kernel, return_lse=True
    )
    assert np.all(out == 0) and np.all(np.isneginf(lse))


@pytest.mark.parametrize("kernel", ["tiled", "decode"])
def test_nan_propagates_to_its_rows_only(kernel):
    q, k, v = np.ones((4, 3)), np.ones((6, 3)), np.ones((6, 2))
    q[1, 0] = np.nan
    out = qkv.attention(q, k, v, kernel=kernel)
    assert np.all(np.isnan(out[1])) and np.all(out[[0, 2, 3]] == 1.0)


def test_dispatch_choices_and_forcing():
    def plan(L, S):
        return make_plan(np.ones((L, 8)), np.ones((S, 8)), np.ones((S, 8)))

    assert dispatch.choose(plan(8, 8)).name == "dense"
    assert dispatch.choose(plan(1, 100_000)).name == "dense"  # 12 MiB of K/V: cache-sized
    assert dispatch.choose(plan(1, 200_000)).name == "decode"
    assert dispatch.choose(plan(dispatch.DECODE_MAX_L, 200_000)).name == "decode"
    assert dispatch.choose(plan(dispatch.DECODE_MAX_L + 1, 200_000)).name == "tiled"
    assert dispatch.choose(plan(1000, 1000)).name == "tiled"
    with pytest.raises(qkv.InputError, match="kernel"):
        qkv.attention(np.ones(2), np.ones((1, 2)), np.ones((1, 2)), kernel="fast")
    with pytest.raises(qkv.InputTypeError, match="kernel"):
        qkv.attention(np.ones(2), np.ones((1, 2)), np.ones((1, 2)), kernel=3)


def test_seed_case_through_every_kernel():
    # The seed case "seed-full": q = [2, 1], K = [[1, 0], [3, 2]], V = [[1, 2], [3, 4]], d = 4.
    expected = [2.905148253644867, 3.905148253644867]
    for kernel in ("dense", "tiled", "decode"):
        out = qkv.attention(
            [2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4]], scale=4**-0.5, kernel=kernel
        )
        np.testing.assert_allclose(out, expected, rtol=bound("float64 path", np.float64))


@settings(max_examples=60, deadline=None)
@given(
    L=st.integers(1, 12),
    S=st.integers(1, 12),
    group=st.sampled_from([1, 2, 3]),
    causal=st.booleans(),
    left=st.one_of(st.none(), st.integers(0, 5)),
    right=st.one_of(st.none(), st.integers(0, 5)),
    bq=st.integers(1, 6),
    bk=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_tiled_property(L, S, group, causal, left, right, bq, bk, seed):
    rng = np.random.default_rng(seed)
    q, k, v = rand(rng, (2 * group, L, 3)), rand(rng, (2, S, 3)), rand(rng, (2, S, 2))
    kw = dict(causal=causal, window=(left, right))
    out, lse = tiled.attend(make_plan(q[None], k[None], v[None], **kw), block_q=bq, block_k=bk)
    check(out[0], lse[0], q, k, v, **kw)
    if L <= 4:
        out, lse = decode.attend(make_plan(q, k, v, **kw))
        check(out, lse, q, k, v, **kw)


def test_all_kernels_agree_on_a_grid():
    rng = np.random.default_rng(13)
    for L, S, causal in itertools.product([1, 4], [6, 31], [False, True]):
        q, k, v = rand(rng, (2, L, 5)), rand(rng, (2, S, 5)), rand(rng, (2, S, 4))
        outs = [
            qkv.attention(q, k, v, causal=causal, kernel=n) for n in ("dense", "tiled", "decode")
        ]
        np.testing.assert_allclose(outs[1], outs[0], atol=bound("float64 path", np.float64))
        np.testing.assert_allclose(outs[2], outs[0], atol=bound("float64 path", np.float64))


def test_threads_fall_back_to_one_when_blas_cannot_be_limited(monkeypatch):
    import threading

    from qkv.engine.kernels import threads

    monkeypatch.setattr(threads, "_controller", [None])  # as if threadpoolctl were missing
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    here = threading.get_ident()
    assert set(threads.parallel_map(lambda _: threading.get_ident(), range(8), 2)) == {here}
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    assert threads.blas_limitable()
    # the results do not depend on how the work was spread
    rng = np.random.default_rng(14)
    q, k, v = rand(rng, (3, 40, 4)), rand(rng, (3, 40, 4)), rand(rng, (3, 40, 4))
    out, lse = tiled.attend(make_plan(q, k, v, causal=True), block_q=7, block_k=9, threads=2)
    check(out, lse, q, k, v, causal=True)


def test_parallel_map_keeps_order_uses_the_caller_and_raises_a_workers_error():
    import threading
    import time

    from qkv.engine.kernels import threads

    here = threading.get_ident()

    def slow(x):
        time.sleep(0.002)
        return x * x, threading.get_ident()

    got = threads.parallel_map(slow, range(12), 2, blas_heavy=False)
    assert [r for r, _ in got] == [x * x for x in range(12)]
    who = {t for _, t in got}
    assert here in who and len(who) == 2  # the caller works beside one pool thread

    def boom(x):
        if x == 5:
            raise ValueError("item 5")
        return x

    with pytest.raises(ValueError, match="item 5"):
        threads.parallel_map(boom, range(12), 2)
    # the NumPy error state of the caller holds in every worker
    with np.errstate(divide="raise"):
        with pytest.raises(FloatingPointError):
            threads.parallel_map(lambda x: np.float64(1) / np.float64(x), [1, 2, 0, 3], 2)


def test_blas_held_to_one_thread_only_for_blas_work():
    threadpoolctl = pytest.importorskip("threadpoolctl")

    from qkv.engine.kernels import threads

    def blas_threads(_):
        infos = threadpoolctl.threadpool_info()
        return [i["num_threads"] for i in infos if i["user_api"] == "blas"]

    threads.rescan_blas()  # BLAS libraries other tests may have loaded since the last scan
    before = blas_threads(None)
    if not before:
        pytest.skip("no BLAS library that threadpoolctl sees")
    assert threads.parallel_map(blas_threads, [0, 1], 2) == [[1] * len(before)] * 2
    assert threads.parallel_map(blas_threads, [0, 1], 2, blas_heavy=False) == [before] * 2
    assert blas_threads(None) == before  # restored


def test_dispatch_sends_the_decode_workload_to_decode():
    # B8 H32 S4096 d128, one query each: 1 GiB of K/V, but only 4096 scores per head.
    q = np.broadcast_to(np.float32(0), (8, 32, 1, 128))
    kv = np.broadcast_to(np.float32(0), (8, 32, 4096, 128))
    assert dispatch.choose(make_plan(q, kv, kv, causal=True)).name == "decode"


@pytest.mark.parametrize("cache_bytes", [0, 1 << 30])
def test_tiled_values_copied_per_tile_or_kept_per_head(monkeypatch, cache_bytes):
    monkeypatch.setattr(tiled, "VALUES_CACHE", cache_bytes)
    rng = np.random.default_rng(15)
    q, k, v = rand(rng, (2, 4, 29, 5)), rand(rng, (2, 2, 31, 5)), rand(rng, (2, 2, 31, 3))
    for kw in (dict(causal=True), dict(window=(3, 2)), dict()):
        out, lse = tiled.attend(make_plan(q, k, v, **kw), block_q=6, block_k=7)
        check(out, lse, q, k, v, **kw)


def test_decode_caps_keys_per_item_and_merges(monkeypatch):
    monkeypatch.setattr(decode, "MAX_KEYS", 100)
    rng = np.random.default_rng(16)
    q, k, v = rand(rng, (2, 4, 1, 6)), rand(rng, (2, 2, 1001, 6)), rand(rng, (2, 2, 1001, 3))
    plan = make_plan(q, k, v, window=(700, None))
    assert len({it[3] for it in decode._Problem(plan).items(threads=1)}) == 8  # 701 keys / 100
    check(*decode.attend(plan), q, k, v, window=(700, None))
