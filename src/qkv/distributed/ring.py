"""Ring attention on NumPy shards: forward, backward and sharded-cache decoding.

Must equal :func:`qkv.attention` / :func:`qkv.attention_vjp` over the whole sequence (then
sharded). Each rank holds its queries and its keys/values; the K/V blocks travel around the
ring, one hop per step, and each rank folds every block it sees into its running
``(out, lse)`` with :func:`qkv.engine.merge.merge_arrays`::

    for step in 0 … W−1:                       # rank r holds the K/V of rank (r − step) mod W
        post: send K/V to rank r+1, receive rank r−1's into the spare buffer
        for each group of local query chunks and the prefix of key chunks they may see:
            (o, l) = kernel(q rows, key prefix, causal only on the diagonal)
            (out, lse)[rows] = merge((out, lse)[rows], (o, l))
        wait; swap buffers

The running ``(out, lse)`` stay in the accumulation dtype (float32 for float16 inputs, float64
for float64), so the result carries one rounding, at the end, whatever the ring size. Blocks
that causal masking hides entirely cost nothing.

The backward sends K/V around the ring again; each rank adds its block's ``dK``/``dV`` into an
accumulator that travels one hop behind the K/V, and after ``W`` hops every accumulator is home.
Each block's backward is :func:`qkv.engine.kernels.tiled_backward.backward` with the final, merged
``out`` and ``lse``.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..engine.grad import sum_to
from ..engine.kernels import dispatch, mods, tiled_backward
from ..engine.kernels.blocks import merge_arrays
from ..engine.kernels.threads import limit_threads, single_threaded_blas
from ..errors import InputError, InputTypeError
from ..keywords import near_keywords
from ..masks import Window, key_bounds
from ..options import Options
from ..validate import Plan, as_array
from .agree import DEFAULT_TIMEOUT, Setup, agree, setup
from .comm import get_comm
from .layout import check_layout, chunk_ids, doc_chunks, n_chunks, visible_prefix

__all__ = [
    "RingStats",
    "ring_attention",
    "ring_attention_varlen",
    "ring_attention_varlen_vjp",
    "ring_attention_vjp",
    "ring_forward",
]

TAG_KV, TAG_GRAD = 11, 12
MASK_TILE = 512  # tile of the mask_mod check that drops blocks it hides entirely
GRAD_BLOCK = 512  # tile of the per-block backward (measured: 128 and 256 are ~10x slower)


@dataclass
class RingStats:
    """What one call did on this rank: seconds computing and waiting, bytes sent, blocks."""

    compute_s: float = 0.0
    wait_s: float = 0.0
    bytes_sent: int = 0
    blocks: int = 0
    skipped: int = 0
    threads: int = 1
    steps: list[tuple[float, float]] = field(default_factory=list)  # (compute, wait) per step

    @property
    def wait_fraction(self) -> float:
        """The share of the time spent waiting for K/V blocks: ``wait_s / (compute_s + wait_s)``."""
        total = self.compute_s + self.wait_s
        return self.wait_s / total if total else 0.0


# ---------------------------------------------------------------- the ring


class _Packed:
    """Two reused contiguous byte buffers holding arrays of fixed shapes, with views."""

    def __init__(self, like: list[np.ndarray], world: int) -> None:
        self.specs = [(a.dtype, a.shape, a.nbytes) for a in like]
        total = sum(n for _, _, n in self.specs)
        self.bufs = [np.empty(total, dtype=np.uint8) for _ in range(2 if world > 1 else 1)]

    def views(self, i: int) -> list[np.ndarray]:
        out, off = [], 0
        for dt, shape, n in self.specs:
            out.append(self.bufs[i][off : off + n].view(dt).reshape(shape))
            off += n
        return out


_Call = tuple[int, int, int, int, bool, "Window | None", tuple[int, int]]
# (row_lo, row_hi, key_lo, key_hi, causal, window, offsets): local query rows against keys of
# the travelling block, with the block's own causal/window and the variants' position offsets


def _positional(s: Setup) -> bool:
    """Whether the blocks need their global positions (a window, ALiBi or a ``mask_mod``)."""
    return s.window is not None or s.plan.alibi is not None or s.plan.mask_mod is not None


Docs = list[tuple[int, int]]  # packed documents: (first local token, tokens per chunk)


def _calls(s: Setup, owner: int, docs: Docs | None = None) -> Iterator[_Call]:
    """The kernel calls of one ring step against the K/V of rank ``owner``; ``docs``: the
    rank's tokens are packed documents, each cut into the layout's chunks on its own."""
    if docs is not None or _positional(s):
        yield from _window_calls(s, owner, docs if docs is not None else [(0, s.h)])
        return
    for lo, hi, n, diag in _prefix_calls(s, owner):
        yield lo, hi, 0, n, diag, None, (0, 0)


def _prefix_calls(s: Setup, owner: int) -> Iterator[tuple[int, int, int, bool]]:
    """``(row_lo, row_hi, n_keys, diagonal)`` for each kernel call of one ring step: the local
    query chunks, grouped when they see the same prefix of the owner's key chunks."""
    mine = chunk_ids(s.comm.rank, s.comm.size, s.layout)
    theirs = chunk_ids(owner, s.comm.size, s.layout)
    groups: list[list[int]] = []  # [first chunk, last chunk + 1, prefix, diagonal]
    for i, qc in enumerate(mine):
        p, diag = visible_prefix(qc, theirs, s.causal)
        if p == 0:
            continue
        if groups and not diag and groups[-1][1] == i and groups[-1][2:] == [p, 0]:
            groups[-1][1] = i + 1
        else:
            groups.append([i, i + 1, p, int(diag)])
    for a, b, p, on_diagonal in groups:
        yield a * s.h, b * s.h, p * s.h, bool(on_diagonal)


