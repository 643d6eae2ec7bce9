"""Decode kernel: a few queries against a long K/V, streamed once at memory speed.

Must equal :func:`qkv.reference.attention`. With ``L`` small the work is memory-bound: every
key and value is read once, and the score rows (``L · S`` numbers per head) are small enough to
keep whole, so the softmax is exact in one piece — no running max is needed.

Work items are a batch index with a run of kv heads and a range of keys. Grouped-query heads
stack their ``group · L`` queries against their kv head, so K/V are read once per kv head.
When the batch and heads are too few to keep every core busy, the keys are split instead and
the partial results are combined with :func:`qkv.engine.merge.merge` (split-K, as in FlashDecoding).
Only the keys that causal or a window leave visible are read.

With Numba installed (``qkv[jit]``, not switched off by ``QKV_JIT=0``) a plan with no mask,
bias or score-changing variant runs the compiled kernel (:mod:`qkv.engine.kernels.jit.decode`) on
the same work items: one pass over each kv head's keys and values in cache-sized blocks for all the
group's query rows, instead of a skinny GEMM that BLAS runs far below the read rate. Other
plans, and every plan without Numba, run the NumPy kernel here; both equal the reference.
"""

from __future__ import annotations

import math
import os
from typing import Any, NamedTuple, TypeVar

import numpy as np

from ...masks import allowed, key_bounds, key_range, query_positions
from ...validate import Plan
from . import mods
from .blocks import finish, merge_arrays
from .router import compiled_decode, compiled_team
from .threads import parallel_map, team_preferred, workers

__all__ = [
    "ITEM_BYTES",
    "MIN_SPLIT",
    "KeyRuns",
    "attend",
    "attend_many",
    "key_runs",
    "mask_runs",
    "plan_runs",
]

ITEM_BYTES = 32 << 20  # K/V bytes per work item: large enough to hide Python's overhead
PARALLEL_BYTES = 4 << 20  # below this much K/V, threads cost more than they save
MIN_SPLIT = 1024  # fewest keys worth a split of their own
MAX_KEYS = 32768  # keys per item at most: long sums lose precision, and merging halves the error
# The compiled kernel costs microseconds per call, so its items can be smaller: more of them
# keep both cores busy to the end when the sequences (a ragged cache) differ in length.
JIT_ITEM_BYTES = 8 << 20

Item = tuple[tuple[int, ...], int, int, int, int]


_A = TypeVar("_A", np.ndarray, None)


def _heads(x: _A, nbatch: int) -> _A:
    """View with an explicit heads axis at -3 (a plan with no batch gets one head)."""
    if x is None or nbatch:
        return x
    return x[None]


