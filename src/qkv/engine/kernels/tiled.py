"""Tiled prefill kernel: online softmax over key blocks, never the full ``L x S`` matrix.

Must equal :func:`qkv.reference.attention`. The loop is the FlashAttention-2 recurrence, one
query tile at a time (``Bq`` rows) against key blocks of ``Bk`` columns::

    s   = k_block · q_tileᵀ · scale                  # (keys, rows): the faster GEMM layout
    m'  = new offset per row (see below)             # the "running max"
    l   = l · exp(m - m') + Σ_j exp(s_j - m')        # running sum, rescaled
    acc = acc · exp(m - m') + exp(s - m')ᵀ · v_block # rescaled accumulator
    out = acc / l,  lse = m + log l

``l`` rides along as a column of ones appended to ``v``, so the GEMM that weights the values
also sums the weights.

Memory: ``O(Bq · Bk + S · dv)`` extra per thread (one tile of scores; the values the query tile
may see, with the ones column), plus whole heads' values kept for reuse up to ``VALUES_CACHE``
bytes — never ``L x S``.

Masks: keys that causal or a window hide from every row of a tile are never visited, so causal
costs about half of full attention. Across the mask's edge the keys are visited in narrower
pieces, each with only the rows that see some of it, and a boolean tile (cached: it depends
only on the tile's shape and diagonal offset) sets the rest to -inf.

Variants: each score tile passes through :func:`qkv.engine.kernels.mods.apply` right after its GEMM
(soft-cap, ALiBi, ``score_mod``, ``mask_mod``). A ``mask_mod``'s block mask is computed once
per call on ``block_q × MASK_BLOCK_K`` tiles (``block_q`` at most ``MASK_BLOCK_Q`` then): runs
of empty blocks are never visited, and blocks it allows entirely skip the ``mask_mod``.

Grouped-query heads read their kv head's rows directly (K/V are never repeated). float16 inputs
arrive as float32 (the plan's compute dtype) and accumulate there.

The offset ``m`` is the row's running maximum, moved lazily: it only moves when a block's
maximum exceeds it by more than ``TAU``, and it stays at ``0`` while the scores are within
``±TAU``. When Cauchy-Schwarz (``|q·k| <= |q| max|k|``) proves that for a whole tile in advance,
no maximum is taken at all; for ordinary attention logits that means no subtraction pass and no
rescaling. Exponentials are then at most ``exp(TAU)``; ``TAU`` is lowered for huge values so the
accumulator cannot overflow.
"""

from __future__ import annotations

import math
import threading

import numpy as np

from ...masks import allowed, key_bounds, query_positions
from ...validate import Plan
from . import mods
from .blocks import finish, key_pieces
from .threads import parallel_map

__all__ = ["BLOCK_K", "BLOCK_Q", "TAU", "attend"]

BLOCK_Q = 768
BLOCK_K = 1024
TAU = 40.0
VALUES_CACHE = 64 << 20  # bytes of whole kv heads' values (with ones) kept for reuse per call
MASK_BLOCK_K = 128  # keys per block of a mask_mod's block mask (empty runs of them are skipped)
MASK_BLOCK_Q = 256  # query rows per tile with a mask_mod: finer tiles skip more (bench/variants.py)