def _window_calls(s: Setup, owner: int, docs: Docs) -> Iterator[_Call]:
    """One call per (query chunk, key chunk) pair that causal and the window leave any key
    of, trimmed to the rows that see a key and the keys any of them sees.

    The global rule (:func:`qkv.masks.key_bounds` over all ``N`` positions) becomes the
    block's own: with the block's rows at global ``g_q + i`` and keys at ``g_k + j``, its
    bottom-right row position is ``p = S_b − L_b + i``, so the global ``g_q + i − left ≤
    g_k + j ≤ g_q + i + right`` (and ``≤ g_q + i`` under causal) reads ``p − (left − D) ≤ j
    ≤ p + (right + D)`` with ``D = g_q − g_k − (S_b − L_b)``: a window whose sides may be
    negative. The variants see global positions through the plan's ``offsets``.

    Each of ``docs`` (first local token, tokens per chunk) is such a sequence on its own (its
    positions count from its start; documents never see each other).
    """
    for base, h in docs:
        if h:
            for lo, hi, k_lo, k_hi, causal, window, offsets in _doc_calls(s, owner, h):
                yield base + lo, base + hi, base + k_lo, base + k_hi, causal, window, offsets


def _doc_calls(s: Setup, owner: int, h: int) -> Iterator[_Call]:
    """:func:`_window_calls` for one sequence of ``h`` tokens per chunk."""
    W = s.comm.size
    n = h * n_chunks(W, s.layout)
    win = s.window
    if win is not None:
        win = (None if win[0] is None or win[0] >= n else win[0],
               None if win[1] is None or win[1] >= n else win[1])  # fmt: skip
        win = None if win == (None, None) else win
    for i, qc in enumerate(chunk_ids(s.comm.rank, W, s.layout)):
        lo, hi = key_bounds(qc * h + np.arange(h), n, s.causal, win)
        for j, kc in enumerate(chunk_ids(owner, W, s.layout)):
            k0 = kc * h
            los, his = np.clip(lo, k0, k0 + h), np.clip(hi, k0, k0 + h)
            seen = np.flatnonzero(his > los)
            if not seen.size:
                continue
            a, b = int(seen[0]), int(seen[-1]) + 1
            c0, c1 = int(los[a:b].min()), int(his[a:b].max())
            nq, nk = b - a, c1 - c0
            gq = qc * h + a
            causal, window = False, None
            if not (los[a:b].max() <= c0 and his[a:b].min() >= c1):  # not every row sees all
                shift = gq - c0 - (nk - nq)
                left = None if win is None or win[0] is None else win[0] - shift
                right = None if win is None or win[1] is None else win[1] + shift
                if s.causal:
                    right = shift if right is None else min(right, shift)
                if (left, right) == (None, 0):
                    causal = True  # the diagonal: the block's own causal mask
                else:
                    window = (left, right)
            keys = (j * h + c0 - k0, j * h + c1 - k0)
            yield i * h + a, i * h + b, *keys, causal, window, (gq - (nk - nq), c0)


