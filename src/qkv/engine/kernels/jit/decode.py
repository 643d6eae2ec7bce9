"""Compiled decode kernel: one pass over a kv head's keys and values for all its query rows.

The NumPy decode kernel makes one skinny GEMM per kv head for a grouped head's ``g · L`` query
rows, and BLAS runs such products far below the memory's read rate. Here the keys and values
are read once, in blocks of :data:`BLOCK` keys that stay in the first-level cache, and every
row of the group is served from each block: its scores, a running max and sum (online
softmax), and the weighted values. Accumulation is in the arrays' dtype (float32 for float32
and float16 plans, float64 for float64).

Only ``fastmath={"reassoc", "contract"}``: the dot products may be summed in any order (which
lets LLVM vectorise them), but infinities and NaN keep their meaning, so ``-inf`` masks, empty
rows and NaN propagation behave exactly as in the NumPy kernel.

Compiled with ``nogil=True`` and no Numba thread pool: qkv's own worker threads run one call
per kv head and key range (:func:`qkv.engine.kernels.decode.attend`). First call: about 2 s of
compiling per dtype, well under a second once Numba's disk cache holds it.

Measured on the 2-core development machine (``bench/decode.py --grid``): the products run near
the peak of the 256-bit vectors LLVM picks on this CPU, and with eight query rows per kv head
the work per byte makes the kernel compute-bound; the cores do not overlap it with waiting on
memory. Software prefetching (whole blocks ahead into L2, or a few rows ahead into L1) was tried
and made every case slower, so it is not here.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import types
from numba.extending import overload

__all__ = ["BLOCK", "head"]

BLOCK = 64  # keys per block: 64 · (d + dv) numbers of K and V stay in L1/L2 while reused

_FAST = {"reassoc", "contract"}


def _exp_nonpositive(x):  # pragma: no cover - the compiled versions below replace it
    """``exp(x)`` for ``x <= 0``, ``-inf`` or NaN (a softmax weight), vectorisable."""
    return math.exp(x)


def _exp_kernel(dtype: type, degree: int, lowest: int):
    """``exp`` as ``2**-n · exp(y)`` with ``|y| <= ln 2 / 2`` (Taylor to ``degree``).

    LLVM calls libm's scalar ``exp`` once per weight (it has no vector math library here),
    which cost about a third of the kernel's time for eight query rows; this form is plain
    arithmetic that LLVM vectorises with the rest of the loop. ``2**-n`` is built from the bits
    of ``n`` (no bit casts needed). Weights below ``2**-lowest`` (relative to the row's
    largest, 1) are 0: far below the dtype's precision of the sum, which is at least 1.
    NaN stays NaN and ``-inf`` gives 0.
    """
    inv_ln2 = dtype(1.4426950408889634)
    ln2 = dtype(0.6931471805599453)
    floor = dtype(-lowest)
    coef = tuple(dtype(1 / math.factorial(i)) for i in range(degree + 1))
    halves = tuple(dtype(2.0 ** -(1 << b)) for b in range(lowest.bit_length()))
    one, zero, half = dtype(1), dtype(0), dtype(0.5)

    def exp(x):
        t = x * inv_ln2
        t = floor if t < floor else t  # NaN stays NaN; -inf becomes the floor
        u = -t
        u = u if u < -floor else -floor  # NaN: any index, its result is NaN anyway
        n = int(u + half)
        y = (t + dtype(n)) * ln2
        p = coef[degree]
        for i in range(degree - 1, -1, -1):  # unrolled: degree is a constant
            p = p * y + coef[i]
        scale = one
        for b in range(len(halves)):
            scale = scale * (halves[b] if (n >> b) & 1 else one)
        return zero if t <= floor else p * scale

    return exp


_EXP32 = _exp_kernel(np.float32, 7, 126)
_EXP64 = _exp_kernel(np.float64, 13, 1022)


@overload(_exp_nonpositive, jit_options={"fastmath": _FAST})
def _exp_nonpositive_compiled(x):  # pragma: no cover - compiled
    if isinstance(x, types.Float):
        return _EXP32 if x.bitwidth == 32 else _EXP64
    return None


@numba.njit(nogil=True, cache=True, fastmath=_FAST)
def _scores(q, k, j0, nb, s):  # pragma: no cover - compiled
    """``s[r, jj] = q[r] · k[j0 + jj]`` for ``jj < nb``: four rows by two keys share loads."""
    R, d = q.shape
    z = q.dtype.type(0)
    r = 0
    while r + 4 <= R:
        jj = 0
        while jj + 2 <= nb:
            j = j0 + jj
            a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = z
            for t in range(d):
                k0 = k[j, t]
                k1 = k[j + 1, t]
                q0 = q[r, t]
                q1 = q[r + 1, t]
                q2 = q[r + 2, t]
                q3 = q[r + 3, t]
                a0 += q0 * k0
                a1 += q1 * k0
                a2 += q2 * k0
                a3 += q3 * k0
                b0 += q0 * k1
                b1 += q1 * k1
                b2 += q2 * k1
                b3 += q3 * k1
            s[r, jj] = a0
            s[r + 1, jj] = a1
            s[r + 2, jj] = a2
            s[r + 3, jj] = a3
            s[r, jj + 1] = b0
            s[r + 1, jj + 1] = b1
            s[r + 2, jj + 1] = b2
            s[r + 3, jj + 1] = b3
            jj += 2
        while jj < nb:
            j = j0 + jj
            a0 = a1 = a2 = a3 = z
            for t in range(d):
                kt = k[j, t]
                a0 += q[r, t] * kt
                a1 += q[r + 1, t] * kt
                a2 += q[r + 2, t] * kt
                a3 += q[r + 3, t] * kt
            s[r, jj] = a0
            s[r + 1, jj] = a1
            s[r + 2, jj] = a2
            s[r + 3, jj] = a3
            jj += 1
        r += 4
    while r < R:
        jj = 0
        while jj + 4 <= nb:
            j = j0 + jj
            a0 = a1 = a2 = a3 = z
            for t in range(d):
                qt = q[r, t]
                a0 += qt * k[j, t]
                a1 += qt * k[j + 1, t]
                a2 += qt * k[j + 2, t]
                a3 += qt * k[j + 3, t]
            s[r, jj] = a0
            s[r, jj + 1] = a1
            s[r, jj + 2] = a2
            s[r, jj + 3] = a3
            jj += 4
        while jj < nb:
            j = j0 + jj
            a0 = z
            for t in range(d):
                a0 += q[r, t] * k[j, t]
            s[r, jj] = a0
            jj += 1
        r += 1


@numba.njit(nogil=True, cache=True, fastmath=_FAST)
def _weighted(s, v, j0, nb, acc):  # pragma: no cover - compiled
    """``acc[r] += Σ_jj s[r, jj] · v[j0 + jj]``: two rows by four keys per load of ``acc``."""
    R = s.shape[0]
    dv = v.shape[1]
    r = 0
    while r + 2 <= R:
        jj = 0
        while jj + 4 <= nb:
            j = j0 + jj
            p0, p1, p2, p3 = s[r, jj], s[r, jj + 1], s[r, jj + 2], s[r, jj + 3]
            u0, u1, u2, u3 = s[r + 1, jj], s[r + 1, jj + 1], s[r + 1, jj + 2], s[r + 1, jj + 3]
            for c in range(dv):
                v0 = v[j, c]
                v1 = v[j + 1, c]
                v2 = v[j + 2, c]
                v3 = v[j + 3, c]
                acc[r, c] += p0 * v0 + p1 * v1 + p2 * v2 + p3 * v3
                acc[r + 1, c] += u0 * v0 + u1 * v1 + u2 * v2 + u3 * v3
            jj += 4
        while jj < nb:
            p0 = s[r, jj]
            u0 = s[r + 1, jj]
            for c in range(dv):
                v0 = v[j0 + jj, c]
                acc[r, c] += p0 * v0
                acc[r + 1, c] += u0 * v0
            jj += 1
        r += 2
    while r < R:
        jj = 0
        while jj + 4 <= nb:
            j = j0 + jj
            p0, p1, p2, p3 = s[r, jj], s[r, jj + 1], s[r, jj + 2], s[r, jj + 3]
            for c in range(dv):
                acc[r, c] += p0 * v[j, c] + p1 * v[j + 1, c] + p2 * v[j + 2, c] + p3 * v[j + 3, c]
            jj += 4
        while jj < nb:
            p0 = s[r, jj]
            for c in range(dv):
                acc[r, c] += p0 * v[j0 + jj, c]
            jj += 1
        r += 1


@numba.njit(nogil=True, cache=True, fastmath=_FAST)
def head(q, k, v, lo, hi, L, out, lse):  # pragma: no cover - compiled
    """Attention of ``q`` (``R`` rows, row ``r`` is query ``r % L``) to keys ``k`` and values ``v``.

    Row ``r`` sees the keys ``[lo[r % L], hi[r % L])`` (indices into ``k``); the others count as
    ``-inf`` scores. Writes the normalised output ``out (R, dv)`` and ``lse (R,)``; a row that
    sees no key gets ``0`` and ``-inf``. ``q`` is already scaled.
    """
    R = q.shape[0]
    n = k.shape[0]
    dv = v.shape[1]
    dt = q.dtype.type
    ninf = dt(-np.inf)
    zero = dt(0)
    m = np.full(R, ninf, dtype=q.dtype)
    den = np.zeros(R, dtype=q.dtype)
    s = np.empty((R, BLOCK), dtype=q.dtype)
    out[:, :] = zero
    for j0 in range(0, n, BLOCK):
        nb = min(BLOCK, n - j0)
        _scores(q, k, j0, nb, s)
        for r in range(R):
            a = lo[r % L] - j0
            b = hi[r % L] - j0
            mr = m[r]
            if a <= 0 and b >= nb and mr != ninf:
                # Every key of the block visible to this row: unless one beats the running
                # max (rare once a few blocks are in), the weights need no rescaling. Counting
                # is a reduction LLVM vectorises; NaN never counts, and turns its weight NaN.
                above = 0
                for jj in range(nb):
                    above += s[r, jj] > mr
                if above == 0:
                    total = zero
                    for jj in range(nb):
                        p = _exp_nonpositive(s[r, jj] - mr)
                        s[r, jj] = p
                        total += p
                    den[r] += total
                    continue
            mb = mr
            for jj in range(nb):
                if jj < a or jj >= b:
                    s[r, jj] = ninf
                elif s[r, jj] > mb:
                    mb = s[r, jj]
            if mb == ninf:
                safe = zero  # nothing seen yet: every weight is exp(-inf) = 0
            else:
                safe = mb
                if mr != mb:
                    alpha = np.exp(mr - mb)
                    den[r] *= alpha
                    for c in range(dv):
                        out[r, c] *= alpha
                m[r] = mb
            total = zero
            for jj in range(nb):
                p = _exp_nonpositive(s[r, jj] - safe)
                s[r, jj] = p
                total += p
            den[r] += total
        _weighted(s, v, j0, nb, out)
    for r in range(R):
        if den[r] == zero:  # no key allowed: output 0, lse -inf
            out[r, :] = zero
            lse[r] = ninf
        else:
            for c in range(dv):
                out[r, c] /= den[r]
            lse[r] = (m[r] if m[r] != ninf else zero) + np.log(den[r])


@numba.njit(parallel=True, nogil=True, cache=True, fastmath=_FAST)
def heads(q, k, v, table, lo, hi, L, out, lse):  # pragma: no cover - compiled
    """:func:`head` for many (kv head, key range) entries at once, on Numba's thread team.

    ``q (rows, d)``, ``k (rows, d)``, ``v (rows, dv)`` are C-ordered row views; entry ``i`` of
    ``table`` is ``(q0, k0, v0, c0, c1)``: its ``R = out.shape[1]`` query rows start at row
    ``q0`` and it reads keys ``c0:c1`` of the head whose key ``0`` is row ``k0`` of ``k`` (value
    ``0``: row ``v0`` of ``v``). Query row ``r`` sees keys ``[lo[r % L], hi[r % L])`` of its
    head. Writes ``out[i] (R, dv)`` and ``lse[i] (R,)`` as :func:`head` does.
    """
    R = out.shape[1]
    for i in numba.prange(table.shape[0]):
        q0, k0, v0, c0, c1 = table[i, 0], table[i, 1], table[i, 2], table[i, 3], table[i, 4]
        n = c1 - c0
        a = np.empty_like(lo)
        b = np.empty_like(hi)
        for r in range(lo.shape[0]):
            a[r] = min(max(lo[r] - c0, 0), n)
            b[r] = min(max(hi[r] - c0, 0), n)
        head(q[q0 : q0 + R], k[k0 + c0 : k0 + c1], v[v0 + c0 : v0 + c1], a, b, L, out[i], lse[i])
