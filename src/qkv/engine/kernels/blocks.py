"""Building blocks every kernel shares: grouped-head products, finishing rows, merging parts.

Grouped-query attention: query head ``h`` reads kv head ``h // group``. An array with query
heads on axis ``-3`` is viewed as ``(..., Hkv, group · rows, n)`` (:func:`heads_by_kv`), so one
product with a kv head's K or V serves its whole group and K/V are never repeated in memory.

Finishing a row: a kernel accumulates ``acc = Σ_j exp(s_j − m) v_j`` and ``denom = Σ_j exp(s_j −
m)`` for some offset ``m``; then ``out = acc / denom`` and ``lse = m + log(denom)``. A row that
may attend no key has ``denom = 0`` and gives output ``0`` and lse ``−inf`` (never NaN); a NaN
row stays NaN. :func:`finish` is that rule, written once.

Merging: attention over disjoint key sets combines by the parts' shares of the softmax
denominator, ``exp(lse_i − lse)`` (:func:`merge_arrays`); split-K decoding, chunked prefill and
ring attention across processes all end with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = [
    "EDGE_SPLIT",
    "finish",
    "grouped_matmul",
    "grouped_matmul_t",
    "heads_by_kv",
    "key_pieces",
    "log_sum",
    "merge_arrays",
    "merge_pair_into",
    "split_range",
]


def heads_by_kv(x: np.ndarray, group: int) -> np.ndarray:
    """``(..., Hq, m, n)`` → ``(..., Hq // group, group · m, n)``: heads beside their kv head.

    Examples
    --------
    >>> heads_by_kv(np.zeros((2, 8, 3, 5)), 4).shape
    (2, 2, 12, 5)
    """
    if group == 1:
        return x
    *rest, hq, m, n = x.shape
    return x.reshape(*rest, hq // group, group * m, n)


def grouped_matmul(a: np.ndarray, b: np.ndarray, group: int) -> np.ndarray:
    """``a @ b`` where ``a`` has ``group`` query heads (axis -3) for each kv head of ``b``.

    Examples
    --------
    >>> a, b = np.ones((4, 2, 3)), np.arange(6.0).reshape(2, 3, 1)
    >>> grouped_matmul(a, b, 2)[:, 0, 0].tolist()   # heads 0, 1 read kv head 0; 2, 3 read 1
    [3.0, 3.0, 12.0, 12.0]
    """
    if group == 1:
        return a @ b
    *rest, hq, m, _ = a.shape
    return (heads_by_kv(a, group) @ b).reshape(*rest, hq, m, b.shape[-1])


def grouped_matmul_t(a: np.ndarray, c: np.ndarray, group: int) -> np.ndarray:
    """``aᵀ @ c`` summed over the query heads that share a kv head (gradients of K and V)."""
    return np.swapaxes(heads_by_kv(a, group), -1, -2) @ heads_by_kv(c, group)


#: Key pieces across a mask's edge are ``block rows / EDGE_SPLIT`` wide (see :func:`key_pieces`).
EDGE_SPLIT = 2


def split_range(lo: int, hi: int, width: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` in the fewest pieces at most ``width`` wide, of nearly equal widths.

    Examples
    --------
    >>> split_range(0, 10, 4)
    [(0, 4), (4, 8), (8, 10)]
    """
    if hi <= lo:
        return []
    n = -(-(hi - lo) // width)
    step = -(-(hi - lo) // n)
    return [(c, min(c + step, hi)) for c in range(lo, hi, step)]


def key_pieces(lo: np.ndarray, hi: np.ndarray, block_k: int, rows: int) -> list[tuple[int, int]]:
    """The key ranges a block of ``rows`` query rows visits, from each row's bounds
    ``[lo_i, hi_i)`` (both nondecreasing, as :func:`qkv.masks.key_bounds` gives them).

    ``block_k`` wide where every row sees every key; narrower (``rows / EDGE_SPLIT``) across
    the rows' bounds, so each piece can skip the rows that see none of it and causal wastes
    little beyond the diagonal.

    Examples
    --------
    Two causal rows that both see keys 0..19 and one of which sees up to 59:

    >>> key_pieces(np.array([0, 0]), np.array([20, 60]), block_k=32, rows=32)
    [(0, 20), (20, 34), (34, 48), (48, 60)]
    """
    first, last = int(lo[0]), int(hi[-1])
    a, b = int(lo[-1]), int(hi[0])  # keys [a, b) are seen by every row
    edge = min(block_k, max(16, rows // EDGE_SPLIT))
    if b - a < edge:  # too few for a piece of their own: let the edge pieces take them
        a = b = min(max(a, first), last)
    return split_range(first, a, edge) + split_range(a, b, block_k) + split_range(b, last, edge)


def log_sum(offset: np.ndarray, denom: np.ndarray) -> np.ndarray:
    """``offset + log(denom)``: the log-sum-exp of a row; ``-inf`` where ``denom`` is 0."""
    with np.errstate(divide="ignore"):
        lse = offset + np.log(denom)
    return np.where(denom == 0, lse.dtype.type(-np.inf), lse)


def finish(acc: np.ndarray, denom: np.ndarray, offset: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows' output ``acc / denom`` (in place, in ``acc``) and lse ``offset + log(denom)``.

    ``acc`` is ``(..., n)``, ``denom`` and ``offset`` are ``(...)``. A row with ``denom == 0``
    (no key allowed) gives output 0 and lse ``-inf``; NaN stays NaN.

    Examples
    --------
    >>> out, lse = finish(np.array([[2.0, 4.0], [0.0, 0.0]]), np.array([2.0, 0.0]), np.zeros(2))
    >>> out.tolist(), lse.round(4).tolist()
    ([[1.0, 2.0], [0.0, 0.0]], [0.6931, -inf])
    """
    empty = denom == 0
    acc /= np.where(empty, denom.dtype.type(1), denom)[..., None]
    acc[empty] = 0
    return acc, log_sum(offset, denom)


def _shares(
    lses: Sequence[np.ndarray], dt: np.dtype
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Each part's share of the merged rows ``(..., 1)``, the rows' offset and their summed
    weights (from which :func:`log_sum` gives the merged lse), in ``dt``."""
    lses = [np.asarray(lse, dtype=dt) for lse in lses]
    top = lses[0]
    for lse in lses[1:]:
        top = np.maximum(top, lse)  # NaN propagates
    shift = np.where(np.isneginf(top), dt.type(0), top)
    weights = [np.exp(lse - shift) for lse in lses]
    total = np.zeros(top.shape, dtype=dt)
    for w in weights:
        total += w
    safe_total = np.where(total == 0, dt.type(1), total)
    return [(w / safe_total)[..., None] for w in weights], shift, total


def _scaled(share: np.ndarray, o: np.ndarray, term: np.ndarray) -> np.ndarray:
    """``share · o`` into ``term`` (which may be ``o``), 0 where the share is 0."""
    # Shares that sum to 1: a convex combination cannot overflow where the parts did not.
    # Where the share is 0 the part contributes nothing (also not a NaN from 0 · inf), so a
    # row that no part saw stays 0.
    with np.errstate(invalid="ignore"):
        np.multiply(share, o, out=term)
    if not share.all():
        np.copyto(term, term.dtype.type(0), where=share == 0)
    return term


def merge_arrays(parts: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Attention over the union of disjoint key sets from each set's ``(out, lse)``.

    No argument checks (:func:`qkv.merge` is the checked, public form): floating arrays of
    matching shapes. Computed in at least float32; returned in the outputs' and the lse's own
    common dtypes. A part whose lse is ``-inf`` has weight 0 and adds nothing, even if its
    output holds garbage.
    """
    out_dt = np.result_type(*(o for o, _ in parts))
    lse_dt = np.result_type(*(lse for _, lse in parts))
    dt = np.result_type(np.float32, out_dt, lse_dt)
    shares, shift, total = _shares([lse for _, lse in parts], dt)
    out = np.zeros(np.shape(parts[0][0]), dtype=dt)
    term = np.empty_like(out)  # (one product at a time: no temporaries the size of out)
    for (o, _), share in zip(parts, shares, strict=True):
        out += _scaled(share, o, term)
    lse = log_sum(shift, total)
    return out.astype(out_dt, copy=False), lse.astype(lse_dt, copy=False)


def merge_pair_into(
    first: tuple[np.ndarray, np.ndarray], second: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`merge_arrays` of two parts whose outputs the caller gives up: the same bits,
    computed in their memory, the merged output in ``second``'s.

    Both outputs must be writable arrays of the compute dtype (``float32`` or ``float64``),
    the lse too, and of one shape (``first``'s may be a strided view); both are overwritten.
    No array the size of the output is allocated: fresh memory is a page fault per 4 KiB at
    first touch, which cost a shared prefix's merge (32 requests, 32 heads of 128) more than
    its arithmetic.
    """
    (a, lse_a), (b, lse_b) = first, second
    dt = b.dtype
    shares, shift, total = _shares([lse_a, lse_b], dt)
    _scaled(shares[0], a, a)
    _scaled(shares[1], b, b)
    # merge_arrays sums (0 + a) + b. That equals b + a, except where both are -0: it is +0
    # there (0 + a is never -0, and so is no sum with it in round-to-nearest), which adding +0
    # once more gives without changing any other value.
    b += a
    b += dt.type(0)
    return b, log_sum(shift, total)
