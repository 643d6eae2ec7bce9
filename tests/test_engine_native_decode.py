"""The native decode step equals qkv.reference: grouped heads, one or a few rows, runs of keys
per sequence, strided views of a larger cache, dtypes, every vector clone, both ways of
running threads; non-finite results go back to the general path; qkv.attention sends decoding
steps to it."""

from __future__ import annotations

import ctypes
import os
import select
import signal

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.conftest import bound, tol

import qkv
from qkv import reference
from qkv.engine.kernels import decode, dispatch, native, native_decode, router
from qkv.engine.kernels import threads as kernel_threads
from qkv.validate import make_plan

pytestmark = pytest.mark.skipif(
    not native_decode.available(), reason="native kernels not built (or QKV_NATIVE=0)"
)

TOL = bound("native decode")
ISAS = list(native.ISAS.values())  # capped by the CPU: a clone it cannot run falls back


def _check(out, lse, q, k, v, dtype, mask=None, **kw):
    ref, ref_lse = reference.attention(
        q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), mask=mask,
        return_lse=True, **kw,
    )  # fmt: skip
    tol = TOL[dtype]
    np.testing.assert_allclose(out, ref, rtol=tol * 10, atol=tol * 10)
    np.testing.assert_allclose(lse, ref_lse, rtol=tol * 10, atol=tol * 10)


def _runs_mask(B, S, lo, hi):
    mask = np.zeros((B, 1, 1, S), dtype=bool)
    for b in range(B):
        mask[b, 0, 0, lo[b] : hi[b]] = True
    return mask


# Not qkv.testing.strategies: the decode step's own sizes (up to 700 keys, the head sizes of
# real models, a buffer larger than the keys, per-sequence runs of keys) are the point here.
@st.composite
def problems(draw):
    B = draw(st.integers(1, 3))
    kvh = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 4, 8]))
    L = draw(st.integers(1, 3))
    S = draw(st.integers(1, 700))
    d = draw(st.sampled_from([8, 16, 24, 32, 64, 128]))
    dv = d if draw(st.booleans()) else draw(st.sampled_from([8, 40, 64]))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    capacity = S + draw(st.integers(0, 9))  # the keys: a prefix of a larger cache buffer
    runs = None
    if L == 1 and draw(st.booleans()):
        lo = [draw(st.integers(0, S - 1)) for _ in range(B)]
        runs = (lo, [draw(st.integers(a + 1, S)) for a in lo])
    softcap = draw(st.sampled_from([None, None, 0.7, 5.0, 50.0]))
    seed = draw(st.integers(0, 2**32 - 1))
    return B, kvh, group, L, S, d, dv, dtype, capacity, runs, softcap, seed


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.sampled_from([1, 2]), st.sampled_from(ISAS))
def test_step_equals_reference(problem, threads, isa):
    B, kvh, group, L, S, d, dv, dtype, capacity, runs, softcap, seed = problem
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((B, kvh * group, L, d)) * 3).astype(dtype)  # scores of a few units
    k = rng.standard_normal((B, kvh, capacity, d)).astype(dtype)[:, :, :S]
    v = rng.standard_normal((B, kvh, capacity, dv)).astype(dtype)[:, :, :S]
    lo = hi = mask = None
    if runs is not None:
        lo, hi = (np.array(r, dtype=np.int64) for r in runs)
        mask = _runs_mask(B, S, lo, hi)
    got = native_decode.step(
        q, k, v, 1 / np.sqrt(d), lo, hi, threads=threads, isa=isa, softcap=softcap
    )
    assert got is not None
    out, lse = got
    assert not np.shares_memory(out, k)
    _check(out, lse, q, k, v, dtype, mask, softcap=softcap)


