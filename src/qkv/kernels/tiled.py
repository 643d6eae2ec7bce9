"""Tiled prefill kernel: online softmax over key blocks, never the full ``L x S`` matrix.

Must equal :func:`qkv.reference.attention`. The loop is the FlashAttention-2 recurrence, one
query tile at a time (``Bq`` rows) against key blocks of ``Bk`` columns::

    s   = q_tile · k_blockᵀ · scale
    m'  = new offset per row (see below)             # the "running max"
    l   = l · exp(m - m') + Σ_j exp(s_j - m')        # running sum, rescaled
    acc = acc · exp(m - m') + exp(s - m') · v_block  # rescaled accumulator
    out = acc / l,  lse = m + log l

Extra memory is ``O(Bq · Bk)`` per thread. Tiles that causal or a window mask entirely are
never computed, so causal costs about half of full attention; only tiles that cross the mask's
edge build a boolean mask. Grouped-query heads read their kv head's rows directly (no repeated
K/V). float16 inputs arrive as float32 (the plan's compute dtype) and accumulate there.

The offset ``m`` is the row's running maximum, moved lazily: it only moves when a block's
maximum exceeds it by more than ``TAU``, and it stays at ``0`` while the scores
are within ``±TAU``, which for ordinary attention logits means no subtraction pass and no
rescaling at all. Exponentials are then at most ``exp(TAU)``; ``TAU`` is lowered for huge values
so the accumulator cannot overflow.
"""

from __future__ import annotations

import math
import threading

import numpy as np

from ..masks import allowed, key_range
from ..validate import Plan
from ._threads import parallel_map

__all__ = ["BLOCK_K", "BLOCK_Q", "TAU", "attend"]

BLOCK_Q = 512
BLOCK_K = 1024
TAU = 40.0