def _blocks(
    s: Setup, owner: int, kb: np.ndarray, vb: np.ndarray, docs: Docs | None
) -> Iterator[tuple[_Call, Plan]]:
    """Each call of one ring step with its block plan; blocks a ``mask_mod`` hides entirely
    are dropped."""
    for call in _calls(s, owner, docs):
        bp = _block_plan(s, call, kb, vb)
        if bp.mask_mod is not None:
            status = mods.block_mask(bp, MASK_TILE, MASK_TILE)
            if not np.any(status != mods.EMPTY):
                continue
        yield call, bp


def _block_plan(s: Setup, call: _Call, kb: np.ndarray, vb: np.ndarray) -> Plan:
    """Query rows ``lo:hi`` against keys ``k_lo:k_hi`` of a travelling K/V block: a block of
    this rank's checked plan (nothing is checked again), sinks left for after the merge."""
    lo, hi, k_lo, k_hi, causal, window, offsets = call
    p, n = s.plan, k_hi - k_lo
    assert p.v is not None  # a ring's plan always carries values
    k = kb[..., k_lo:k_hi, :].astype(p.acc_dtype, copy=False)
    v = vb[..., k_lo:k_hi, :].astype(p.acc_dtype, copy=False)
    k = np.broadcast_to(k, p.k.shape[:-2] + (n, p.d))
    v = np.broadcast_to(v, p.v.shape[:-2] + (n, p.dv))
    bp = p.block(slice(lo, hi), k, v, causal=causal)
    if window is not None or offsets != (0, 0) or p.sinks is not None:
        bp = replace(bp, window=window, offsets=offsets, sinks=None)
    return bp


def _forward(s: Setup, stats: RingStats, docs: Docs | None = None) -> tuple[np.ndarray, np.ndarray]:
    p, comm, W = s.plan, s.comm, s.comm.size
    out = np.zeros(p.batch + (p.L, p.dv), dtype=p.acc_dtype)
    lse = np.full(p.batch + (p.L,), -np.inf, dtype=p.acc_dtype)
    kv = _Packed([s.k, s.v], W)
    cur = 0
    for a, b in zip(kv.views(cur), (s.k, s.v), strict=True):
        a[...] = b
    failed: InputError | None = None  # scores beyond float64 in a block of this rank's rows
    for step in range(W):
        owner = (comm.rank - step) % W
        t0 = time.perf_counter()
        req = comm.exchange(kv.bufs[cur], kv.bufs[1 - cur], TAG_KV) if step < W - 1 else None
        if req is not None:
            stats.bytes_sent += kv.bufs[cur].nbytes
        kb, vb = kv.views(cur)
        n_calls = 0
        blocks = _blocks(s, owner, kb, vb, docs) if failed is None else iter(())
        for (lo, hi, *_), bp in blocks:
            try:
                o, m = dispatch.attend(bp)
            except InputError as exc:  # keep passing K/V on, so no other rank is left waiting
                failed = exc
                break
            out[..., lo:hi, :], lse[..., lo:hi] = merge_arrays(
                [(out[..., lo:hi, :], lse[..., lo:hi]), (o, m)]
            )
            n_calls += 1
        stats.blocks += n_calls
        stats.skipped += n_calls == 0
        t1 = time.perf_counter()
        if req is not None:
            req.wait()
            cur = 1 - cur
        t2 = time.perf_counter()
        stats.steps.append((t1 - t0, t2 - t1))
        stats.compute_s += t1 - t0
        stats.wait_s += t2 - t1
    if failed is not None:
        raise failed
    return mods.with_sinks(p, out, lse)


