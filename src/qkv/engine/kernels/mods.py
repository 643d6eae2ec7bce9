"""Attention variants inside the kernels: one hook per score tile, and sinks at the very end.

Every kernel computes scaled scores ``s = q·k · scale`` for some tile and then calls
:func:`apply` once, before it adds the float mask and applies causal, window and the boolean
mask. :func:`apply` does, in this order (the definition is :mod:`qkv.reference`'s):

1. ``softcap``: ``s = c · tanh(s / c)``;
2. ALiBi: ``s -= slope · (q_idx - kv_idx)`` for keys at or before the query (0 after it);
3. ``score_mod(s, batch, head, q_idx, kv_idx)``;
4. ``mask_mod(batch, head, q_idx, kv_idx)``: ``-inf`` where it is False — skipped for tiles the
   block mask (:func:`block_mask`, computed once per call) shows to be entirely allowed.

The tile's position is given as ``sel``, an index into the plan's batch dimensions (``...``
for all of them, a tuple of ints for one head, a tuple ending in a slice for a run of heads),
and the query and key positions as index arrays that broadcast against the tile. The plan's
``offsets`` (``(0, 0)`` but for a block of a longer sequence, such as a ring step) are added to
them here, so variants always see the sequence's own positions.

Sinks add ``exp(sink)`` to every row's denominator and no value. Kernels and partial results
never see them: :func:`with_sinks` adds the sink once to a finished ``(out, lse)`` over all the
keys, ``lse' = log(exp(lse) + exp(sink))`` and ``out' = out · exp(lse - lse')``. So parts over
disjoint key sets merge exactly as without sinks, and the sink is applied after the merge.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ...errors import InputError
from ...validate import Plan

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "add_sink",
    "apply",
    "block_mask",
    "cap",
    "cap_slope",
    "sink_factor",
    "with_sinks",
]

EMPTY, PARTIAL, FULL = 0, 1, 2


def _batch_head(plan: Plan, sel: Any) -> tuple[Any, Any]:
    """``(batch, head)`` index arrays of the tile at ``sel``, shaped ``[..., 1, 1]``."""
    shape = plan.batch
    if not shape:
        return np.int64(0), np.int64(0)
    h = np.broadcast_to(np.arange(shape[-1], dtype=np.int64), shape)
    b = np.broadcast_to(
        np.arange(math.prod(shape[:-1]), dtype=np.int64).reshape(shape[:-1] + (1,)), shape
    )
    return b[sel][..., None, None], h[sel][..., None, None]


def _per_head(x: np.ndarray, sel: Any) -> Any:
    return x[sel][..., None, None]


def _checked(r: Any, shape: tuple[int, ...], name: str, want: str) -> np.ndarray:
    r = np.asarray(r)
    ok = (r.dtype == bool) if want == "bool" else np.issubdtype(r.dtype, np.floating)
    if not ok:
        raise InputError(f"{name}: must return {want} values, got dtype {r.dtype}")
    try:
        fits = np.broadcast_shapes(r.shape, shape) == shape
    except ValueError:
        fits = False
    if not fits:
        raise InputError(f"{name}: returned shape {r.shape} for a tile of shape {shape}")
    return r


def apply(
    plan: Plan, s: np.ndarray, sel: Any, q_idx: Any, kv_idx: Any, *, full: bool = False
) -> np.ndarray:
    """Soft-cap, ALiBi, ``score_mod`` and ``mask_mod`` on one tile of scaled scores ``s``.

    ``s`` is modified in place where possible and returned. ``full=True`` says the block mask
    already showed ``mask_mod`` allows every key of the tile.
    """
    if s.size == 0:  # no queries or no keys: nothing to modify (ALiBi's max would fail)
        return s
    if plan.offsets != (0, 0):
        q_idx, kv_idx = q_idx + plan.offsets[0], kv_idx + plan.offsets[1]
    if plan.softcap is not None:
        cap(s, plan.softcap)
    b = h = None
    if plan.alibi is not None:
        dist = np.subtract(q_idx, kv_idx, dtype=s.dtype)  # exact: positions < 2**24
        if np.max(kv_idx) > np.min(q_idx):  # some key after its query: no bias there
            np.maximum(dist, 0, out=dist)
        slope = _per_head(plan.alibi, sel)
        if np.ndim(slope) == 2:  # one slope for the whole tile: scale in place
            dist *= slope.item()
            s -= dist
        else:
            s -= slope * dist
    if plan.score_mod is not None:
        b, h = _batch_head(plan, sel)
        r = _checked(plan.score_mod(s, b, h, q_idx, kv_idx), s.shape, "score_mod", "float")
        if r is not s:
            s[...] = r
    if plan.mask_mod is not None and not full:
        if b is None:
            b, h = _batch_head(plan, sel)
        ok = _checked(plan.mask_mod(b, h, q_idx, kv_idx), s.shape, "mask_mod", "bool")
        s[~np.broadcast_to(ok, s.shape)] = -np.inf
    return s


def _cap_dtype(s: np.ndarray, c: float) -> np.dtype:
    """The dtype to soft-cap ``s`` in: its own, or float64 when ``c`` is not a normal number of
    it (``1e39`` is ``inf`` in float32, and ``inf · tanh(0)`` would be NaN)."""
    info = np.finfo(s.dtype)
    return s.dtype if float(info.tiny) <= c <= float(info.max) else np.dtype(np.float64)


def cap(s: np.ndarray, c: float) -> np.ndarray:
    """``s = c · tanh(s / c)`` in place. A cap beyond ``s``'s dtype is applied in float64, so a
    cap larger than any score is (to rounding) the identity, as in :mod:`qkv.reference`."""
    dt = _cap_dtype(s, c)
    if dt == s.dtype:
        cs = dt.type(c)
        s /= cs
        np.tanh(s, out=s)
        s *= cs
    else:
        s[...] = c * np.tanh(s.astype(dt) / c)
    return s


def cap_slope(s: np.ndarray, c: float) -> np.ndarray:
    """``d/ds [c · tanh(s / c)] = 1 − tanh²(s / c)`` of scaled scores ``s``, in ``s``'s dtype
    (computed in float64 when ``c`` is beyond that dtype, as in :func:`cap`)."""
    t = np.tanh(s.astype(_cap_dtype(s, c), copy=False) / c)
    return (1 - t * t).astype(s.dtype, copy=False)


def block_mask(plan: Plan, block_q: int, block_k: int) -> np.ndarray | None:
    """Status of every ``block_q × block_k`` tile under ``mask_mod``: EMPTY, PARTIAL or FULL.

    Shape ``(*batch, ceil(L / block_q), ceil(S / block_k))`` (int8); ``None`` without a
    ``mask_mod``. ``mask_mod`` is evaluated once per tile on its index arrays (memory O(tile)).
    """
    if plan.mask_mod is None:
        return None
    L, S = plan.L, plan.S
    nq, nk = -(-L // block_q), -(-S // block_k)
    out = np.zeros(plan.batch + (nq, nk), dtype=np.int8)
    b, h = _batch_head(plan, ...)
    for i in range(nq):
        r0, r1 = i * block_q, min((i + 1) * block_q, L)
        qi = np.arange(r0, r1, dtype=np.int64)[:, None] + (S - L + plan.offsets[0])
        for j in range(nk):
            c0, c1 = j * block_k, min((j + 1) * block_k, S)
            kj = np.arange(c0, c1, dtype=np.int64)[None, :] + plan.offsets[1]
            shape = plan.batch + (r1 - r0, c1 - c0)
            ok = _checked(plan.mask_mod(b, h, qi, kj), shape, "mask_mod", "bool")
            ok = ok.reshape((1,) * (len(shape) - ok.ndim) + ok.shape)
            anyv, allv = ok.any(axis=(-2, -1)), ok.all(axis=(-2, -1))
            out[..., i, j] = np.where(allv, FULL, np.where(anyv, PARTIAL, EMPTY))
    return out


def sink_factor(plan: Plan, lse: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(exp(lse - lse'), lse')`` with ``lse' = log(exp(lse) + exp(sink))``, per row.

    ``lse`` is ``(*batch, L)``. The factor rescales outputs and weights computed without the
    sink; a row with no key (``lse = -inf``) gets factor 0 and ``lse' = sink``.
    """
    assert plan.sinks is not None  # called only for a plan with sinks
    return _factor(lse, plan.sinks[..., None].astype(lse.dtype, copy=False))


def _factor(lse: np.ndarray, sink: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    new = np.logaddexp(lse, sink)
    return np.exp(lse - new), new


def add_sink(out: np.ndarray, lse: np.ndarray, sink: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(out · exp(lse − lse'), lse')`` with ``lse' = log(exp(lse) + exp(sink))`` (``sink``
    broadcast to ``lse``): a finished result over all the keys, with the sink counted once."""
    f, new = _factor(lse, sink)
    return out * f[..., None].astype(out.dtype, copy=False), new.astype(lse.dtype, copy=False)


def with_sinks(plan: Plan, out: np.ndarray, lse: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Add the plan's sinks (if any) to a finished ``(out, lse)`` over all the keys."""
    if plan.sinks is None:
        return out, lse
    return add_sink(out, lse, plan.sinks[..., None].astype(lse.dtype, copy=False))