def _kv_index(idx: tuple[int, ...], group: int) -> tuple[int, ...]:
    """Index of the kv head serving query batch index ``idx`` (heads are axis -3)."""
    if group == 1 or not idx:
        return idx
    return idx[:-1] + (idx[-1] // group,)


def _safe_tau(v: np.ndarray, S: int, dtype: np.dtype) -> float:
    """``TAU``, lowered so that ``exp(tau) · S · max|v|`` stays far below the dtype's maximum."""
    if v.size == 0:
        return TAU
    vmax = float(max(np.max(v), -np.min(v)))
    if not math.isfinite(vmax) or vmax == 0.0:
        return TAU
    room = math.log(float(np.finfo(dtype).max)) - math.log(vmax * max(S, 1)) - 8.0
    return max(0.0, min(TAU, room))


class _Problem:
    """What every work item of one call shares: views, masks, sizes, tile shape, scratch."""

    def __init__(self, plan: Plan, block_q: int, block_k: int) -> None:
        self.plan = plan
        self.dt = plan.acc_dtype
        self.L, self.S = plan.L, plan.S
        self.bq, self.bk = block_q, block_k
        self.qscale = self.dt.type(plan.scale)
        full = plan.batch + (self.L, self.S)
        self.mask = None if plan.mask is None else np.broadcast_to(plan.mask, full)
        self.bias = None if plan.bias is None else np.broadcast_to(plan.bias, full)
        self.tau = _safe_tau(plan.v, self.S, self.dt)
        self.out = np.zeros(plan.batch + (self.L, plan.dv), dtype=self.dt)
        self.lse = np.full(plan.batch + (self.L,), -np.inf, dtype=self.dt)
        self.local = threading.local()  # per-thread score buffer, reused across tiles
        self.edges: dict[tuple[int, int, int], np.ndarray] = {}
        self.norms: dict[tuple[int, ...], np.ndarray] = {}

    def scratch(self, rows: int, cols: int) -> np.ndarray:
        """A reused ``(rows, cols)`` buffer of this thread (fresh arrays cost page faults)."""
        buf = getattr(self.local, "buf", None)
        if buf is None:
            buf = self.local.buf = np.empty(self.bq * self.bk, dtype=self.dt)
        return buf[: rows * cols].reshape(rows, cols)

    def key_bounds(self, r: int) -> tuple[int, int]:
        """Keys ``[lo, hi)`` that query row ``r`` may attend; both grow with ``r``."""
        return key_range(self.S - self.L + r, self.S, self.plan.causal, self.plan.window)

    def edge(self, r0: int, r1: int, c0: int, c1: int) -> np.ndarray:
        """Additive ``(keys, rows)`` tile, 0 where causal/window allow and -inf elsewhere.

        It depends only on the tile's shape and diagonal offset, so it is built once and reused.
        """
        key = (r1 - r0, c1 - c0, c0 - r0)
        tile = self.edges.get(key)
        if tile is None:
            ok = allowed(
                self.L,
                self.S,
                causal=self.plan.causal,
                window=self.plan.window,
                rows=range(r0, r1),
                cols=range(c0, c1),
            )
            tile = np.ascontiguousarray(np.where(ok.T, self.dt.type(0), self.dt.type(-np.inf)))
            if len(self.edges) < 4:  # a few offsets recur; bound the memory anyway
                self.edges[key] = tile
        return tile

    def key_norms(self, kidx: tuple[int, ...]) -> np.ndarray:
        """Euclidean norm of every key of kv head ``kidx`` (computed once per call)."""
        norms = self.norms.get(kidx)
        if norms is None:
            k = self.plan.k[kidx]
            norms = self.norms[kidx] = np.sqrt(np.einsum("ij,ij->i", k, k))
        return norms

    def run(self, item: tuple[tuple[int, ...], int, int]) -> None:
        idx, r0, r1 = item
        plan, dt, tau = self.plan, self.dt, self.tau
        kidx = _kv_index(idx, plan.group)
        k, v = plan.k[kidx], plan.v[kidx]
        # Queries as columns, scale folded in: scores come out as (keys, rows), the faster GEMM.
        qt = np.ascontiguousarray((plan.q[idx][r0:r1] * self.qscale).T)
        (lo, inner_hi), (inner_lo, hi) = self.key_bounds(r0), self.key_bounds(r1 - 1)
        if not plan.structured or inner_lo > inner_hi:
            inner_lo = inner_hi = hi if plan.structured else lo
        # Every row sees keys [inner_lo, inner_hi); only keys outside it need an edge mask.
        rows = r1 - r0
        # Cauchy-Schwarz: |q·k| <= |q| max|k|. Within ±tau no row needs an offset at all.
        bounded = False
        if self.bias is None and hi > lo:
            qn = np.sqrt(np.einsum("ij,ij->j", qt, qt))
            bound = float(np.max(qn)) * float(np.max(self.key_norms(kidx)[lo:hi]))
            bounded = bound <= tau  # False for NaN or inf
        m = np.full(rows, 0.0 if bounded else -np.inf, dtype=dt)  # per-row offset, lazy max
        denom = np.zeros(rows, dtype=dt)
        acc = np.zeros((rows, plan.dv), dtype=dt)
        for c0 in range(lo, hi, self.bk):
            c1 = min(c0 + self.bk, hi)
            s = self.scratch(c1 - c0, rows)
            np.matmul(k[c0:c1], qt, out=s)
            if self.bias is not None:
                s += self.bias[idx][r0:r1, c0:c1].T
            if plan.structured:
                for e0, e1 in ((c0, min(c1, inner_lo)), (max(c0, inner_hi), c1)):
                    if e0 < e1:
                        s[e0 - c0 : e1 - c0] += self.edge(r0, r1, e0, e1)
            if self.mask is not None:
                s[~self.mask[idx][r0:r1, c0:c1].T] = -np.inf
            if not bounded:
                mt = s.max(axis=0)
                grow = mt > m + tau  # NaN rows stay put and propagate through s
                if grow.any():
                    centred = (mt <= tau) & (mt >= -tau)
                    new = np.where(grow, np.where(centred, dt.type(0), mt), m)
                    # m = -inf (nothing accumulated yet) gives alpha = 0; others keep 1.
                    alpha = np.exp(np.where(grow, m, 0) - np.where(grow, new, 0))
                    denom *= alpha
                    acc *= alpha[:, None]
                    m = new
                if np.any(m != 0):
                    s -= np.where(np.isfinite(m), m, dt.type(0))
            np.exp(s, out=s)  # (exp2 is faster on plain numbers but slow on -inf and underflow)
            denom += s.sum(axis=0)
            acc += s.T @ v[c0:c1]
        empty = denom == 0  # rows that may attend no key: output 0, lse -inf (NaN rows stay NaN)
        acc /= np.where(empty, dt.type(1), denom)[:, None]
        acc[empty] = 0
        with np.errstate(divide="ignore"):
            lse = m + np.log(denom)
        lse[empty] = -np.inf
        self.out[idx][r0:r1] = acc
        self.lse[idx][r0:r1] = lse


def _items(plan: Plan, block_q: int) -> list[tuple[tuple[int, ...], int, int]]:
    """Work items ``(batch index, first row, end row)``, costliest first for causal."""
    items = [
        (idx, r0, min(r0 + block_q, plan.L))
        for idx in np.ndindex(*plan.batch)
        for r0 in range(0, plan.L, block_q)
    ]
    if plan.causal:  # late rows see more keys: start them first so the threads end together
        items.sort(key=lambda it: -it[2])
    return items


def attend(
    plan: Plan,
    *,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    threads: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Tiled attention: output ``(*batch, L, dv)`` and lse ``(*batch, L)``, compute dtype.

    Must equal :func:`qkv.reference.attention` on the same plan.

    Parameters
    ----------
    plan : Plan
        A checked problem from :func:`qkv.validate.make_plan`.
    block_q, block_k : int, optional
        Query rows and keys per tile; extra memory is about ``block_q · block_k`` numbers per
        thread.
    threads : int, optional
        Worker threads (default: every core this process may use).

    Examples
    --------
    >>> import numpy as np
    >>> from qkv import reference
    >>> from qkv.validate import make_plan
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 2, 7, 4))
    >>> plan = make_plan(q, k, v, causal=True)
    >>> out, lse = attend(plan, block_q=3, block_k=2)
    >>> bool(np.allclose(out, reference.attention(q, k, v, causal=True)))
    True
    """
    prob = _Problem(plan, max(1, int(block_q)), max(1, int(block_k)))
    if plan.L and plan.S:  # otherwise every row is empty: out 0, lse -inf as allocated
        parallel_map(prob.run, _items(plan, prob.bq), threads)
    return prob.out, prob.lse