def _backward(
    s: Setup,
    d_out: np.ndarray,
    out: np.ndarray,
    lse: np.ndarray,
    stats: RingStats,
    docs: Docs | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    p, comm, W, acc = s.plan, s.comm, s.comm.size, s.plan.acc_dtype
    dq = np.zeros(p.q.shape, dtype=acc)
    kv = _Packed([s.k, s.v], W)
    grads = _Packed([np.empty(s.k.shape, acc), np.empty(s.v.shape, acc)], W)
    for a in grads.views(0):
        a[...] = 0
    blk = [np.empty(s.k.shape, acc), np.empty(s.v.shape, acc)]  # this step's dK, dV
    cur, gcur = 0, 0
    for a, b in zip(kv.views(cur), (s.k, s.v), strict=True):
        a[...] = b
    greq = None
    for step in range(W):
        owner = (comm.rank - step) % W
        t0 = time.perf_counter()
        req = comm.exchange(kv.bufs[cur], kv.bufs[1 - cur], TAG_KV) if step < W - 1 else None
        if req is not None:
            stats.bytes_sent += kv.bufs[cur].nbytes
        kb, vb = kv.views(cur)
        for x in blk:
            x[...] = 0
        n_calls = 0
        for (lo, hi, k_lo, k_hi, *_), bp in _blocks(s, owner, kb, vb, docs):
            n = k_hi - k_lo
            g = np.broadcast_to(d_out[..., lo:hi, :], bp.batch + (hi - lo, p.dv))
            # one BLAS thread: its small GEMMs ran ~15x slower on 2 threads (2 shared cores)
            with single_threaded_blas():
                dqb, dkb, dvb = tiled_backward.backward(
                    bp, g, out[..., lo:hi, :], lse[..., lo:hi], GRAD_BLOCK
                )
            dq[..., lo:hi, :] += dqb
            blk[0][..., k_lo:k_hi, :] += sum_to(dkb, s.k.shape[:-2] + (n, s.k.shape[-1]))
            blk[1][..., k_lo:k_hi, :] += sum_to(dvb, s.v.shape[:-2] + (n, s.v.shape[-1]))
            n_calls += 1
        stats.blocks += n_calls
        stats.skipped += n_calls == 0
        t1 = time.perf_counter()
        if greq is not None:
            greq.wait()
            gcur = 1 - gcur
        dk_acc, dv_acc = grads.views(gcur)
        dk_acc += blk[0]
        dv_acc += blk[1]
        if W > 1:  # the accumulator follows the K/V one hop behind
            greq = comm.exchange(grads.bufs[gcur], grads.bufs[1 - gcur], TAG_GRAD)
            stats.bytes_sent += grads.bufs[gcur].nbytes
        if req is not None:
            req.wait()
            cur = 1 - cur
        t2 = time.perf_counter()
        stats.steps.append((t1 - t0, t2 - t1))
        stats.compute_s += t1 - t0
        stats.wait_s += t2 - t1
    t1 = time.perf_counter()
    if greq is not None:
        greq.wait()
        gcur = 1 - gcur
    stats.wait_s += time.perf_counter() - t1
    dk, dv = grads.views(gcur)
    return dq, dk.copy(), dv.copy()


# ---------------------------------------------------------------- public functions


def ring_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    comm: Any = None,
    scale: Any = None,
    causal: bool = False,
    window: Any = None,
    softcap: Any = None,
    sinks: Any = None,
    alibi_slopes: Any = None,
    mask_mod: Any = None,
    layout: str = "zigzag",
    return_lse: bool = False,
    stats: RingStats | None = None,
    timeout: Any = DEFAULT_TIMEOUT,
) -> Any:
    """Exact attention over a sequence sharded across ranks; this rank's rows of the result.

    Must equal :func:`qkv.attention` over the whole sequence, sharded with :func:`shard`.
    Every rank of ``comm`` must call it, with shards of the same shapes and the same options.

    Parameters
    ----------
    q, k, v : array_like or torch.Tensor
        This rank's shards ``(..., n_local, d)``, ``(..., n_local, d)``, ``(..., n_local, dv)``
        (grouped kv heads and broadcasting as in :func:`qkv.attention`), cut from the whole
        sequence by :func:`shard` with the same ``layout``. CPU tensors give tensors, and
        ``out.sum().backward()`` runs :func:`ring_attention_vjp` on every rank.
    comm : torch ProcessGroup, mpi4py communicator or None, optional
        The ranks; ``None``: the default ``torch.distributed`` group if initialised, else
        ``MPI.COMM_WORLD`` if ``mpi4py.MPI`` is imported, else this process alone.
    scale : float, optional
        Default ``1/sqrt(d)``.
    causal : bool, optional
        Causal masking over the whole sequence (global positions).
    window : (left, right), optional
        Sliding window over the whole sequence (global positions), as in
        :func:`qkv.attention`. Blocks it hides entirely are not computed.
    softcap, sinks, alibi_slopes, mask_mod : optional
        The variants of :func:`qkv.attention`, over the whole sequence: ALiBi and
        ``mask_mod(b, h, q_idx, kv_idx)`` see global positions (as :func:`positions` gives
        them), blocks a ``mask_mod`` hides entirely are not computed, and sinks (one logit per
        query head) are added once, after the merge.
    layout : {"zigzag", "contiguous"}, optional
        How the sequence was sharded (see :mod:`qkv.distributed.layout`).
    return_lse : bool, optional
        Also return this rank's rows' log-sum-exp (accumulation dtype).
    stats : RingStats, optional
        Filled with this rank's compute and waiting time and bytes sent.
    timeout : float or datetime.timedelta or None, optional
        Seconds every rank has to enter the call (default 300): after it, every rank that
        did raises :class:`RankTimeout` naming the ranks that did not. ``None`` waits as long
        as the engine does (``torch.distributed``'s group timeout; MPI's: for ever).

    Returns
    -------
    out : ndarray, shape ``(..., n_local, dv)``
        In the inputs' dtype, rounded once at the end.
    lse : ndarray, shape ``(..., n_local)``
        Only with ``return_lse``.

    Raises
    ------
    InputError
        On every rank, when any rank's arguments are invalid or the ranks disagree on shapes,
        dtypes or options (checked with one all-gather before the ring starts).
    RankTimeout
        On every rank that entered the call, when some rank did not within ``timeout``; its
        ``missing`` attribute lists them. The group may then hold messages of the abandoned
        call: use a new one.

    Examples
    --------
    One process is a ring of one:

    >>> import numpy as np, qkv
    >>> from qkv.distributed import ring_attention
    >>> q, k, v = np.random.default_rng(0).standard_normal((3, 4, 8))
    >>> bool(np.allclose(ring_attention(q, k, v, causal=True), qkv.attention(q, k, v, causal=True)))
    True
    """
    options = Options(scale, causal, None, window, softcap, sinks, alibi_slopes, None, mask_mod)
    s, _ = setup("ring_attention", comm, q, k, v, options, layout, {}, timeout)
    out, lse = _run_forward(s, stats)
    out = out.astype(s.plan.out_dtype, copy=False)
    return (out, lse) if return_lse else out


