"""Attention variants: ready-made ``mask_mod`` functions and ways to combine them.

A ``mask_mod(batch, head, q_idx, kv_idx)`` says which keys a query may attend, written with
NumPy operations on broadcastable integer index arrays (the NumPy counterpart of PyTorch's
FlexAttention). Positions are absolute and bottom-right aligned, like ``causal``: with ``L``
queries and ``S`` keys, query row ``i`` is at ``q_idx = S - L + i``. A ``score_mod(score,
batch, head, q_idx, kv_idx)`` returns a new score of the same shape. Both are evaluated one
tile at a time by every kernel, so memory stays O(tile); see :func:`qkv.attention`.

``batch`` is the index over the leading dimensions before the heads axis (flattened; 0 when
there are none) and ``head`` the query head (axis ``-3``; 0 when there is none).

Write them elementwise: the tile's layout is the kernel's (the tiled kernel holds keys on the
first axis and queries on the second), and the index arrays are shaped to broadcast against it.

Examples
--------
>>> import numpy as np
>>> import qkv
>>> from qkv.variants import and_masks, causal, document
>>> ids = [0, 0, 1, 1]                        # two documents of two tokens each
>>> keep = and_masks(causal, document(ids))
>>> keep(0, 0, np.arange(4)[:, None], np.arange(4)[None, :]).astype(int).tolist()
[[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
>>> q = k = v = np.eye(4)
>>> bool(np.allclose(qkv.attention(q, k, v, mask_mod=keep),
...                  qkv.attention(q, k, v, mask=keep(0, 0, *np.ix_(range(4), range(4))))))
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .checks import check_int
from .errors import InputError
from .keywords import near_keywords

__all__ = [
    "MaskMod",
    "ScoreMod",
    "and_masks",
    "causal",
    "document",
    "or_masks",
    "prefix_lm",
    "sliding_window",
]

MaskMod = Callable[[Any, Any, Any, Any], Any]
ScoreMod = Callable[[Any, Any, Any, Any, Any], Any]


def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """Keys at or before the query: ``kv_idx <= q_idx`` (the same rule as ``causal=True``)."""
    return kv_idx <= q_idx


@near_keywords()
def sliding_window(left: int | None, right: int | None = 0) -> MaskMod:
    """Keys ``q_idx - left <= kv_idx <= q_idx + right`` (``None``: unbounded on that side).

    Examples
    --------
    >>> sliding_window(1, 0)(0, 0, 5, np.arange(7)).astype(int).tolist()
    [0, 0, 0, 0, 1, 1, 0]
    """
    for name, w in (("left", left), ("right", right)):
        if w is not None:
            check_int(w, f"sliding_window: {name}", minimum=0)

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        ok = np.ones(np.broadcast_shapes(np.shape(q_idx), np.shape(kv_idx)), dtype=bool)
        if left is not None:
            ok &= kv_idx >= q_idx - left
        if right is not None:
            ok &= kv_idx <= q_idx + right
        return ok

    return mask_mod


@near_keywords()
def document(ids: Any) -> MaskMod:
    """Queries and keys in the same document: ``ids[q_idx] == ids[kv_idx]``.

    ``ids`` holds one document id per position, shape ``(S,)`` (shared by the batch) or
    ``(batch, S)``.

    Examples
    --------
    >>> document([0, 0, 1])(0, 0, 2, np.arange(3)).tolist()
    [False, False, True]
    """
    ids = np.asarray(ids)
    if ids.ndim not in (1, 2) or not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"document: ids must be integers of shape (S,) or (batch, S), got {ids}")

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        if ids.ndim == 1:
            return ids[q_idx] == ids[kv_idx]
        return ids[b, q_idx] == ids[b, kv_idx]

    return mask_mod


@near_keywords()
def prefix_lm(n: int) -> MaskMod:
    """Prefix-LM: every query sees the first ``n`` positions, and causal keys beyond them.

    Examples
    --------
    >>> prefix_lm(2)(0, 0, 0, np.arange(4)).astype(int).tolist()
    [1, 1, 0, 0]
    """
    check_int(n, "prefix_lm: n", minimum=0)

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx < n) | (kv_idx <= q_idx)

    return mask_mod


def and_masks(*mods: MaskMod) -> MaskMod:
    """A key is allowed where every ``mask_mod`` allows it (no mods: everything)."""
    return _combined(mods, np.logical_and, True)


def or_masks(*mods: MaskMod) -> MaskMod:
    """A key is allowed where any ``mask_mod`` allows it (no mods: nothing)."""
    return _combined(mods, np.logical_or, False)


def _combined(mods: tuple[MaskMod, ...], op: Any, start: bool) -> MaskMod:
    """One ``mask_mod``: ``op`` folded over ``mods``' answers, from ``start``."""

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        ok: Any = start
        for m in mods:
            ok = op(ok, m(b, h, q_idx, kv_idx))
        return ok

    return mask_mod