# The tiles of the unrolled roads (head sizes 32, 64, 128, 256; 32 and 256 for float32 and
# bfloat16 K/V only) and the general loop's sizes around them: runs of keys about the tiles' and the
# score blocks' edges, rows left over by the row tiles (group times L odd), stored bfloat16.
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from([1, 2, 7, 8, 9, 15, 17, 63, 64, 65, 129]),
    st.sampled_from([8, 16, 24, 32, 40, 64, 96, 128, 256]),
    st.integers(1, 8),
    st.integers(1, 2),
    st.sampled_from(["float32", "bfloat16"]),
    st.sampled_from([None, 5.0]),
    st.sampled_from([1, 2]),
    st.sampled_from(ISAS),
    st.integers(0, 2**32 - 1),
)
def test_short_runs_and_small_heads_equal_reference(
    S, d, group, L, form, softcap, threads, isa, seed
):
    rng = np.random.default_rng(seed)
    kvh = 2
    q = (rng.standard_normal((2, kvh * group, L, d)) * 3).astype(np.float32)
    k, v = (rng.standard_normal((2, kvh, S, d)).astype(np.float32) for _ in range(2))
    fmt = None
    if form == "bfloat16":
        (k, _), (v, _) = qkv.quantize_kv(k, form), qkv.quantize_kv(v, form)
        fmt = form
    got = native_decode.step(
        q, k, v, 1 / np.sqrt(d), threads=threads, isa=isa, kv_format=fmt, softcap=softcap
    )
    assert got is not None
    kd, vd = (qkv.dequantize_kv(x, None, form) if fmt else x for x in (k, v))
    _check(*got, q, kd, vd, np.float32, softcap=softcap)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_soft_capping_across_the_two_forms_of_tanh(dtype):
    """Scores on both sides of |s / c| = 1/16, where the kernel's tanh changes form, and far
    out (tanh near ±1): equal to the reference's soft-capping."""
    rng = np.random.default_rng(8)
    q = rng.standard_normal((1, 2, 1, 64)).astype(dtype)
    k = rng.standard_normal((1, 1, 4000, 64)).astype(dtype)
    k *= np.geomspace(1e-4, 30, 4000, dtype=dtype)[:, None]  # scores from tiny to large
    v = rng.standard_normal((1, 1, 4000, 64)).astype(dtype)
    for c in (0.5, 4.0, 30.0):
        out, lse = native_decode.step(q, k, v, 0.125, softcap=c)
        _check(out, lse, q * 0.125, k, v, dtype, scale=1.0, softcap=c)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_long_run_split_over_threads_equals_reference(dtype):
    """Enough keys for many pieces per head: the merge of pieces is exercised."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 16, 1, 64)).astype(dtype)
    k, v = (rng.standard_normal((1, 4, 9000, 64)).astype(dtype) for _ in range(2))
    for threads in (1, 2, 3):
        out, lse = native_decode.step(q, k, v, 0.125, threads=threads)
        _check(out, lse, q * 0.125 * np.sqrt(64), k, v, dtype)


def test_outer_axes_collapse_and_a_shared_sequence_is_read_in_place():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 3, 4, 1, 16))
    k, v = (rng.standard_normal((2, 3, 2, 50, 16)) for _ in range(2))
    out, lse = native_decode.step(q, k, v, 0.25)
    ref, ref_lse = reference.attention(q, k, v, scale=0.25, return_lse=True)
    np.testing.assert_allclose(out, ref, **tol("float64 path", np.float64))
    np.testing.assert_allclose(lse, ref_lse, **tol("float64 path", np.float64))
    # a layout the kernel cannot read (the last axis strided, outer axes that do not
    # collapse) is refused, not misread
    assert native_decode.step(q, k[..., ::2], v, 0.25) is None
    assert native_decode.step(q[:, ::2], k[:, ::2], v[:, ::2], 0.25) is None
    # strided sequences that do collapse (every second one) are read in place
    out, _ = native_decode.step(q[::2], k[::2], v[::2], 0.25)
    np.testing.assert_allclose(out, ref[::2], **tol("float64 path", np.float64))


def test_an_empty_run_gives_zero_and_minus_infinity():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 4, 1, 8))
    k, v = (rng.standard_normal((2, 2, 10, 8)) for _ in range(2))
    lo, hi = np.array([0, 5], dtype=np.int64), np.array([10, 5], dtype=np.int64)
    out, lse = native_decode.step(q, k, v, 0.5, lo, hi)
    assert np.all(out[1] == 0) and np.all(np.isneginf(lse[1]))
    ref = reference.attention(q[:1], k[:1], v[:1], scale=0.5)
    np.testing.assert_allclose(out[:1], ref, **tol("float64 path", np.float64))


@pytest.mark.parametrize("d", [8, 32])  # the general loop, and head size 32's road
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1e30])
def test_infinite_nan_and_overflowing_inputs_follow_qkvs_rules(bad, d):
    """A NaN result goes back to the general path (None); whatever the step returns, auto
    decode gives the reference's numbers and NaN pattern (an overflow in float32: float64)."""
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 4, 1, d)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 20_000, d)).astype(np.float32) for _ in range(2))
    k[0, 1, 7, 3] = bad
    got = native_decode.step(q, k, v, 0.5)
    if bad != bad:
        assert got is None
    with np.errstate(invalid="ignore", over="ignore"):
        out = qkv.attention(q, k, v, scale=0.5)
        ref = reference.attention(q.astype(np.float64), k, v, scale=0.5)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(out[fin], ref[fin], **tol("float32 path", np.float32))


