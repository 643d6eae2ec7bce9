"""Compiled prefill: one online-softmax walk for a single prompt and for packed batches.

The tile products stay with NumPy's BLAS (``np.matmul``, which OpenBLAS runs faster than any
loop Numba compiles); everything between them — the mask of each row, the running maximum,
rescaling what a row has accumulated, the exponentials and the row sums — is one compiled pass
over the score block (:func:`_fold`), where NumPy needs five or more passes and temporaries.

Work is cut into items ``(sequence, kv head, query rows)``. The ``group`` query heads that share
a kv head are stacked as rows (row ``t`` is query ``t // group`` of head ``t % group``), so each
key block is read once for the whole group and the products are wider. Rows see keys by
:func:`qkv.masks.key_bounds` (bottom-right causal, windows); key blocks no row of an item sees
are never visited. The items run on qkv's worker threads (:func:`parallel_map`); the compiled
step releases the GIL.

A single prefill ``(*batch, L, d)`` and a packed batch ``(total, heads, d)`` with cumulative
offsets are the same walk (:func:`attend` and :func:`attend_packed`); only the views of the
rows differ. Plain problems only: masks, biases and score variants stay with the NumPy kernels.

Numerics: NaN in a row's scores makes the row NaN, a row that sees no key gives output 0 and
lse ``-inf`` (:func:`qkv.kernels.blocks.finish`), as the reference does. ``exp`` is computed by
a branch-free polynomial (Numba without Intel's SVML would call the C library once per score);
its relative error is a few units in the last place, and weights below ``2**-126`` (float32) or
``2**-1022`` (float64) are flushed to 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numba
import numpy as np

from ...masks import key_bounds
from .._threads import parallel_map
from ..blocks import finish

__all__ = ["BLOCK_K", "BLOCK_ROWS", "attend", "attend_packed", "supports"]

BLOCK_ROWS = 512  # stacked rows (queries × heads of a group) per item
BLOCK_K = 512  # keys per block: a 512 × 512 float32 score block (1 MiB) stays in L2

_LN2_HI = 0.693145751953125  # ln 2 in two parts: k · _LN2_HI is exact for |k| < 2**11
_LN2_LO = 1.4286068203094173e-06


def _exp_constants(dt: np.dtype) -> np.ndarray:
    """``log2(e)``, ``ln 2`` (two parts), the lowest power of two kept, then the Taylor
    coefficients of ``exp(r)`` to degree 11 (error below ``2**-53`` for ``|r| <= ln(2)/2``),
    in ``dt``: the compiled code then computes in ``dt``, float32 at float32's width."""
    lowest = -125.0 if dt == np.float32 else -1021.0
    coef = [1.0 / math.factorial(i) for i in range(12)]
    return np.array([1.0 / math.log(2.0), _LN2_HI, _LN2_LO, lowest, *coef], dtype=dt)


_FAST = {"reassoc", "contract"}  # never nnan/ninf: -inf masks and NaN must behave


@numba.njit(nogil=True, cache=True, fastmath=_FAST)
def _exp_row(x: Any, bits: Any, two: Any, c: Any, shift: int, bias: int) -> None:
    """``x = exp(x)`` in place for entries that are ``<= 0`` (``-inf`` included).

    ``bits`` is an integer buffer of ``x``'s width and ``two`` its float view, which receives
    ``2**k`` (``shift`` mantissa bits, exponent ``bias``); ``c`` holds the constants of
    :func:`_exp_constants`. Branch-free, so the loops compile to vector instructions.
    """
    n = x.shape[0]
    log2e, hi, lo, lowest = c[0], c[1], c[2], c[3]
    for j in range(n):
        y = x[j] * log2e
        keep = y > lowest  # -inf and deep underflow: weight 0
        y = y if keep else lowest
        k = np.floor(y + 0.5)
        r = x[j] - k * hi - k * lo
        r = r if keep else c[4] - c[4]
        p = c[15]
        p = p * r + c[14]
        p = p * r + c[13]
        p = p * r + c[12]
        p = p * r + c[11]
        p = p * r + c[10]
        p = p * r + c[9]
        p = p * r + c[8]
        p = p * r + c[7]
        p = p * r + c[6]
        p = p * r + c[5]
        p = p * r + c[4]
        bits[j] = ((np.int64(k) + bias) << shift) if keep else 0
        x[j] = p
    for j in range(n):
        x[j] *= two[j]


