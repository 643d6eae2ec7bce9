"""Which keys each query may attend: causal (bottom-right aligned) and sliding windows.

Query row ``i`` of ``L`` queries against ``S`` keys sits at absolute position ``S - L + i``
(the alignment of FlashAttention and of decoding with a KV cache; PyTorch calls it
``causal_lower_right``). Causal attention lets it see key ``j`` iff ``j <= S - L + i``; a
window ``(left, right)`` lets it see ``p - left <= j <= p + right``.

These functions work on any rectangular tile of the ``L x S`` grid, so the tiled kernels ask
for the part they need and never build the full matrix.
"""

from __future__ import annotations

import numpy as np

__all__ = ["Window", "allowed", "key_range", "query_positions"]

Window = tuple[int | None, int | None]


def query_positions(L: int, S: int, rows: range | None = None) -> np.ndarray:
    """Absolute positions of query rows (bottom-right alignment).

    Examples
    --------
    >>> query_positions(2, 5).tolist()
    [3, 4]
    """
    rows = range(L) if rows is None else rows
    return np.arange(rows.start, rows.stop, dtype=np.int64) + (S - L)


def key_range(p: int, S: int, causal: bool, window: Window | None) -> tuple[int, int]:
    """Half-open range ``[lo, hi)`` of keys that the query at position ``p`` may attend.

    Examples
    --------
    >>> key_range(3, 10, causal=True, window=None)
    (0, 4)
    >>> key_range(3, 10, causal=False, window=(1, 2))
    (2, 6)
    """
    lo, hi = 0, S
    if causal:
        hi = min(hi, p + 1)
    if window is not None:
        left, right = window
        if left is not None:
            lo = max(lo, p - left)
        if right is not None:
            hi = min(hi, p + right + 1)
    lo = min(max(lo, 0), S)
    return lo, max(lo, min(hi, S))


def allowed(
    L: int,
    S: int,
    *,
    causal: bool = False,
    window: Window | None = None,
    rows: range | None = None,
    cols: range | None = None,
) -> np.ndarray | None:
    """Boolean tile ``(len(rows), len(cols))``: ``True`` where the query may attend the key.

    Returns ``None`` when there is no structural restriction (not causal, no window), so
    callers can skip masking entirely.

    Examples
    --------
    >>> allowed(3, 3, causal=True).astype(int).tolist()
    [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    >>> allowed(1, 3, causal=True).astype(int).tolist()
    [[1, 1, 1]]
    """
    if not causal and (window is None or window == (None, None)):
        return None
    rows = range(L) if rows is None else rows
    cols = range(S) if cols is None else cols
    p = query_positions(L, S, rows)[:, None]
    j = np.arange(cols.start, cols.stop, dtype=np.int64)[None, :]
    ok = np.ones((len(rows), len(cols)), dtype=bool)
    if causal:
        ok &= j <= p
    if window is not None:
        left, right = window
        if left is not None:
            ok &= j >= p - left
        if right is not None:
            ok &= j <= p + right
    return ok
