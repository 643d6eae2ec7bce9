"""Ring attention on NumPy shards: forward, backward and sharded-cache decoding.

Must equal :func:`qkv.attention` / :func:`qkv.attention_vjp` over the whole sequence (then
sharded). Each rank holds its queries and its keys/values; the K/V blocks travel around the
ring, one hop per step, and each rank folds every block it sees into its running
``(out, lse)`` with :func:`qkv.merge.merge_arrays`::

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
Each block's backward is :func:`qkv.kernels.tiled_backward.backward` with the final, merged ``out``
and ``lse``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..grad import _sum_to
from ..kernels import dispatch, tiled_backward
from ..kernels._threads import limit_threads, single_threaded_blas
from ..kernels.blocks import merge_arrays
from ..validate import as_array, make_plan
from .agree import Setup, setup
from .layout import chunk_ids, visible_prefix

__all__ = ["RingStats", "ring_attention", "ring_attention_vjp", "ring_forward"]

TAG_KV, TAG_GRAD = 11, 12
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


def _calls(s: Setup, owner: int) -> Iterator[tuple[int, int, int, bool]]:
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
    for a, b, p, diag in groups:
        yield a * s.h, b * s.h, p * s.h, bool(diag)


def _block_plan(s: Setup, lo: int, hi: int, kb: np.ndarray, vb: np.ndarray, n: int, diag: bool):
    p = s.plan
    return make_plan(p.q[..., lo:hi, :], kb[..., :n, :], vb[..., :n, :], scale=p.scale, causal=diag)


def _forward(s: Setup, stats: RingStats) -> tuple[np.ndarray, np.ndarray]:
    p, comm, W = s.plan, s.comm, s.comm.size
    out = np.zeros(p.batch + (p.L, p.dv), dtype=p.acc_dtype)
    lse = np.full(p.batch + (p.L,), -np.inf, dtype=p.acc_dtype)
    kv = _Packed([s.k, s.v], W)
    cur = 0
    for a, b in zip(kv.views(cur), (s.k, s.v), strict=True):
        a[...] = b
    for step in range(W):
        owner = (comm.rank - step) % W
        t0 = time.perf_counter()
        req = comm.exchange(kv.bufs[cur], kv.bufs[1 - cur], TAG_KV) if step < W - 1 else None
        if req is not None:
            stats.bytes_sent += kv.bufs[cur].nbytes
        kb, vb = kv.views(cur)
        n_calls = 0
        for lo, hi, n, diag in _calls(s, owner):
            o, m = dispatch.attend(_block_plan(s, lo, hi, kb, vb, n, diag))
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
    return out, lse


def _backward(
    s: Setup, d_out: np.ndarray, out: np.ndarray, lse: np.ndarray, stats: RingStats
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
        for lo, hi, n, diag in _calls(s, owner):
            bp = _block_plan(s, lo, hi, kb, vb, n, diag)
            g = np.broadcast_to(d_out[..., lo:hi, :], bp.batch + (hi - lo, p.dv))
            # one BLAS thread: its small GEMMs ran ~15x slower on 2 threads (2 shared cores)
            with single_threaded_blas():
                dqb, dkb, dvb = tiled_backward.backward(
                    bp, g, out[..., lo:hi, :], lse[..., lo:hi], GRAD_BLOCK
                )
            dq[..., lo:hi, :] += dqb
            blk[0][..., :n, :] += _sum_to(dkb, s.k.shape[:-2] + (n, s.k.shape[-1]))
            blk[1][..., :n, :] += _sum_to(dvb, s.v.shape[:-2] + (n, s.v.shape[-1]))
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
    causal: bool = False,
    scale: Any = None,
    layout: str = "zigzag",
    return_lse: bool = False,
    stats: RingStats | None = None,
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
    causal : bool, optional
        Causal masking over the whole sequence (global positions).
    scale : float, optional
        Default ``1/sqrt(d)``.
    layout : {"zigzag", "contiguous"}, optional
        How the sequence was sharded (see :mod:`qkv.distributed.layout`).
    return_lse : bool, optional
        Also return this rank's rows' log-sum-exp (accumulation dtype).
    stats : RingStats, optional
        Filled with this rank's compute and waiting time and bytes sent.

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

    Examples
    --------
    One process is a ring of one:

    >>> import numpy as np, qkv
    >>> from qkv.distributed import ring_attention
    >>> q, k, v = np.random.default_rng(0).standard_normal((3, 4, 8))
    >>> bool(np.allclose(ring_attention(q, k, v, causal=True), qkv.attention(q, k, v, causal=True)))
    True
    """
    out, lse = ring_forward(
        q, k, v, comm=comm, causal=causal, scale=scale, layout=layout, stats=stats
    )
    out = out.astype(_out_dtype(q, k, v), copy=False)
    return (out, lse) if return_lse else out


def _out_dtype(*xs: Any) -> np.dtype:
    return np.result_type(*(as_array(x, "x") for x in xs))


def ring_forward(
    q: Any,
    k: Any,
    v: Any,
    *,
    comm: Any = None,
    causal: bool = False,
    scale: Any = None,
    layout: str = "zigzag",
    stats: RingStats | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`ring_attention` on NumPy input, with ``out`` left in the accumulation dtype."""
    s, _ = setup("ring_attention", comm, q, k, v, causal, scale, layout, {})
    stats = stats if stats is not None else RingStats()
    stats.threads = s.threads
    with limit_threads(s.threads):
        return _forward(s, stats)


def ring_attention_vjp(
    q: Any,
    k: Any,
    v: Any,
    grad_out: Any,
    out: Any,
    lse: Any,
    *,
    comm: Any = None,
    causal: bool = False,
    scale: Any = None,
    layout: str = "zigzag",
    stats: RingStats | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of ``Σ ring_attention(q, k, v) · grad_out`` for this rank's shards.

    Must equal :func:`qkv.attention_vjp` over the whole sequence, sharded. ``out`` and ``lse``
    are this rank's forward results (``ring_attention(..., return_lse=True)``); every block's
    backward uses them, so the K/V seen are exactly the forward's.

    Returns
    -------
    dq, dk, dv : ndarray
        Shapes and dtypes of this rank's ``q``, ``k``, ``v``.

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
    s, arrays = setup("ring_attention_vjp", comm, q, k, v, causal, scale, layout, extra)
    acc, p = s.plan.acc_dtype, s.plan
    g = np.broadcast_to(arrays["grad_out"].astype(acc, copy=False), p.batch + (p.L, p.dv))
    o = arrays["out"].astype(acc, copy=False)
    m = arrays["lse"].astype(acc, copy=False)
    stats = stats if stats is not None else RingStats()
    stats.threads = s.threads
    with limit_threads(s.threads):
        dq, dk, dv = _backward(s, g, o, m, stats)
    return (
        _sum_to(dq, s.q.shape).astype(s.q.dtype, copy=False),
        dk.astype(s.k.dtype, copy=False),
        dv.astype(s.v.dtype, copy=False),
    )