@numba.njit(nogil=True, cache=True, fastmath=_FAST)
def _fold(
    s: Any,
    m: Any,
    acc: Any,
    den: Any,
    lo: Any,
    hi: Any,
    group: int,
    c0: int,
    bits: Any,
    two: Any,
    c: Any,
    shift: int,
    bias: int,
) -> None:
    """Turn score block ``s`` (stacked rows × keys ``c0 ..``) into weights, in place.

    Per row ``t`` (query ``t // group``): keys outside ``[lo, hi)`` get weight 0; the running
    maximum ``m`` moves to the block's maximum where that is larger, and the row's accumulator
    ``acc`` and sum ``den`` are rescaled by ``exp(m_old - m_new)``; then ``s = exp(s - m)``
    and ``den += Σ s``. A NaN or ``+inf`` score makes the row NaN (as the reference does).
    """
    rows, nk = s.shape
    dv = acc.shape[1]
    for t in range(rows):
        i = t // group
        a = min(max(lo[i] - c0, 0), nk)
        b = min(max(hi[i] - c0, a), nk)
        row = s[t]
        for j in range(a):
            row[j] = 0.0
        for j in range(b, nk):
            row[j] = 0.0
        if b == a:
            continue
        top = row[a]
        bad = False
        for j in range(a, b):
            x = row[j]
            bad |= x != x
            top = x if x > top else top
        old = m[t]
        if bad or top == np.inf or old != old:
            for j in range(a, b):
                row[j] = np.nan
            m[t] = np.nan
            den[t] = np.nan
            continue
        if top == -np.inf and old == -np.inf:  # nothing seen yet: every weight is 0
            for j in range(a, b):
                row[j] = 0.0
            continue
        if top > old:
            if old != -np.inf:
                alpha = math.exp(old - top)
                for col in range(dv):
                    acc[t, col] *= alpha
                den[t] *= alpha
            m[t] = top
        new = m[t]
        for j in range(a, b):
            row[j] -= new
        _exp_row(row[a:b], bits, two, c, shift, bias)
        total = 0.0
        for j in range(a, b):
            total += row[j]
        den[t] += total


def supports(plan: Any) -> bool:
    """Whether the compiled walk serves ``plan``: no mask, bias or score variant, float32/64."""
    return (
        plan.mask is None
        and plan.bias is None
        and not plan.modded
        and plan.v is not None
        and plan.acc_dtype in (np.float32, np.float64)
    )


def _exp_params(dt: np.dtype) -> tuple[np.dtype, int, int]:
    """Integer type of ``dt``'s width, its mantissa bits and exponent bias."""
    if dt == np.float32:
        return np.dtype(np.int32), 23, 127
    return np.dtype(np.int64), 52, 1023


