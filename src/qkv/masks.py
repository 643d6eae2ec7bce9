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

__all__ = [
    "Window",
    "allowed",
    "exclusion_reasons",
    "key_bounds",
    "key_range",
    "query_positions",
    "tail_counts",
]

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


def key_bounds(
    positions: np.ndarray, S: int, causal: bool, window: Window | None
) -> tuple[np.ndarray, np.ndarray]:
    """Half-open key ranges ``[lo, hi)`` that queries at ``positions`` may attend.

    This is the one statement of the rule: causal allows ``j <= p``; a window ``(left, right)``
    allows ``p - left <= j <= p + right``; both are clipped to the ``S`` keys. For positions in
    increasing order, ``lo`` and ``hi`` are nondecreasing.

    Examples
    --------
    >>> lo, hi = key_bounds(np.array([0, 3]), 5, causal=True, window=(1, None))
    >>> lo.tolist(), hi.tolist()
    ([0, 2], [1, 4])
    """
    p = np.asarray(positions, dtype=np.int64)
    lo = np.zeros_like(p)
    hi = np.full_like(p, S)
    if causal:
        hi = np.minimum(hi, p + 1)
    if window is not None:
        left, right = window
        if left is not None:
            lo = np.maximum(lo, p - left)
        if right is not None:
            hi = np.minimum(hi, p + right + 1)
    lo = np.clip(lo, 0, S)
    return lo, np.maximum(lo, np.minimum(hi, S))


def key_range(p: int, S: int, causal: bool, window: Window | None) -> tuple[int, int]:
    """Half-open range ``[lo, hi)`` of keys that the query at position ``p`` may attend.

    Examples
    --------
    >>> key_range(3, 10, causal=True, window=None)
    (0, 4)
    >>> key_range(3, 10, causal=False, window=(1, 2))
    (2, 6)
    """
    lo, hi = key_bounds(np.array([p]), S, causal, window)
    return int(lo[0]), int(hi[0])


def exclusion_reasons(p: int, j: int, causal: bool, window: Window | None) -> list[str]:
    """Why causal or the window hide key ``j`` from the query at position ``p``, in words.

    Examples
    --------
    >>> exclusion_reasons(0, 1, causal=True, window=None)
    ['causal: key 1 is after position 0']
    >>> exclusion_reasons(5, 1, causal=False, window=(2, 0))
    ['window: key 1 < 5 - 2']
    """
    out = []
    if causal and j > p:
        out.append(f"causal: key {j} is after position {p}")
    if window is not None:
        left, right = window
        if left is not None and j < p - left:
            out.append(f"window: key {j} < {p} - {left}")
        if right is not None and j > p + right:
            out.append(f"window: key {j} > {p} + {right}")
    return out


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
    lo, hi = key_bounds(query_positions(L, S, rows), S, causal, window)
    j = np.arange(cols.start, cols.stop, dtype=np.int64)[None, :]
    return (j >= lo[:, None]) & (j < hi[:, None])


# Up to this many batch rows, tail_counts reads a mask's bytes one row at a time in Python
# (about 0.3 µs a row) instead of its vectorized passes (about 4 µs whatever the rows).
_FEW_ROWS = 8


def _few_tail_counts(raw: bytes, L: int, S: int) -> np.ndarray | None:
    """:func:`tail_counts` of a mask's bytes ``raw`` (C order, 0 or 1 each) in batch rows of
    ``L`` query rows of ``S`` keys: each batch row's count of ones, where its query rows are
    one and the same and their ones lead (the first zero right after them); else None."""
    counts = []
    block = L * S
    for at in range(0, len(raw), block):
        row = raw[at : at + S]
        if L > 1 and raw[at : at + block] != row * L:
            return None  # query rows that differ: causal-looking, or another structure
        n = row.count(1)
        if n < S and row.find(0) != n:
            return None  # a key visible after a hidden one: not a tail hidden
        counts.append(n)
    return np.array(counts, dtype=np.int64)


def tail_counts(keep: np.ndarray, nbatch: int) -> np.ndarray | None:
    """Key counts per batch row when a boolean mask only hides a tail of keys: what a
    tokenizer's padding mask does.

    ``keep`` has ``nbatch + 2`` dimensions (``True`` = may attend), broadcastable to the scores
    ``(*batch, L, S)``. It is a padding mask when it varies along the first batch axis at most
    (not along the heads or any other axis; with one batch axis, the heads, not at all), every
    query row of a batch row hides the same keys, and those are a tail: row ``b`` may attend
    keys ``[0, count[b])`` and no other. Then the counts, ``int64`` of shape ``(n,)`` with
    ``n`` the mask's length on the first batch axis (1 with no batch axis); None for any other
    mask (a middle run hidden, a head-dependent or causal-looking mask), which is then applied
    as it is. Reads the mask once or twice and builds nothing of the scores' size.

    Examples
    --------
    >>> keep = np.arange(5)[None, None, None, :] < np.array([5, 3, 0])[:, None, None, None]
    >>> tail_counts(keep, 2).tolist()
    [5, 3, 0]
    >>> tail_counts(~keep, 2) is None  # a head of keys hidden: not a padding mask
    True
    """
    if keep.ndim != nbatch + 2 or keep.dtype != bool or keep.size == 0:
        return None  # (an empty mask hides nothing there is to read)
    shape = keep.shape
    if any(n != 1 for n in shape[1 if nbatch >= 2 else 0 : nbatch]):
        return None  # varies along the heads (or another axis than the first)
    S = shape[-1]
    if keep.size <= _FEW_ROWS * shape[-2] * S:
        raw = keep.tobytes()
        if not raw.translate(None, b"\x00\x01"):  # (a bool view of other bytes: below)
            return _few_tail_counts(raw, shape[-2], S)
    rows = keep[..., 0, :]
    if shape[-2] > 1:
        last = keep[..., -1, :]
        if not np.array_equal(last, rows) or not (keep == rows[..., None, :]).all():
            return None  # query rows that differ: causal-looking, or another structure
    rows = rows.reshape(-1, S)
    if (rows[:, 1:] > rows[:, :-1]).any():
        return None  # a key visible after a hidden one: not a tail hidden
    return np.add.reduce(rows, axis=-1, dtype=np.int64)  # (a small call's: one pass, 1 µs)