def test_auto_sends_a_decoding_step_here(monkeypatch):
    calls = []
    for name in ("attend", "attend_finite"):  # the step, and its short road for a plan with no mask
        real = getattr(native_decode, name)
        monkeypatch.setattr(
            native_decode,
            name,
            lambda plan, real=real, **kw: calls.append(plan) or real(plan, **kw),
        )
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 8, 1, 64)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 40_000, 64)).astype(np.float32) for _ in range(2))
    plan = make_plan(q, k, v, causal=True)  # one causal query sees every key
    assert dispatch.choose(plan).kernel == "native decode"
    out = qkv.attention(q, k, v, causal=True)
    assert len(calls) == 1
    np.testing.assert_allclose(
        out, reference.attention(q, k, v, causal=True), **tol("split keys", np.float32)
    )


def test_a_mask_of_runs_is_read_as_runs_and_any_other_mask_is_not():
    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, 4, 1, 16))
    k, v = (rng.standard_normal((2, 2, 64, 16)) for _ in range(2))
    runs = _runs_mask(2, 64, [3, 0], [64, 40])
    plan = make_plan(q, k, v, mask=runs)
    assert router.holds(router.DECODE_STEP, plan) and decode.mask_runs(plan) == [(3, 64), (0, 40)]
    out, lse = native_decode.attend(plan)
    _check(out, lse, q, k, v, np.float64, runs)
    gaps = runs.copy()
    gaps[0, 0, 0, 10] = False  # two runs: the NumPy decode kernel serves it
    plan = make_plan(q, k, v, mask=gaps)
    assert decode.mask_runs(plan) is None
    out, lse = native_decode.attend(plan)
    _check(out, lse, q, k, v, np.float64, gaps)


def test_openmp_team_of_the_process_and_fallback_after_fork(monkeypatch):
    team, threads = native_decode.openmp_parallel()
    assert threads >= 1
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, 8, 1, 32)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 5000, 32)).astype(np.float32) for _ in range(2))
    on_team = native_decode.step(q, k, v, 0.2, threads=2)
    monkeypatch.setattr(kernel_threads, "_PID", -1)  # as in a forked child: native threads
    monkeypatch.setattr(kernel_threads, "_shared", [None, None, None])
    assert native_decode.openmp_parallel()[0] is None
    native_threads = native_decode.step(q, k, v, 0.2, threads=2)
    np.testing.assert_allclose(on_team[0], native_threads[0], **tol("other threads", np.float32))


def _no_team(monkeypatch):
    """As in a process with no OpenMP runtime loaded: the library's own threads run the work."""
    monkeypatch.setattr(kernel_threads, "_PID", -1)
    monkeypatch.setattr(kernel_threads, "_shared", [None, None, None])
    assert native_decode.openmp_parallel()[0] is None