def ring_forward(
    q: Any,
    k: Any,
    v: Any,
    *,
    comm: Any = None,
    layout: str = "zigzag",
    stats: RingStats | None = None,
    timeout: Any = DEFAULT_TIMEOUT,
    **options: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`ring_attention` on NumPy input, with ``out`` left in the accumulation dtype;
    ``options`` are its ``scale``, ``causal``, ``window`` and variants."""
    s, _ = setup("ring_attention", comm, q, k, v, Options(**options), layout, {}, timeout)
    return _run_forward(s, stats)


def _run_forward(
    s: Setup, stats: RingStats | None, docs: Docs | None = None
) -> tuple[np.ndarray, np.ndarray]:
    stats = stats if stats is not None else RingStats()
    stats.threads = s.threads
    with limit_threads(s.threads):
        return _forward(s, stats, docs)


@near_keywords()
def ring_attention_vjp(
    q: Any,
    k: Any,
    v: Any,
    grad_out: Any,
    out: Any,
    lse: Any,
    *,
    comm: Any = None,
    scale: Any = None,
    causal: bool = False,
    window: Any = None,
    softcap: Any = None,
    sinks: Any = None,
    alibi_slopes: Any = None,
    mask_mod: Any = None,
    layout: str = "zigzag",
    stats: RingStats | None = None,
    timeout: Any = DEFAULT_TIMEOUT,
) -> tuple[np.ndarray, ...]:
    """Gradients of ``Σ ring_attention(q, k, v) · grad_out`` for this rank's shards.

    Must equal :func:`qkv.attention_vjp` over the whole sequence, sharded. ``out`` and ``lse``
    are this rank's forward results (``ring_attention(..., return_lse=True)``); every block's
    backward uses them, so the K/V seen are exactly the forward's. ``timeout`` as in
    :func:`ring_attention`.

    ``window``, ``softcap``, ``sinks``, ``alibi_slopes`` and ``mask_mod`` must be the
    forward's.

    Returns
    -------
    dq, dk, dv : ndarray
        Shapes and dtypes of this rank's ``q``, ``k``, ``v``.
    dsinks : ndarray
        Only with ``sinks``: their gradient over the whole sequence (the same on every rank),
        in the sinks' shape and dtype.

    Examples
    --------
    >>> import numpy as np, qkv
    >>> from qkv.distributed import ring_attention, ring_attention_vjp
    >>> q, k, v = np.random.default_rng(0).standard_normal((3, 4, 8))
    >>> out, lse = ring_attention(q, k, v, causal=True, return_lse=True)
    >>> dq, dk, dv = ring_attention_vjp(q, k, v, np.ones_like(out), out, lse, causal=True)
    >>> ref = qkv.attention_vjp(q, k, v, np.ones_like(out), causal=True)
    >>> all(np.allclose(a, b) for a, b in zip((dq, dk, dv), ref))
    True
    """
    extra = {"grad_out": grad_out, "out": out, "lse": lse}
    options = Options(scale, causal, None, window, softcap, sinks, alibi_slopes, None, mask_mod)
    s, arrays = setup("ring_attention_vjp", comm, q, k, v, options, layout, extra, timeout)
    return _vjp(s, arrays, stats)


def _vjp(
    s: Setup, arrays: dict[str, np.ndarray], stats: RingStats | None, docs: Docs | None = None
) -> tuple[np.ndarray, ...]:
    acc, p = s.plan.acc_dtype, s.plan
    g = np.broadcast_to(arrays["grad_out"].astype(acc, copy=False), p.batch + (p.L, p.dv))
    o = arrays["out"].astype(acc, copy=False)
    m = arrays["lse"].astype(acc, copy=False)
    stats = stats if stats is not None else RingStats()
    stats.threads = s.threads
    with limit_threads(s.threads):
        dq, dk, dv = _backward(s, g, o, m, stats, docs)
    grads = (
        sum_to(dq, s.q.shape).astype(s.q.dtype, copy=False),
        dk.astype(s.k.dtype, copy=False),
        dv.astype(s.v.dtype, copy=False),
    )
    return grads if p.sinks is None else (*grads, _dsinks(s, g, o, m))


def _dsinks(s: Setup, g: np.ndarray, out: np.ndarray, lse: np.ndarray) -> np.ndarray:
    """``− Σ_rows exp(sink − lse) · δ`` (``δ = rowsum(dO ∘ O)``) over every rank's rows, in the
    shape and dtype the sinks were given in."""
    p = s.plan
    assert p.sinks is not None  # called only for a plan with sinks
    delta = np.sum(g * out, axis=-1)
    mine = -np.sum(np.exp(p.sinks[..., None] - lse) * delta, axis=-1)
    total = s.comm.allgather(np.ascontiguousarray(mine)).sum(axis=0)
    dtype, shape = p.given[3]
    if not p.batch:
        return np.asarray(total, dtype=dtype).reshape(shape)
    return sum_to(total, shape).astype(dtype, copy=False)


# ---------------------------------------------------------------- packed documents


def ring_attention_varlen(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens: Any,
    *,
    comm: Any = None,
    scale: Any = None,
    causal: bool = False,
    window: Any = None,
    layout: str = "zigzag",
    return_lse: bool = False,
    stats: RingStats | None = None,
) -> Any:
    """Exact attention over a packed batch of documents sharded across ranks.

    Must equal :func:`qkv.attention_varlen` over the whole packed batch (with
    ``cu_seqlens_q = cu_seqlens_k = cu_seqlens``), then sharded with :func:`shard_varlen`.
    Every document is cut into the layout's chunks on its own (zigzag: ``2W`` chunks, rank
    ``r`` holding chunks ``r`` and ``2W − 1 − r`` of each), so every rank does about the same
    work under causal masking; documents never see each other, and the ring skips the blocks
    between them.

    Parameters
    ----------
    q, k, v : array_like or torch.Tensor
        This rank's tokens ``(n_local, heads, d)``, ``(n_local, kv_heads, d)``,
        ``(n_local, kv_heads, dv)``: :func:`shard_varlen` of the packed batch, so
        ``n_local = cu_seqlens[-1] / W``.
    cu_seqlens : array_like of int, shape ``(batch + 1,)``
        The whole packed batch's offsets, the same on every rank. Every document's length
        must be a multiple of ``2W`` (zigzag) or ``W`` (contiguous); empty ones are fine.
    comm, scale, causal, window, layout, return_lse, stats
        As in :func:`ring_attention`; ``causal`` and ``window`` apply within each document.

    Returns
    -------
    out : ndarray, shape ``(n_local, heads, dv)``
    lse : ndarray, shape ``(n_local, heads)``
        Only with ``return_lse``.

    Raises
    ------
    InputError
        On every rank, for ``cu_seqlens`` that are not offsets, documents the layout cannot
        cut, or ranks that disagree.

    Examples
    --------
    >>> import numpy as np, qkv
    >>> from qkv.distributed import ring_attention_varlen
    >>> q, k, v = np.random.default_rng(0).standard_normal((3, 10, 2, 4))
    >>> cu = [0, 6, 6, 10]
    >>> out = ring_attention_varlen(q, k, v, cu, causal=True)
    >>> bool(np.allclose(out, qkv.attention_varlen(q, k, v, cu, cu, causal=True)))
    True
    """
    options = Options(scale, causal, window=window)
    s, docs, _ = _varlen_setup("ring_attention_varlen", comm, q, k, v, cu_seqlens, options, layout)
    out, lse = _run_forward(s, stats, docs)
    out = np.moveaxis(out.astype(s.plan.out_dtype, copy=False), -2, 0)
    lse = np.moveaxis(lse, -1, 0)
    return (out, lse) if return_lse else out


def varlen_forward(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens: Any,
    *,
    comm: Any = None,
    scale: Any = None,
    causal: bool = False,
    window: Any = None,
    layout: str = "zigzag",
    stats: RingStats | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`ring_attention_varlen` on NumPy input, ``out`` left in the accumulation dtype."""
    options = Options(scale, causal, window=window)
    s, docs, _ = _varlen_setup("ring_attention_varlen", comm, q, k, v, cu_seqlens, options, layout)
    out, lse = _run_forward(s, stats, docs)
    return np.moveaxis(out, -2, 0), np.moveaxis(lse, -1, 0)