def _kv_index(idx: tuple[int, ...], group: int) -> tuple[int, ...]:
    """Index of the kv head serving query batch index ``idx`` (heads are axis -3)."""
    if group == 1 or not idx:
        return idx
    return idx[:-1] + (idx[-1] // group,)


def _safe_tau(v: np.ndarray, S: int, dtype: np.dtype) -> float:
    """``TAU``, lowered so that ``exp(tau) · S · max|v|`` stays far below the dtype's maximum."""
    if v.size == 0:
        return TAU
    vmax = float(np.max(np.abs(v), where=np.isfinite(v), initial=0.0))  # NaN/inf: their rows
    if vmax == 0.0:
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
        self.rule = (plan.causal, plan.window)
        self.qscale = self.dt.type(plan.scale)
        full = plan.batch + (self.L, self.S)
        self.mask = None if plan.mask is None else np.broadcast_to(plan.mask, full)
        self.bias = None if plan.bias is None else np.broadcast_to(plan.bias, full)
        assert plan.v is not None  # the tiled kernel computes outputs: its plans carry values
        self.tau = _safe_tau(plan.v, self.S, self.dt)
        self.out = np.zeros(plan.batch + (self.L, plan.dv), dtype=self.dt)
        self.lse = np.full(plan.batch + (self.L,), -np.inf, dtype=self.dt)
        self.local = threading.local()  # per-thread score buffer, reused across tiles
        self.edges: dict[tuple[int, int, int], np.ndarray] = {}
        self.norms: dict[tuple[int, ...], np.ndarray] = {}
        self.vaug: dict[tuple[int, ...], np.ndarray] = {}
        self.vaug_bytes = 0
        self.gk = min(block_k, MASK_BLOCK_K)
        self.blocks = mods.block_mask(plan, block_q, self.gk)  # None without a mask_mod

    def scratch(self, rows: int, cols: int) -> np.ndarray:
        """A reused ``(rows, cols)`` buffer of this thread (fresh arrays cost page faults)."""
        buf = getattr(self.local, "buf", None)
        if buf is None:
            buf = self.local.buf = np.empty(self.bq * self.bk, dtype=self.dt)
        return buf[: rows * cols].reshape(rows, cols)

    def edge(self, r0: int, r1: int, c0: int, c1: int) -> np.ndarray:
        """Boolean ``(keys, rows)`` tile, True where causal/window hide the key from the row.

        The scores there are overwritten with -inf (not added to: an infinite score plus -inf
        would be NaN). It depends only on the tile's shape and diagonal offset, so it is built
        once and reused.
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
            assert ok is not None  # plan.structured: causal or windowed, so a tile comes back
            tile = np.ascontiguousarray(~ok.T)
            if len(self.edges) < 8:  # a few offsets recur; bound the memory anyway
                self.edges[key] = tile
        return tile

    def values_and_ones(self, kidx: tuple[int, ...], lo: int, hi: int) -> tuple[np.ndarray, int]:
        """Values of kv head ``kidx`` with a column of ones appended, and the first key they
        hold: the GEMM that weights the values then also sums the weights (one pass over the
        scores fewer). Whole heads are kept for reuse up to ``VALUES_CACHE`` bytes in all;
        beyond that each tile copies just its keys ``[lo, hi)``."""
        va = self.vaug.get(kidx)
        if va is not None:
            return va, 0
        assert self.plan.v is not None  # checked in __init__
        v = self.plan.v[kidx]
        whole = v.shape[0] * (v.shape[1] + 1) * self.dt.itemsize
        keep = self.vaug_bytes + whole <= VALUES_CACHE
        if keep:
            lo, hi = 0, v.shape[0]
        va = np.empty((hi - lo, v.shape[1] + 1), dtype=self.dt)
        va[:, :-1] = v[lo:hi]
        va[:, -1] = 1
        if keep:
            self.vaug[kidx] = va
            self.vaug_bytes += whole
        return va, lo

    def key_norms(self, kidx: tuple[int, ...]) -> np.ndarray:
        """Euclidean norm of every key of kv head ``kidx`` (computed once per call)."""
        norms = self.norms.get(kidx)
        if norms is None:
            k = self.plan.k[kidx]
            norms = self.norms[kidx] = np.sqrt(np.einsum("ij,ij->i", k, k))
        return norms

    def row_bounds(self, r0: int, r1: int) -> tuple[np.ndarray, np.ndarray]:
        """Per query row of ``r0..r1-1``: keys ``[lo, hi)`` it may attend (both nondecreasing)."""
        rows = range(r0, r1)
        return key_bounds(query_positions(self.L, self.S, rows), self.S, *self.rule)

    def pieces(self, los: np.ndarray, his: np.ndarray) -> list[tuple[int, int]]:
        """Key ranges to visit (:func:`~qkv.engine.kernels.blocks.key_pieces`)."""
        lo, hi, bk = int(los[0]), int(his[-1]), self.bk
        if not self.plan.structured:
            return [(c, min(c + bk, hi)) for c in range(lo, hi, bk)]
        return key_pieces(los, his, bk, self.bq)

    def visit(
        self, idx: tuple[int, ...], r0: int, pieces: list[tuple[int, int]]
    ) -> list[tuple[int, int, bool]]:
        """``(c0, c1, full)`` for each piece, split by the ``mask_mod``'s block mask: runs of
        empty blocks are dropped, and ``full`` says no ``mask_mod`` needs evaluating."""
        if self.blocks is None:
            return [(c0, c1, True) for c0, c1 in pieces]
        status, g, out = self.blocks[idx][r0 // self.bq], self.gk, []
        for c0, c1 in pieces:
            j, end = c0 // g, -(-c1 // g)
            while j < end:
                if status[j] == mods.EMPTY:
                    j += 1
                    continue
                e = j
                while e < end and status[e] != mods.EMPTY:
                    e += 1
                full = bool(np.all(status[j:e] == mods.FULL))
                out.append((max(c0, j * g), min(c1, e * g), full))
                j = e
        return out

    def run(self, item: tuple[tuple[int, ...], int, int]) -> None:
        """One work item: query rows ``[r0, r1)`` of batch index ``idx`` against their keys."""
        idx, r0, r1 = item
        tile = _Tile(self, idx, r0, r1)
        for c0, c1, full in self.visit(idx, r0, self.pieces(tile.los, tile.his)):
            # only rows [a, b) of the tile see any key of [c0, c1)
            a = int(np.searchsorted(tile.his, c0, side="right"))
            b = int(np.searchsorted(tile.los, c1, side="left"))
            if a < b:
                s = self.scores(tile, a, b, c0, c1, full)
                tile.accumulate(s, a, b, c0, c1)
        out, lse = finish(tile.acc[:, :-1], tile.acc[:, -1], tile.m)
        self.out[idx][r0:r1] = out
        self.lse[idx][r0:r1] = lse

    def scores(self, tile: _Tile, a: int, b: int, c0: int, c1: int, full: bool) -> np.ndarray:
        """Scaled scores of keys ``[c0, c1)`` against the tile's rows ``[a, b)``, ``(keys,
        rows)``, with the variants, bias and masks applied (``-inf`` where a key is hidden)."""
        plan, idx, r0 = self.plan, tile.idx, tile.r0
        s = self.scratch(c1 - c0, b - a)
        np.matmul(tile.k[c0:c1], tile.qt[:, a:b], out=s)
        if plan.modded:  # soft-cap, ALiBi, score_mod, mask_mod on this (keys, rows) tile
            qi = np.arange(r0 + a, r0 + b)[None, :] + (self.S - self.L)
            mods.apply(plan, s, idx, qi, np.arange(c0, c1)[:, None], full=full)
        if self.bias is not None:
            s += self.bias[idx][r0 + a : r0 + b, c0:c1].T
        if tile.los[b - 1] > c0 or tile.his[a] < c1:  # the piece crosses causal/window's edge
            np.copyto(s, -np.inf, where=self.edge(r0 + a, r0 + b, c0, c1))
        if self.mask is not None:
            s[~self.mask[idx][r0 + a : r0 + b, c0:c1].T] = -np.inf
        return s


class _Tile:
    """The running state of one query tile: its queries, key bounds, offsets and accumulator."""

    def __init__(self, prob: _Problem, idx: tuple[int, ...], r0: int, r1: int) -> None:
        plan, dt = prob.plan, prob.dt
        self.prob, self.idx, self.r0 = prob, idx, r0
        self.tau, self.dt = prob.tau, dt
        kidx = _kv_index(idx, plan.group)
        self.k = plan.k[kidx]
        # Queries as columns, scale folded in: scores come out as (keys, rows), the faster GEMM.
        self.qt = np.ascontiguousarray((plan.q[idx][r0:r1] * prob.qscale).T)
        self.los, self.his = prob.row_bounds(r0, r1)
        lo, hi = int(self.los[0]), int(self.his[-1])
        self.v, self.v0 = prob.values_and_ones(kidx, lo, hi)
        self.bounded = self.offsets_fixed(kidx, lo, hi)
        rows = r1 - r0
        self.m = np.full(rows, 0.0 if self.bounded else -np.inf, dtype=dt)  # lazy row max
        self.acc = np.zeros((rows, plan.dv + 1), dtype=dt)  # last column: the denominators

    def offsets_fixed(self, kidx: tuple[int, ...], lo: int, hi: int) -> bool:
        """Whether Cauchy-Schwarz (``|q·k| <= |q| max|k|``) keeps every score of the tile
        within ``±tau``, so that no row needs an offset at all."""
        prob, plan = self.prob, self.prob.plan
        plain = prob.bias is None and plan.alibi is None and plan.score_mod is None
        if not plain or hi <= lo:
            return False
        qn = np.sqrt(np.einsum("ij,ij->j", self.qt, self.qt))
        bound = float(np.max(qn)) * float(np.max(prob.key_norms(kidx)[lo:hi]))
        return bound <= self.tau  # False for NaN or inf

    def accumulate(self, s: np.ndarray, a: int, b: int, c0: int, c1: int) -> None:
        """Fold the score block ``s`` (keys ``[c0, c1)``, rows ``[a, b)``) into the rows'
        offsets, denominators and weighted values; ``s`` is overwritten."""
        if not self.bounded:
            self.move_offsets(s, a, b)
        np.exp(s, out=s)  # (exp2 is faster on plain numbers but slow on -inf and underflow)
        self.acc[a:b] += s.T @ self.v[c0 - self.v0 : c1 - self.v0]

    def move_offsets(self, s: np.ndarray, a: int, b: int) -> None:
        """The lazy running max: raise a row's offset only when the block's maximum exceeds it
        by more than ``tau`` (rescaling what it accumulated), then subtract it from ``s``."""
        dt, tau, m = self.dt, self.tau, self.m
        ma = m[a:b]
        mt = s.max(axis=0)
        grow = mt > ma + tau  # NaN rows stay put and propagate through s
        if grow.any():
            centred = (mt <= tau) & (mt >= -tau)
            new = np.where(grow, np.where(centred, dt.type(0), mt), ma)
            # m = -inf (nothing accumulated yet) gives alpha = 0; others keep 1.
            alpha = np.exp(np.where(grow, ma, 0) - np.where(grow, new, 0))
            self.acc[a:b] *= alpha[:, None]  # the denominators too (last column)
            m[a:b] = new
        if np.any(ma != 0):
            s -= np.where(ma == -np.inf, dt.type(0), ma)  # +inf - +inf: NaN, as reference


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
        Query rows and keys per tile; extra memory is about ``block_q · block_k + S · dv`` per
        thread.
    threads : int, optional
        Worker threads (default: as :func:`~qkv.engine.kernels.threads.workers` decides).

    Examples
    --------
    >>> import numpy as np
    >>> from qkv import reference, validate
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 2, 7, 4))
    >>> plan = validate.make_plan(q, k, v, causal=True)
    >>> out, lse = attend(plan, block_q=3, block_k=2)
    >>> bool(np.allclose(out, reference.attention(q, k, v, causal=True)))
    True
    """
    if plan.mask_mod is not None:
        block_q = min(block_q, MASK_BLOCK_Q)
    prob = _Problem(plan, max(1, int(block_q)), max(1, int(block_k)))
    if plan.L and plan.S:  # otherwise every row is empty: out 0, lse -inf as allocated
        parallel_map(prob.run, _items(plan, prob.bq), threads)
    return prob.out, prob.lse