def test_kept_threads_serve_call_after_call_of_any_team_size(monkeypatch):
    """The library's kept threads (pool.h) grow to the largest team asked for and serve every
    later call, smaller or larger, each result equal to the reference."""
    _no_team(monkeypatch)
    rng = np.random.default_rng(11)
    q = rng.standard_normal((2, 8, 1, 32)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2, 3000, 32)).astype(np.float32) for _ in range(2))
    for threads in (2, 1, 4, 3, 2, 4, 1):
        for _ in range(3):  # back to back, while the kept threads still watch for work
            out, lse = native_decode.step(q, k, v, 0.2, threads=threads)
            _check(out, lse, q * 0.2 * np.sqrt(32), k, v, np.float32)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() here")
def test_a_forked_child_gets_its_own_kept_threads(monkeypatch):
    """A child forked after the parent's kept threads ran has none of them: its calls must
    start fresh ones, not wait for threads that do not exist there (a hang, caught here by a
    timeout), and give the parent's numbers."""
    _no_team(monkeypatch)
    rng = np.random.default_rng(13)
    q = rng.standard_normal((1, 8, 1, 32)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 4000, 32)).astype(np.float32) for _ in range(2))
    want, _ = native_decode.step(q, k, v, 0.2, threads=2)  # the parent's pool is running
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: compute, send, leave without running the parent's atexit
        code = 1
        try:
            out, _ = native_decode.step(q, k, v, 0.2, threads=2)
            out, _ = native_decode.step(q, k, v, 0.2, threads=2)
            os.write(write, np.ascontiguousarray(out, dtype=np.float32).tobytes())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], 60)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            pytest.fail("the forked child's native call did not finish in 60 s")
        got = b""
        while chunk := os.read(read, 1 << 16):
            got += chunk
    finally:
        os.close(read)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    np.testing.assert_array_equal(np.frombuffer(got, dtype=np.float32).reshape(want.shape), want)


def test_with_torch_imported_the_team_is_pytorchs():
    torch = pytest.importorskip("torch")
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("the loaded libraries are read from /proc")
    kernel_threads._shared[:] = [None, None, None]
    team, threads = native_decode.openmp_parallel()
    assert threads <= torch.get_num_threads()
    if team is not None:  # PyTorch built with an OpenMP runtime: its GOMP_parallel
        path = kernel_threads._openmp_library(kernel_threads._torch_dir(torch))
        assert path is not None
        assert ctypes.cast(ctypes.CDLL(path).GOMP_parallel, ctypes.c_void_p).value == team


@pytest.mark.parametrize("team", [True, False], ids=["openmp team", "kept threads"])
def test_calls_from_several_python_threads_at_once(team, monkeypatch):
    """ctypes releases the GIL: each Python thread's call runs a team at the same time (the
    process's OpenMP team, or with none, the library's kept threads for one call and threads
    of their own for the others), and every result equals the reference."""
    from concurrent.futures import ThreadPoolExecutor

    if not team:
        _no_team(monkeypatch)
    rng = np.random.default_rng(9)
    problems = []
    for i in range(6):
        q = rng.standard_normal((2, 8, 1, 32)).astype(np.float32)
        k, v = (rng.standard_normal((2, 2, 3000 + 100 * i, 32)).astype(np.float32) for _ in "kv")
        problems.append((q, k, v))
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda p: native_decode.step(*p, 0.3, threads=2), problems * 3))
    for (q, k, v), (out, lse) in zip(problems * 3, results, strict=True):
        _check(out, lse, q * 0.3 * np.sqrt(32), k, v, np.float32)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    B=st.integers(1, 3),
    kvh=st.integers(1, 3),
    group=st.integers(1, 4),
    L=st.integers(1, 8),
    S=st.integers(1, 70),
    d=st.sampled_from([1, 3, 8, 64]),
    dv=st.sampled_from([1, 5, 64]),
    dtype=st.sampled_from([np.float32, np.float64]),
    form=st.sampled_from(["contiguous", "q heads-last", "k broadcast", "k reversed", "sliced"]),
    seed=st.integers(0, 2**16),
)
def test_the_small_call_road_reads_every_layout_or_steps_aside(
    B, kvh, group, L, S, d, dv, dtype, form, seed
):
    """The short road of an unmasked step (its constants kept per shape and strides) gives
    the reference's numbers for views of every kind: transposed, broadcast over the batch,
    a reversed axis (which it cannot read: the general step runs) and slices of a larger
    buffer, each shape run twice so that the kept constants are used."""
    rng = np.random.default_rng(seed)
    H = kvh * group
    q = rng.standard_normal((B, H, L, d)).astype(dtype)
    k = rng.standard_normal((B, kvh, S, d)).astype(dtype)
    v = rng.standard_normal((B, kvh, S, dv)).astype(dtype)
    if form == "q heads-last":
        q = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    elif form == "k broadcast":
        k, v = k[:1], v[:1]
    elif form == "k reversed":
        k = k[:, :, ::-1]
    elif form == "sliced":
        big = rng.standard_normal((B, kvh, S + 7, d + 2)).astype(dtype)
        k = big[:, :, 3 : 3 + S, 1 : 1 + d]
    plan = make_plan(q, k, v)
    assert dispatch.choose(plan).kernel == "native decode"
    kb, vb = np.broadcast_to(k, (B, kvh, S, d)), np.broadcast_to(v, (B, kvh, S, dv))
    for _ in range(2):
        out, lse = qkv.attention(q, k, v, return_lse=True)
        _check(out, lse, q, kb, vb, np.dtype(dtype))


