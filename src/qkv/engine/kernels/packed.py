"""Packed prefill: online softmax over many sequences of different lengths in one call.

The layout of FlashAttention's varlen functions: ``q (total_q, heads, d)``, ``k``/``v
(total_k, kv_heads, ·)``, sequence ``b`` in rows ``cq[b]:cq[b + 1]`` and ``ck[b]:ck[b + 1]``.
Must equal :func:`qkv.reference.attention` on each sequence alone.

Work items are ``(sequence, kv head)`` pairs (cut into runs of query tiles when there are too
few to keep the threads busy), run on qkv's worker threads costliest first, so a batch of many
sequences — or one prefill, :func:`attend_plan` — is one parallel pass with no per-sequence
plan, dispatch or copy of the queries. Inside an item the ``group`` query heads that share the
kv head are stacked as rows (row ``t`` is query ``t // group`` of head ``t % group``, the
packed layout's own order): each key block is read once for the whole group and the products
are ``group`` times taller.
Query tiles of :data:`BLOCK_ROWS` stacked rows meet key blocks of :data:`BLOCK_K` keys::

    s   = q_tile · k_blockᵀ · scale              # (rows, keys)
    m'  = running max, moved only when max_j s_j exceeds m by more than TAU
          (skipped, m = 0, when Cauchy-Schwarz bounds every score of the tile by ±TAU)
    acc = acc · exp(m - m') + exp(s - m') · [v_block | 1]

the ones column summing the weights in the same product. Rows see keys by
:func:`qkv.masks.key_bounds` (bottom-right causal, windows per sequence); key blocks no row of
a tile sees are never visited; across the rows' bounds keys are visited in narrower pieces,
each with only the rows that see some of it, and masked by a boolean tile built once per
diagonal pattern. Rows are
finished by :func:`qkv.engine.kernels.blocks.finish` (a row that sees no key: output 0, lse
``-inf``;
NaN stays NaN). Plain attention only: masks, biases and score variants go to the other kernels.

Memory: per thread one score block and one sequence's kv head of values with the ones column.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...masks import key_bounds
from ...validate import Plan
from .blocks import finish, key_pieces
from .threads import parallel_map, workers

__all__ = ["BLOCK_K", "BLOCK_ROWS", "TAU", "attend", "attend_plan"]

BLOCK_ROWS = 512  # stacked rows (queries × heads of a group) per tile
BLOCK_K = 512  # keys per block
TAU = 40.0  # scores within ±TAU need no running maximum (exp stays far from overflow)
_LOG2E = 1.4426950408889634


# One sequence's views: q (L, heads, d), k (S, kv_heads, d), v (S, kv_heads, dv), and where its
# output (L, heads, dv) and lse (L, heads) go.
Seq = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


class _Walk:
    """One call's shared state: the sequences, scale, visibility rule and tile sizes."""

    def __init__(
        self,
        seqs: list[Seq],
        scale: float,
        causal: bool,
        window: Any,
        dtype: np.dtype,
        block_rows: int,
        block_k: int,
    ) -> None:
        self.seqs, self.dt = seqs, dtype
        self.group = seqs[0][0].shape[1] // seqs[0][1].shape[1] if seqs else 1
        self.scale = dtype.type(scale)
        self.rule = (causal, window)
        self.rows = max(1, block_rows // self.group)  # queries per tile
        self.bk = max(1, block_k)
        self.edges: dict[tuple[int, bytes, bytes], np.ndarray] = {}
        self.bad: set[int] = set()  # sequences with a non-finite output

    def items(self, threads: int) -> list[tuple[int, int, int, int]]:
        """``(sequence, kv head, first query, end query)``, costliest first (the threads then
        end together); sequences are cut into runs of query tiles when there are too few
        ``(sequence, kv head)`` pairs to keep every thread busy."""
        pairs = sum(k.shape[1] for q, k, *_ in self.seqs if q.shape[0] and k.shape[0])
        split = -(-4 * threads // max(pairs, 1)) if threads > 1 else 1
        items, cost = [], []
        for i, (q, k, *_) in enumerate(self.seqs):
            L, S = q.shape[0], k.shape[0]
            if not (L and S):
                continue
            tiles = -(-L // self.rows)
            step = self.rows * -(-tiles // min(split, tiles))
            for r0 in range(0, L, step):
                r1 = min(r0 + step, L)
                seen = min(S, S - L + r1) if self.rule[0] else S  # keys of its last row
                for h in range(k.shape[1]):
                    items.append((i, h, r0, r1))
                    cost.append((r1 - r0) * max(seen, 1))
        order = np.argsort(-np.asarray(cost, dtype=np.int64), kind="stable")
        return [items[j] for j in order.tolist()]

    def item(self, it: tuple[int, int, int, int]) -> None:
        """Query rows ``[start, end)`` of one sequence for the query heads of kv head ``h``."""
        i, h, start, end = it
        qs, ks, vs, outs, lses = self.seqs[i]
        L, S = qs.shape[0], ks.shape[0]
        g, dt = self.group, self.dt
        k = ks[:, h]
        if k.dtype != dt:
            k = k.astype(dt)
        va = np.empty((S, vs.shape[2] + 1), dtype=dt)
        va[:, :-1] = vs[:, h]
        va[:, -1] = 1
        knorm = np.sqrt(np.einsum("ij,ij->i", k, k))
        tau = _safe_tau(va[:, :-1], S, dt)
        heads = slice(h * g, (h + 1) * g)
        pos = np.arange(L, dtype=np.int64) + (S - L)
        lo_all, hi_all = key_bounds(pos, S, *self.rule)
        for r0 in range(start, end, self.rows):
            r1 = min(r0 + self.rows, end)
            q = np.multiply(qs[r0:r1, heads], self.scale, dtype=dt)
            acc, m = self.tile(
                q.reshape(-1, q.shape[2]), k, va, knorm, lo_all[r0:r1], hi_all[r0:r1], tau
            )
            out, lse = finish(acc[:, :-1], acc[:, -1], m)
            if not np.isfinite(out).all():
                self.bad.add(i)
            outs[r0:r1, heads] = out.reshape(r1 - r0, g, -1)
            lses[r0:r1, heads] = lse.reshape(r1 - r0, g)

    def tile(
        self,
        q: np.ndarray,
        k: np.ndarray,
        va: np.ndarray,
        knorm: np.ndarray,
        lo: np.ndarray,
        hi: np.ndarray,
        tau: float,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Stacked rows ``q`` (scaled) against their keys: accumulator (values and sums) and
        offsets per row."""
        g, dt = self.group, self.dt
        n = q.shape[0]
        first, last = int(lo[0]), int(hi[-1])
        acc = np.zeros((n, va.shape[1]), dtype=dt)
        bounded = False
        if last > first:  # Cauchy-Schwarz: |q·k| <= |q| max|k|
            qn = np.sqrt(np.einsum("ij,ij->i", q, q))
            bounded = float(np.max(qn)) * float(np.max(knorm[first:last])) <= tau
        m = np.full(n, 0.0 if bounded else -np.inf, dtype=dt)
        if bounded:  # scores in log2 units: exp2 is about twice as fast as exp on them
            q = q * dt.type(_LOG2E)
        buf = np.empty(n * min(self.bk, max(last - first, 1)), dtype=dt)
        for c0, c1 in self.pieces(lo, hi):
            a = int(np.searchsorted(hi, c0, side="right"))  # queries [a, b) see keys here
            b = int(np.searchsorted(lo, c1, side="left"))
            if a >= b:
                continue
            rows = slice(a * g, b * g)
            s = buf[: (b - a) * g * (c1 - c0)].reshape((b - a) * g, c1 - c0)
            np.matmul(q[rows], k[c0:c1].T, out=s)
            hidden = None
            if lo[b - 1] > c0 or hi[a] < c1:  # some row's bound falls inside the block
                hidden = self.edge(lo[a:b] - c0, hi[a:b] - c0, c1 - c0)[:, None, :]
            if bounded:
                # Every score is finite and within ±tau: no -inf or underflow, which exp2 is
                # slow on; hidden keys get weight 0 after the exponential.
                np.exp2(s, out=s)
                if hidden is not None:
                    np.copyto(s.reshape(b - a, g, -1), 0, where=hidden)
            else:
                if hidden is not None:
                    np.copyto(s.reshape(b - a, g, -1), -np.inf, where=hidden)
                self.move_offsets(s, m[rows], acc[rows], tau)
                np.exp(s, out=s)
            acc[rows] += s @ va[c0:c1]
        return acc, m

    def edge(self, lo: np.ndarray, hi: np.ndarray, n: int) -> np.ndarray:
        """Boolean ``(rows, n)``: True where key ``j`` of the piece is outside row ``i``'s
        ``[lo_i, hi_i)`` (both relative to the piece). Causal and windows repeat the same
        few patterns along the diagonal, so they are built once (a few kept) and reused."""
        key = (n, lo.tobytes(), hi.tobytes())
        tile = self.edges.get(key)
        if tile is None:
            j = np.arange(n)
            tile = (j < lo[:, None]) | (j >= hi[:, None])
            if len(self.edges) < 64:  # bound the memory; a dict write is atomic
                self.edges[key] = tile
        return tile

    def pieces(self, lo: np.ndarray, hi: np.ndarray) -> list[tuple[int, int]]:
        """Key ranges to visit (:func:`~qkv.engine.kernels.blocks.key_pieces`)."""
        return key_pieces(lo, hi, self.bk, self.rows)

    def move_offsets(self, s: np.ndarray, m: np.ndarray, acc: np.ndarray, tau: float) -> None:
        """The running maximum: raise a row's offset to the block's maximum when that exceeds
        it by more than ``tau`` (rescaling what the row holds), then subtract it from ``s``."""
        dt = self.dt
        top = s.max(axis=1)
        grow = top > m + tau  # NaN rows stay put and propagate through s
        if grow.any():
            new = np.where(grow, top, m)
            alpha = np.exp(np.where(grow, m, 0) - np.where(grow, new, 0))  # m = -inf: 0
            acc *= alpha[:, None]
            m[...] = new
        if np.any(m != 0):
            s -= np.where(m == -np.inf, dt.type(0), m)[:, None]  # +inf - +inf: NaN, as reference


def _safe_tau(v: np.ndarray, S: int, dtype: np.dtype) -> float:
    """``TAU``, lowered so that ``exp(tau) · S · max|v|`` stays far below the dtype's maximum."""
    if v.size == 0:
        return TAU
    vmax = float(np.max(np.abs(v), where=np.isfinite(v), initial=0.0))
    if vmax == 0.0:
        return TAU
    room = np.log(float(np.finfo(dtype).max)) - np.log(vmax * max(S, 1)) - 8.0
    return max(0.0, min(TAU, float(room)))


def attend(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    cq: np.ndarray,
    ck: np.ndarray,
    *,
    scale: float,
    causal: bool = False,
    window: Any = None,
    dtype: Any = None,
    seqs: np.ndarray | None = None,
    bad: set[int] | None = None,
    block_rows: int = BLOCK_ROWS,
    block_k: int = BLOCK_K,
    threads: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Attention of every packed sequence alone: output ``(total_q, heads, dv)`` and lse
    ``(total_q, heads)`` in ``dtype`` (the compute dtype, float32 or float64; default: that of
    ``q``, ``k`` and ``v``, float16 computed in float32). No argument checks: ``heads`` a
    multiple of ``kv_heads``, offsets valid, the window already checked. ``seqs``: the
    sequences to compute (default all); the rows of the others stay 0 and ``-inf``. ``bad``,
    if given, receives the sequences with a non-finite output (NaN or inf inputs, or scores
    beyond the compute dtype, which :func:`qkv.engine.kernels.dispatch.attend` can redo).

    Examples
    --------
    >>> import numpy as np
    >>> from qkv import reference
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 7, 2, 4))       # 7 tokens, 2 heads, d = 4
    >>> cu = np.array([0, 3, 7])
    >>> out, lse = attend(q, k, v, cu, cu, scale=0.5, causal=True, block_rows=2, block_k=2)
    >>> one = reference.attention(*(x[3:].transpose(1, 0, 2) for x in (q, k, v)), causal=True)
    >>> bool(np.allclose(out[3:], one.transpose(1, 0, 2)))
    True
    """
    if dtype is None:
        dtype = np.result_type(np.float32, q, k, v)
    dt = np.dtype(dtype)
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]), dtype=dt)
    lse = np.full(q.shape[:2], -np.inf, dtype=dt)
    chosen = list(range(len(cq) - 1)) if seqs is None else np.asarray(seqs).tolist()
    views = []
    for b in chosen:
        sq, sk = slice(int(cq[b]), int(cq[b + 1])), slice(int(ck[b]), int(ck[b + 1]))
        views.append((q[sq], k[sk], v[sk], out[sq], lse[sq]))
    walk = _Walk(views, scale, causal, window, dt, block_rows, block_k)
    n = workers(threads)
    items = walk.items(n)
    if items:
        parallel_map(walk.item, items, n)
    if bad is not None:
        bad.update(chosen[i] for i in walk.bad)
    return out, lse


def attend_plan(
    plan: Plan,
    *,
    block_rows: int = BLOCK_ROWS,
    block_k: int = BLOCK_K,
    threads: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The walk on a checked plan (the router's "packed walk": no mask, bias or score variant,
    heads on axis -3): each batch index is one sequence, read
    through views. Output ``(*batch, L, dv)`` and lse ``(*batch, L)`` in the compute dtype.

    Examples
    --------
    >>> import numpy as np
    >>> from qkv import reference, validate
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((4, 9, 4)), *rng.standard_normal((2, 2, 9, 4))
    >>> out, lse = attend_plan(validate.make_plan(q, k, v, causal=True), block_rows=4, block_k=3)
    >>> bool(np.allclose(out, reference.attention(q, k, v, causal=True)))
    True
    """
    dt = plan.acc_dtype
    out = np.zeros(plan.batch + (plan.L, plan.dv), dtype=dt)
    lse = np.full(plan.batch + (plan.L,), -np.inf, dtype=dt)
    outer = plan.batch[:-1]
    k = np.broadcast_to(plan.k, outer + plan.k.shape[-3:])
    assert plan.v is not None  # packed attention computes outputs: its plans carry values
    v = np.broadcast_to(plan.v, outer + plan.v.shape[-3:])
    views = [
        (
            plan.q[idx].transpose(1, 0, 2),
            k[idx].transpose(1, 0, 2),
            v[idx].transpose(1, 0, 2),
            out[idx].transpose(1, 0, 2),
            lse[idx].T,
        )
        for idx in np.ndindex(*outer)
    ]
    walk = _Walk(views, plan.scale, plan.causal, plan.window, dt, block_rows, block_k)
    n = workers(threads)
    items = walk.items(n)
    if items:
        parallel_map(walk.item, items, n)
    return out, lse