class _Walk:
    """One call's shared state: the compute dtype, scale, rule, tile sizes and outputs."""

    def __init__(
        self,
        dt: np.dtype,
        scale: float,
        causal: bool,
        window: Any,
        group: int,
        block_rows: int,
        block_k: int,
    ) -> None:
        self.dt, self.group = dt, group
        self.scale = dt.type(scale)
        self.rule = (causal, window)
        self.rows = max(1, block_rows // group)  # queries per item
        self.bk = max(1, block_k)
        self.ibits, self.shift, self.bias = _exp_params(dt)
        self.consts = _exp_constants(dt)

    def rows_of(self, L: int, S: int, r0: int, r1: int) -> tuple[np.ndarray, np.ndarray]:
        """Key bounds ``[lo, hi)`` of query rows ``r0 .. r1 - 1`` of a sequence."""
        pos = np.arange(r0, r1, dtype=np.int64) + (S - L)
        return key_bounds(pos, S, *self.rule)

    def run(
        self, q: np.ndarray, k: np.ndarray, v: np.ndarray, lo: np.ndarray, hi: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Attention of stacked queries ``q (rows, group, d)`` over ``k (S, d)``, ``v (S, dv)``:
        output ``(rows, group, dv)`` and lse ``(rows, group)``."""
        dt, g = self.dt, self.group
        R = q.shape[0]
        n = R * g
        qs = np.multiply(q, self.scale, dtype=dt).reshape(n, q.shape[2])
        m = np.full(n, -np.inf, dtype=dt)
        acc = np.zeros((n, v.shape[1]), dtype=dt)
        den = np.zeros(n, dtype=dt)
        first, last = int(lo[0]), int(hi[-1])
        bits = np.empty(self.bk, dtype=self.ibits)
        two = bits.view(dt)
        buf = np.empty(n * self.bk, dtype=dt)
        for c0 in range(first, last, self.bk):
            c1 = min(c0 + self.bk, last)
            # only queries [a, b) see any key of [c0, c1)
            a = int(np.searchsorted(hi, c0, side="right"))
            b = int(np.searchsorted(lo, c1, side="left"))
            if a >= b:
                continue
            s = buf[: (b - a) * g * (c1 - c0)].reshape((b - a) * g, c1 - c0)
            np.matmul(qs[a * g : b * g], k[c0:c1].T, out=s)
            rs = slice(a * g, b * g)
            _fold(
                s,
                m[rs],
                acc[rs],
                den[rs],
                lo[a:b],
                hi[a:b],
                g,
                c0,
                bits,
                two,
                self.consts,
                self.shift,
                self.bias,
            )
            acc[rs] += s @ v[c0:c1]
        out, lse = finish(acc, den, m)
        return out.reshape(R, g, -1), lse.reshape(R, g)


def _costliest_first(items: list[Any], cost: Callable[[Any], int]) -> list[Any]:
    return sorted(items, key=lambda it: -cost(it))


def attend(
    plan: Any,
    *,
    block_rows: int = BLOCK_ROWS,
    block_k: int = BLOCK_K,
    threads: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Compiled prefill of a plain plan (:func:`supports`): ``(out, lse)`` in the compute dtype.

    Must equal :func:`qkv.reference.attention` on the same plan.

    Examples
    --------
    >>> import numpy as np
    >>> from qkv import reference
    >>> from qkv.validate import make_plan
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 2, 7, 4))
    >>> out, lse = attend(make_plan(q, k, v, causal=True), block_rows=3, block_k=2)
    >>> bool(np.allclose(out, reference.attention(q, k, v, causal=True)))
    True
    """
    dt, g = plan.acc_dtype, plan.group
    L, S = plan.L, plan.S
    out = np.zeros(plan.batch + (L, plan.dv), dtype=dt)
    lse = np.full(plan.batch + (L,), -np.inf, dtype=dt)
    if not (L and S):
        return out, lse
    walk = _Walk(dt, plan.scale, plan.causal, plan.window, g, block_rows, block_k)
    q, k, v = plan.q, plan.k, plan.v
    # the batch without the heads axis, the kv heads, and the query rows of each item
    outer = plan.batch[:-1] if plan.batch else ()
    hkv = plan.batch[-1] // g if plan.batch else 1
    items = [
        (idx, h, r0, min(r0 + walk.rows, L))
        for idx in np.ndindex(*outer)
        for h in range(hkv)
        for r0 in range(0, L, walk.rows)
    ]

    def kv(x: np.ndarray, idx: tuple[int, ...], h: int) -> np.ndarray:
        return x[idx + (h,)] if plan.batch else x

    def one(item: tuple[tuple[int, ...], int, int, int]) -> None:
        idx, h, r0, r1 = item
        lo, hi = walk.rows_of(L, S, r0, r1)
        heads = idx + (slice(h * g, (h + 1) * g),) if plan.batch else ()
        qv = q[heads] if plan.batch else q[None]
        o, s = walk.run(np.swapaxes(qv[..., r0:r1, :], 0, 1), kv(k, idx, h), kv(v, idx, h), lo, hi)
        if plan.batch:
            out[heads][..., r0:r1, :] = np.swapaxes(o, 0, 1)
            lse[heads][..., r0:r1] = s.T
        else:
            out[r0:r1], lse[r0:r1] = o[:, 0], s[:, 0]

    if plan.causal:
        items = _costliest_first(items, lambda it: it[3])
    parallel_map(one, items, threads)
    return out, lse


def attend_packed(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    cq: np.ndarray,
    ck: np.ndarray,
    *,
    scale: float,
    causal: bool,
    window: Any,
    dtype: np.dtype,
    block_rows: int = BLOCK_ROWS,
    block_k: int = BLOCK_K,
    threads: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Packed sequences ``q (total_q, heads, d)``, ``k``/``v (total_k, kv_heads, ·)`` with
    cumulative offsets ``cq``/``ck``: output ``(total_q, heads, dv)`` and lse ``(total_q,
    heads)`` in ``dtype`` (the compute dtype). Each sequence's rows equal attention over that
    sequence alone; the window must already be clamped or ``None``."""
    heads, hkv = q.shape[1], k.shape[1]
    g = heads // hkv
    out = np.zeros((q.shape[0], heads, v.shape[2]), dtype=dtype)
    lse = np.full((q.shape[0], heads), -np.inf, dtype=dtype)
    walk = _Walk(dtype, scale, causal, window, g, block_rows, block_k)
    items = []
    for b in range(len(cq) - 1):
        L, S = int(cq[b + 1] - cq[b]), int(ck[b + 1] - ck[b])
        if L and S:
            for h in range(hkv):
                for r0 in range(0, L, walk.rows):
                    items.append((b, h, r0, min(r0 + walk.rows, L), L, S))

    def one(item: tuple[int, int, int, int, int, int]) -> None:
        b, h, r0, r1, L, S = item
        lo, hi = walk.rows_of(L, S, r0, r1)
        q0, k0 = int(cq[b]), int(ck[b])
        heads = slice(h * g, (h + 1) * g)
        o, s = walk.run(q[q0 + r0 : q0 + r1, heads], k[k0 : k0 + S, h], v[k0 : k0 + S, h], lo, hi)
        out[q0 + r0 : q0 + r1, heads] = o
        lse[q0 + r0 : q0 + r1, heads] = s

    parallel_map(one, _costliest_first(items, lambda it: (it[3] - it[2]) * it[5]), threads)
    return out, lse