@near_keywords()
def ring_attention_varlen_vjp(
    q: Any,
    k: Any,
    v: Any,
    grad_out: Any,
    out: Any,
    lse: Any,
    cu_seqlens: Any,
    *,
    comm: Any = None,
    scale: Any = None,
    causal: bool = False,
    window: Any = None,
    layout: str = "zigzag",
    stats: RingStats | None = None,
) -> Any:
    """Gradients of ``Σ ring_attention_varlen(q, k, v, cu_seqlens) · grad_out`` for this
    rank's tokens; ``out`` and ``lse`` are this rank's forward results (``return_lse=True``).

    Must equal the gradients of :func:`qkv.attention_varlen` over the whole packed batch,
    sharded with :func:`shard_varlen`.

    Returns
    -------
    dq, dk, dv : ndarray
        Shapes and dtypes of this rank's ``q``, ``k``, ``v``.

    Examples
    --------
    >>> import numpy as np, qkv
    >>> from qkv.distributed import ring_attention_varlen, ring_attention_varlen_vjp
    >>> q, k, v = np.random.default_rng(0).standard_normal((3, 6, 1, 4))
    >>> out, lse = ring_attention_varlen(q, k, v, [0, 6], causal=True, return_lse=True)
    >>> dq, dk, dv = ring_attention_varlen_vjp(q, k, v, np.ones_like(out), out, lse, [0, 6],
    ...                                        causal=True)
    >>> ref = qkv.attention_vjp(q[:, 0], k[:, 0], v[:, 0], np.ones((6, 4)), causal=True)
    >>> bool(np.allclose(dk[:, 0], ref[1]))
    True
    """
    extra = {"grad_out": grad_out, "out": out, "lse": lse}
    options = Options(scale, causal, window=window)
    s, docs, arrays = _varlen_setup(
        "ring_attention_varlen_vjp", comm, q, k, v, cu_seqlens, options, layout, extra
    )
    return tuple(np.moveaxis(g, -2, 0) for g in _vjp(s, arrays, stats, docs))