def test_the_small_call_road_hands_a_result_that_is_not_finite_to_the_general_rules():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 4, 1, 16)).astype(np.float32) for _ in range(3))
    q[0, 1, 0, 2] = np.inf  # head 1's scores are not finite; the others are
    out = qkv.attention(q, k, v)
    want = qkv.attention(q, k, v, kernel="dense")
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    fin = ~np.isnan(want)
    np.testing.assert_allclose(out[fin], want[fin], **tol("fast path", np.float32))
    big = (rng.standard_normal((1, 4, 1, 16)) * 1e19).astype(np.float32)  # scores overflow
    out = qkv.attention(big, big, v)
    ref = reference.attention(*(x.astype(np.float64) for x in (big, big, v)))
    np.testing.assert_allclose(out, ref, **tol("fast path", np.float32))


@settings(max_examples=60, deadline=None)
@given(
    batch=st.sampled_from([(), (1,), (2,), (2, 3)]),
    kvh=st.integers(1, 3),
    group=st.integers(1, 4),
    L=st.integers(1, 3),
    d=st.sampled_from([8, 32, 64]),
    dv=st.sampled_from([8, 64]),
    room=st.integers(1, 600),
    keys=st.lists(st.integers(0, 600), min_size=2, max_size=4),
    dtype=st.sampled_from(["float32", "float64", "float16", "bfloat16"]),
    contiguous=st.booleans(),
)
def test_step_arguments_for_a_growing_slice_equal_built_ones(
    batch, kvh, group, L, d, dv, room, keys, dtype, contiguous
):
    """The decode step's arguments for slices of one buffer with other numbers of keys (a
    decoding loop's growing cache) are derived from the first slice's by setting S: they equal,
    byte for byte, those built afresh; contiguous operands (other strides) are built."""
    kt = np.dtype(pytest.importorskip("ml_dtypes").bfloat16 if dtype == "bfloat16" else dtype)
    dt = np.dtype(np.float32) if kt.itemsize == 2 else kt
    qt = kt if kt.itemsize == 2 else dt
    q = np.zeros((*batch, kvh * group, L, d), qt)
    kbuf = np.zeros((*batch, kvh, max(keys) + room, d), kt)
    vbuf = np.zeros((*batch, kvh, max(keys) + room, dv), kt)
    native_decode._constants.cache_clear()
    native_decode._FAMILIES.clear()
    for S in keys:
        k, v = kbuf[..., :S, :], vbuf[..., :S, :]
        if contiguous:
            k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
        args = (qt, kt, q.shape, q.strides, k.shape, k.strides, v.shape, v.strides, 0.125, None,
                0, False)  # fmt: skip
        got = native_decode._constants(*args)
        assert got == native_decode._built(*args)
    assert len(native_decode._FAMILIES) <= (len(set(keys)) if contiguous else 1)