class _Problem:
    def __init__(self, plan: Plan) -> None:
        nb = len(plan.batch)
        assert plan.v is not None  # decode computes outputs: its plans carry values
        self.plan = plan
        self.dt = plan.acc_dtype
        self.g, self.L, self.S = plan.group, plan.L, plan.S
        self.q, self.k, self.v = (_heads(a, nb) for a in (plan.q, plan.k, plan.v))
        full = plan.batch + (plan.L, plan.S)
        self.mask = None if plan.mask is None else _heads(np.broadcast_to(plan.mask, full), nb)
        self.bias = None if plan.bias is None else _heads(np.broadcast_to(plan.bias, full), nb)
        self.outer = self.q.shape[:-3]
        self.kv_heads = self.k.shape[-3]
        # Keys any query row may see, and those every row sees (no edge mask needed there).
        p = plan.S - plan.L
        (self.lo, self.inner_hi), (self.inner_lo, self.hi) = (
            key_range(p, plan.S, plan.causal, plan.window),
            key_range(p + plan.L - 1, plan.S, plan.causal, plan.window),
        )
        if not plan.structured:
            self.inner_lo, self.inner_hi = self.lo, self.hi
        self.jit = compiled_decode(plan)  # the router decides
        # Each query row's own key range (the compiled kernel masks by it, row by row).
        self.row_lo, self.row_hi = key_bounds(
            query_positions(plan.L, plan.S), plan.S, plan.causal, plan.window
        )
        self.out = np.zeros(plan.batch + (plan.L, plan.dv), dtype=self.dt)
        self.lse = np.full(plan.batch + (plan.L,), -np.inf, dtype=self.dt)

    def items(self, threads: int) -> list[Item]:
        """Split heads, then keys, into items of about ``ITEM_BYTES`` and at least ``threads``."""
        plan = self.plan
        keys = self.hi - self.lo
        per_head = keys * (plan.d + plan.dv) * self.dt.itemsize
        n_outer = math.prod(self.outer)
        if n_outer * self.kv_heads * per_head < PARALLEL_BYTES:
            threads = 1
        budget = JIT_ITEM_BYTES if self.jit else ITEM_BYTES
        heads = max(1, min(self.kv_heads, budget // max(per_head, 1)))
        chunks = n_outer * -(-self.kv_heads // heads)
        while chunks < threads and heads > 1:
            heads = -(-heads // 2)
            chunks = n_outer * -(-self.kv_heads // heads)
        splits = 1
        if chunks < threads:
            splits = max(1, min(-(-threads // chunks), keys // MIN_SPLIT))
        splits = max(splits, -(-keys // MAX_KEYS))
        step = -(-keys // splits)
        return [
            (outer, h0, min(h0 + heads, self.kv_heads), c0, min(c0 + step, self.hi))
            for outer in np.ndindex(*self.outer)
            for h0 in range(0, self.kv_heads, heads)
            for c0 in range(self.lo, self.hi, step)
        ]

    def run(self, item: Item) -> tuple[np.ndarray, np.ndarray]:
        """Normalised output ``(nh, g·L, dv)`` and lse ``(nh, g·L)`` over keys ``[c0, c1)``."""
        if self.jit:
            return self._run_jit(item)
        outer, h0, h1, c0, c1 = item
        plan, dt, g, L = self.plan, self.dt, self.g, self.L
        nh, rows = h1 - h0, self.g * self.L
        k = self.k[outer][h0:h1, c0:c1]
        v = self.v[outer][h0:h1, c0:c1]
        q = (self.q[outer][h0 * g : h1 * g] * dt.type(plan.scale)).reshape(nh, rows, plan.d)
        # One query row per head is BLAS's matrix-vector product, which streams K and V at
        # close to memory speed (measured 29 GB/s of 32, where einsum reached 23); more rows
        # make the skinny GEMMs that the compiled kernel replaces when it can.
        s = q @ k.transpose(0, 2, 1)
        per_query = s.reshape(nh * g, L, c1 - c0)
        if plan.modded:  # soft-cap, ALiBi, score_mod, mask_mod: this item's heads and keys
            sel = outer + (slice(h0 * g, h1 * g),) if plan.batch else ()
            qi = query_positions(L, self.S)[:, None]
            mods.apply(plan, per_query, sel, qi, np.arange(c0, c1)[None, :])
        if self.bias is not None:
            per_query += self.bias[outer][h0 * g : h1 * g, :, c0:c1]
        if plan.structured and (c0 < self.inner_lo or c1 > self.inner_hi):
            ok = allowed(self.L, self.S, causal=plan.causal, window=plan.window, cols=range(c0, c1))
            assert ok is not None  # plan.structured: causal or windowed, so a tile comes back
            np.copyto(per_query, -np.inf, where=~ok)  # not += -inf: inf + -inf is NaN
        if self.mask is not None:
            per_query[~self.mask[outer][h0 * g : h1 * g, :, c0:c1]] = -np.inf
        m = s.max(axis=-1)
        m_safe = np.where(np.isneginf(m), dt.type(0), m)
        s -= m_safe[..., None]
        np.exp(s, out=s)
        denom = s.sum(axis=-1)
        o = s @ v
        return finish(o, denom, m_safe)  # a row with no key here: output 0, lse -inf

    def _run_jit(self, item: Item) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`run` by the compiled kernel, one call per kv head."""
        from .jit import decode as compiled

        outer, h0, h1, c0, c1 = item
        plan, dt, g, L = self.plan, self.dt, self.g, self.L
        nh, rows, n = h1 - h0, g * L, c1 - c0
        q = self.q[outer][h0 * g : h1 * g] * dt.type(plan.scale)
        q = np.ascontiguousarray(q.reshape(nh, rows, plan.d))
        lo = np.clip(self.row_lo - c0, 0, n)
        hi = np.clip(self.row_hi - c0, 0, n)
        o = np.empty((nh, rows, plan.dv), dtype=dt)
        lse = np.empty((nh, rows), dtype=dt)
        for i in range(nh):
            # Rows of one head are contiguous in any C-ordered K/V (a KVCache too); anything
            # else is copied piecewise, so only C-ordered arrays are ever compiled for.
            k = np.ascontiguousarray(self.k[outer][h0 + i, c0:c1])
            v = np.ascontiguousarray(self.v[outer][h0 + i, c0:c1])
            compiled.head(q[i], k, v, lo, hi, L, o[i], lse[i])
        return o, lse

    def store(self, item: Item, o: np.ndarray, lse: np.ndarray) -> None:
        outer, h0, h1 = item[:3]
        g, L = self.g, self.L
        out = _heads(self.out, len(self.plan.batch))[outer]
        lse_all = _heads(self.lse, len(self.plan.batch))[outer]
        out[h0 * g : h1 * g] = o.reshape((h1 - h0) * g, L, -1)
        lse_all[h0 * g : h1 * g] = lse.reshape((h1 - h0) * g, L)


def attend(
    plan: Plan, *, threads: int | None = None, found: tuple[KeyRuns | None, ...] = ()
) -> tuple[np.ndarray, np.ndarray]:
    """Decode attention: output ``(*batch, L, dv)`` and lse ``(*batch, L)``, compute dtype.

    Must equal :func:`qkv.reference.attention` on the same plan. Meant for small ``L`` (each
    row of scores is kept whole: extra memory about ``L · S`` numbers per head in flight).

    Parameters
    ----------
    plan : Plan
        A checked problem from :func:`qkv.validate.make_plan`.
    threads : int, optional
        Worker threads (default: as :func:`~qkv.engine.kernels.threads.workers` decides).
    found : tuple, optional
        ``(runs,)``: the plan's mask already read by :func:`plan_runs` (a caller that tried
        another kernel first), so that it is not read again; ``()`` (default): read here.

    Examples
    --------
    >>> import numpy as np
    >>> from qkv import reference, validate
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 4, 1, 8))          # batch 2, 4 query heads, one token
    >>> k, v = rng.standard_normal((2, 2, 2, 50, 8))    # 2 kv heads, 50 cached tokens
    >>> out, lse = attend(validate.make_plan(q, k, v, causal=True))
    >>> bool(np.allclose(out, reference.attention(q, k, v, causal=True)))
    True
    """
    n = workers(threads)
    if team_preferred():
        done = _team_single(plan, n, found)
        if done is not None:
            return done
    return _attend_many([plan], n)[0]


def attend_many(
    plans: list[Plan], *, threads: int | None = None
) -> list[tuple[np.ndarray, np.ndarray]]:
    """:func:`attend` on several plans at once, their work items sharing one pool of threads.

    For a batch of sequences of different lengths (a KV cache): one plan per length, and one
    parallel pass over every sequence's heads and key ranges, so no sequence waits for another
    to finish and the cores stay busy even where one sequence alone has too few heads.

    Examples
    --------
    >>> import numpy as np
    >>> from qkv import reference, validate
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((4, 1, 8))
    >>> kv = [rng.standard_normal((2, 2, n, 8)) for n in (30, 70)]
    >>> outs = attend_many([validate.make_plan(q, k, v) for k, v in kv])
    >>> all(np.allclose(o, reference.attention(q, k, v)) for (o, _), (k, v) in zip(outs, kv))
    True
    """
    if len(plans) == 1:
        return [attend(plans[0], threads=threads)]
    return _attend_many(plans, workers(threads))


def _attend_many(plans: list[Plan], n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """:func:`attend_many` on ``n`` threads, by the work items of every plan."""
    probs = [_Problem(plan) for plan in plans]
    work = [
        (i, item)
        for i, prob in enumerate(probs)
        if prob.plan.L and prob.hi > prob.lo and math.prod(prob.plan.batch)
        for item in prob.items(n)
    ]
    # Largest items first: the last ones to finish are then small, and both cores stay busy.
    work.sort(key=lambda w: -(w[1][2] - w[1][1]) * (w[1][4] - w[1][3]) * probs[w[0]].g)
    # BLAS products (not the compiled kernel): one BLAS thread per worker
    heavy = any(not p.jit for p in probs)
    results = _on_team(probs, work, n) if not heavy and team_preferred() else None
    if results is None:
        results = parallel_map(lambda w: probs[w[0]].run(w[1]), work, n, blas_heavy=heavy)
    pending: dict[tuple[Any, ...], list[tuple[Item, np.ndarray, np.ndarray]]] = {}
    for (i, item), (o, lse) in zip(work, results, strict=True):
        pending.setdefault((i, *item[:2]), []).append((item, o, lse))
    for (i, *_), parts in pending.items():
        if len(parts) == 1:
            probs[i].store(*parts[0])
        else:
            o, lse = merge_arrays([(o, lse) for _, o, lse in parts])
            probs[i].store(parts[0][0], o, lse)
    return [(prob.out, prob.lse) for prob in probs]


def _rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``a (..., n, m)`` as one C-ordered ``(rows, m)`` array over its memory, and the row of
    each ``a[..., 0, :]`` (shape ``a.shape[:-2]``); None unless every ``a[i]`` is C-ordered
    rows within that memory (any cache's K/V, and views of a prefix of it, are)."""
    it, m = a.itemsize, a.shape[-1]
    row = m * it
    if a.size == 0 or a.ndim < 2 or a.strides[-1] != it or a.strides[-2] != row:
        return None
    if a.flags.c_contiguous:  # the common case, in two cheap steps
        n = a.shape[-2]
        return a.reshape(-1, m), np.arange(0, a.size // m, n, dtype=np.int64).reshape(a.shape[:-2])
    if any(st < 0 or st % row for st in a.strides[:-2]):
        return None
    span = 1 + sum((n - 1) * st for n, st in zip(a.shape[:-1], a.strides[:-1], strict=True)) // row
    flat = np.lib.stride_tricks.as_strided(a, shape=(span, m), strides=(row, it), writeable=False)
    starts = np.zeros(a.shape[:-2], dtype=np.int64)
    for axis, (n, st) in enumerate(zip(a.shape[:-2], a.strides[:-2], strict=True)):
        shape = [1] * starts.ndim
        shape[axis] = n
        starts = starts + (np.arange(n, dtype=np.int64) * (st // row)).reshape(shape)
    return flat, starts


# (the process whose Numba team was started, and whether it may be used): an OpenMP team is
# lost in a forked child, which then stays on qkv's worker threads
_team_pid: list[tuple[int, bool]] = []


def _team_ready() -> bool:
    """Whether Numba's thread team may run here: a thread-safe layer (OpenMP or TBB), started
    in this process (never from a fork of one that started it)."""
    if _team_pid:
        pid, ok = _team_pid[0]
        return ok and pid == os.getpid()
    import numba
    from numba.np.ufunc import parallel

    config: Any = numba.config
    if config.THREADING_LAYER == "default" and not parallel._is_initialized:
        config.THREADING_LAYER = "threadsafe"  # OpenMP or TBB; never the workqueue
    try:
        parallel._launch_threads()
        ok = numba.threading_layer() in ("omp", "tbb")
    except (ValueError, RuntimeError, ImportError):
        ok = False
    _team_pid[:] = [(os.getpid(), ok)]
    return ok


def _on_team(
    probs: list[_Problem], work: list[tuple[int, Item]], threads: int
) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """The work items of compiled problems run by :func:`qkv.engine.kernels.jit.decode.heads`,
    one call on Numba's thread team; None where that does not apply (the caller then runs them
    on qkv's worker threads)."""
    if len({id(p) for p in probs}) != 1 or not work or not _team_ready():
        return None
    (prob,) = {id(p): p for p in probs}.values()
    plan = prob.plan
    k_rows, v_rows = _rows(prob.k), _rows(prob.v)
    if k_rows is None or v_rows is None:
        return None
    g, L, d, dt = prob.g, prob.L, plan.d, prob.dt
    q = np.ascontiguousarray(prob.q * dt.type(plan.scale))
    heads_q = q.shape[-3]
    outer_index = np.arange(math.prod(prob.outer), dtype=np.int64).reshape(prob.outer)
    table = []
    for _, (outer, h0, h1, c0, c1) in work:
        base = int(outer_index[outer]) * heads_q if prob.outer else 0
        for h in range(h0, h1):
            at = outer + (h,)
            table.append(((base + h * g) * L, k_rows[1][at], v_rows[1][at], c0, c1))
    entries = np.array(table, dtype=np.int64)
    rows = g * L
    out = np.empty((len(table), rows, plan.dv), dtype=dt)
    lse = np.empty((len(table), rows), dtype=dt)
    lo, hi = prob.row_lo.astype(np.int64), prob.row_hi.astype(np.int64)
    _heads_on_team(threads, q.reshape(-1, d), k_rows[0], v_rows[0], entries, lo, hi, L, out, lse)
    results, i = [], 0
    for _, (_, h0, h1, _, _) in work:
        results.append((out[i : i + h1 - h0], lse[i : i + h1 - h0]))
        i += h1 - h0
    return results


def _heads_on_team(threads: int, *args: Any) -> None:
    """:func:`qkv.engine.kernels.jit.decode.heads` on ``threads`` of Numba's team (at most as
    many as the team has)."""
    import numba

    from .jit import decode as compiled

    most: int = getattr(numba.config, "NUMBA_NUM_THREADS")  # noqa: B009 - untyped module
    numba.set_num_threads(max(1, min(threads, most)))
    compiled.heads(*args)


_BOUNDS: dict[tuple[int, int], np.ndarray] = {}  # every row sees keys [0, S): a few kept


def _team_single(
    plan: Plan, threads: int, found: tuple[KeyRuns | None, ...] = ()
) -> tuple[np.ndarray, np.ndarray] | None:
    """One plan with heads (``(..., heads, L, d)``) and nothing restricting the keys, as a
    model's decoding step gives it, on Numba's thread team with as little Python as possible
    around the compiled call (between PyTorch's operations every NumPy call finds cold
    caches: the general path's setup cost more than the kernel). None where it does not apply.

    A boolean mask of one query (``L == 1``) that is the same for every head and leaves each
    sequence one run of keys (a padded batch's real tokens) is served as that run per
    sequence: the ragged batch's keys, read without the mask (``found``: as :func:`attend`).
    """
    if not compiled_team(plan):  # the router's conditions on the plan
        return None
    runs = None
    if plan.mask is not None:
        (runs,) = found or (plan_runs(plan),)
        if runs is None:
            return None
    assert plan.v is not None  # decode computes outputs
    outer, kv_heads = plan.batch[:-1], plan.k.shape[-3]
    if plan.k.shape[:-2] != (*outer, kv_heads) or plan.v.shape[:-2] != plan.k.shape[:-2]:
        return None  # K/V not given per sequence (broadcast over the batch)
    rk, rv = _rows(plan.k), _rows(plan.v)
    if rk is None or rv is None or not _team_ready():
        return None
    dt, g, L, S, d, dv = plan.acc_dtype, plan.group, plan.L, plan.S, plan.d, plan.dv
    heads = math.prod(outer) * kv_heads
    # Enough entries for every thread (and a few more, so that no thread waits long for the
    # last), each at most MAX_KEYS keys and at least MIN_SPLIT.
    splits = max(1, min(-(-2 * threads // heads), S // MIN_SPLIT))
    splits = max(splits, -(-S // MAX_KEYS))
    step = -(-S // splits)
    cuts = [(c0, min(c0 + step, S)) for c0 in range(0, S, step)]
    k_starts, v_starts = rk[1].reshape(-1).tolist(), rv[1].reshape(-1).tolist()
    if runs is None:
        table = [
            (i * g * L, k_starts[i], v_starts[i], c0, c1) for i in range(heads) for c0, c1 in cuts
        ]
    else:  # each sequence's own run of keys, cut in as many pieces (some maybe empty)
        table = []
        los, his = runs.lo.tolist(), runs.hi.tolist()
        for i in range(heads):
            lo, hi = los[i // kv_heads], his[i // kv_heads]
            width = -(-(hi - lo) // len(cuts))
            for c in range(len(cuts)):
                c0 = min(lo + c * width, hi)
                table.append((i * g * L, k_starts[i], v_starts[i], c0, min(c0 + width, hi)))
    q = np.ascontiguousarray(plan.q * dt.type(plan.scale)).reshape(-1, d)
    out = np.empty((heads, len(cuts), g * L, dv), dtype=dt)
    lse = np.empty((heads, len(cuts), g * L), dtype=dt)
    bounds = _BOUNDS.get((L, S))
    if bounds is None:
        bounds = _BOUNDS[L, S] = np.array([[0] * L, [S] * L], dtype=np.int64)
        if len(_BOUNDS) > 64:
            _BOUNDS.clear()
    entries = np.array(table, dtype=np.int64)
    _heads_on_team(
        threads,
        q,
        rk[0],
        rv[0],
        entries,
        bounds[0],
        bounds[1],
        L,
        out.reshape(-1, g * L, dv),
        lse.reshape(-1, g * L),
    )
    if len(cuts) == 1:
        o, s = out[:, 0], lse[:, 0]
    else:
        o, s = merge_arrays([(out[:, c], lse[:, c]) for c in range(len(cuts))])
    return o.reshape(*plan.batch, L, dv), s.reshape(*plan.batch, L)


class KeyRuns(NamedTuple):
    """Each sequence's run of visible keys ``[lo, hi)``: int64 arrays, C-ordered (what the
    native decode step reads)."""

    lo: np.ndarray
    hi: np.ndarray


def key_runs(rows: np.ndarray) -> KeyRuns | None:
    """Each boolean row's one run of visible keys ``[lo, hi)``; None when some row's visible
    keys are not one run, or none. The one place qkv's Python finds runs of keys (the native
    step checks the same again in C, as its last guard).

    ``rows (n, S)``: ``True`` = may attend.

    >>> key_runs(np.array([[0, 1, 1, 0], [1, 1, 1, 1]], dtype=bool))
    KeyRuns(lo=array([1, 0]), hi=array([3, 4]))
    >>> key_runs(np.array([[1, 0, 1]], dtype=bool)) is None  # a gap: two runs
    True
    """
    n, S = rows.shape
    if n and not S:
        return None  # no key to see
    if rows.all():  # every key (a batch without padding): one reduction
        return KeyRuns(np.zeros(n, np.int64), np.full(n, S, np.int64))
    lo = rows.argmax(axis=1)
    hi = S - rows[:, ::-1].argmax(axis=1)
    if not (rows.sum(axis=1) == hi - lo).all() or not rows[np.arange(n), lo].all():
        return None  # a gap in a run, or a sequence with no key
    return KeyRuns(
        np.ascontiguousarray(lo, dtype=np.int64), np.ascontiguousarray(hi, dtype=np.int64)
    )


def plan_runs(plan: Plan) -> KeyRuns | None:
    """Each sequence's run of keys in a one-query plan's boolean mask (the mask the same for
    every head), by :func:`key_runs`; None for any other mask or a sequence that sees none."""
    mask, S = plan.mask, plan.S
    assert mask is not None
    nb = len(plan.batch)
    if plan.L != 1 or mask.ndim != nb + 2 or mask.shape[-3] != 1 or mask.shape[-2] != 1:
        return None
    outer = plan.batch[:-1]
    return key_runs(np.broadcast_to(mask[..., 0, 0, :], (*outer, S)).reshape(-1, S))


def mask_runs(plan: Plan) -> list[tuple[int, int]] | None:
    """:func:`plan_runs` as a list of ``(lo, hi)`` per sequence."""
    runs = plan_runs(plan)
    if runs is None:
        return None
    return list(zip(runs.lo.tolist(), runs.hi.tolist(), strict=True))