def _documents_differ(c: Any, what: str, lengths: list[int]) -> InputError:
    """What differs between the ranks' ``cu_seqlens``: the number of documents, or the first
    document whose length differs (one more all-gather, on the error path only)."""
    counts = c.timed_allgather(np.asarray([len(lengths)], dtype=np.int64), DEFAULT_TIMEOUT)[:, 0]
    mine = np.full(int(counts.max()), -1, dtype=np.int64)
    mine[: len(lengths)] = lengths
    rows = c.timed_allgather(mine, DEFAULT_TIMEOUT)
    here = f"(this is rank {c.rank})"
    r = next((r for r in range(c.size) if not np.array_equal(rows[r], rows[0])), None)
    if r is None:  # the same documents, cut into different chunks
        return InputError(f"{what}: ranks disagree on layout {here}; pass the same on every rank")
    if counts[r] != counts[0]:
        return InputError(
            f"{what}: ranks disagree on cu_seqlens: rank 0 has {int(counts[0])} documents, "
            f"rank {r} has {int(counts[r])} {here}; every rank passes the whole batch's offsets"
        )
    j = int(np.flatnonzero(rows[r] != rows[0])[0])
    return InputError(
        f"{what}: ranks disagree on cu_seqlens: document {j} has {int(rows[0, j])} tokens on "
        f"rank 0 and {int(rows[r, j])} on rank {r} {here}; every rank passes the whole "
        "batch's offsets"
    )


def _varlen_setup(
    what: str,
    comm: Any,
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens: Any,
    options: Options,
    layout: Any,
    extra: dict[str, Any] | None = None,
) -> tuple[Setup, Docs, dict[str, np.ndarray]]:
    """Check ``cu_seqlens`` and the packed shapes (the ranks agree on them first), then the
    ring's own :func:`setup` on ``(heads, tokens, d)`` views."""
    c = get_comm(comm)
    err: Exception | None = None
    docs: Docs = []
    key, moved = [0, 0], {}
    try:
        sizes = doc_chunks(cu_seqlens, c.size, check_layout(layout))
        per = len(chunk_ids(0, c.size, layout))
        local = int(sizes.sum()) * per
        starts = np.concatenate([[0], np.cumsum(sizes * per)])[:-1]
        docs = [(int(a), int(h)) for a, h in zip(starts, sizes, strict=True)]
        key = [zlib.crc32(np.ascontiguousarray(sizes).tobytes()) & 0x7FFFFFFF, len(sizes)]
        for name, x in (("q", q), ("k", k), ("v", v), *(extra or {}).items()):
            a = as_array(x, name)
            nd = 2 if name == "lse" else 3
            shape = "(n_local, heads)" if name == "lse" else "(n_local, heads, d)"
            if a.ndim != nd or a.shape[0] != local:
                raise InputError(
                    f"{name}: expected this rank's packed tokens {shape} with n_local = "
                    f"cu_seqlens[-1] / {c.size} = {local}, got shape {a.shape}"
                )
            moved[name] = np.moveaxis(a, 0, -1 if name == "lse" else -2)
    except (InputError, InputTypeError) as exc:
        err = exc
    try:
        agree(c, what, [("cu_seqlens", key)], err)
    except InputError as exc:
        # Every rank sees the same gathered rows, so every rank takes this branch together
        # and gathers the document lengths a second time, to say which ones differ.
        if err is None and str(exc).startswith(f"{what}: ranks disagree on cu_seqlens"):
            parts = n_chunks(c.size, layout)
            raise _documents_differ(c, what, [h * parts for _, h in docs]) from None
        raise
    ex = {name: moved[name] for name in extra or {}}
    s, arrays = setup(what, c, moved["q"], moved["k"], moved["v"], options, layout, ex)
    return s, docs, arrays
