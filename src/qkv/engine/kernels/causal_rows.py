"""Several causal query rows on the decode step.

A decoding step that checks several tokens at once (speculative decoding's draft tokens, a
short chunk of a prompt against its cache) has ``L`` query rows under bottom-right causal
alignment: row ``i`` of a sequence of ``n`` keys sits at position ``n − L + i`` and sees its
first ``n − L + i + 1`` keys. The native decode step takes such rows as they are (its
``causal`` argument: each row's weights stop at its own last key), reading each kv head's
keys once for all its ``group · L`` rows. :func:`attend` and :func:`attend_stored` run a
checked plan that way (the router's "native decode, causal rows"); the cache's, the paged
and the packed steps ask the native step for it themselves.

The NumPy emulation of the step's fast road has no causal rows. There the step splits at the
last ``L − 1`` keys (as :func:`qkv.merge` splits any key set): the first ``n − L + 1`` keys,
which every row sees, on the unmasked step, and the last ones against the rows, a triangle
of at most ``L (L − 1) / 2`` scores a head (:func:`tail`, :func:`last_keys`), merged by
their log-sum-exp (:func:`with_tail`). Both parts are exact attention over their keys, so
the result equals the reference within the tolerance of the unsplit kernels.
"""

from __future__ import annotations

import numpy as np

from ...validate import Plan
from . import native_decode
from .blocks import finish, grouped_matmul, merge_pair_into
from .native_lib import Kept

__all__ = ["attend", "attend_finite", "attend_stored", "keep", "last_keys", "tail", "with_tail"]


def last_keys(lo: np.ndarray, hi: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Where each sequence's last ``rows − 1`` keys lie, and which rows see them.

    Sequence ``b`` sees keys ``[lo[b], hi[b])`` from its last query row; its ``rows`` causal
    query rows see the keys ``[lo[b], hi[b] − rows + 1)`` all together. Returns
    ``(positions, seen)``: ``positions (batch, rows − 1)`` the keys after those, clipped at 0
    (a sequence with fewer keys than rows has fewer such keys: ``seen`` is False for the
    others), and ``seen (batch, 1, rows, rows − 1)``: whether row ``i`` sees key ``t``, that
    is ``t < i`` and ``positions[b, t] ≥ lo[b]``.

    Examples
    --------
    >>> pos, seen = last_keys(np.array([0]), np.array([10]), 3)
    >>> pos.tolist(), seen[0, 0].astype(int).tolist()
    ([[8, 9]], [[0, 0], [1, 0], [1, 1]])
    """
    t = np.arange(rows - 1)
    pos = hi[:, None] - (rows - 1) + t
    valid = pos >= lo[:, None]
    seen = valid[:, None, None, :] & (t[None, :] < np.arange(rows)[:, None])
    return np.maximum(pos, 0), seen


def tail(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    seen: np.ndarray,
    scale: float,
    softcap: float | None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(out, lse)`` of ``q (..., heads, L, d)`` against a few keys ``k (..., kv_heads, T,
    d)`` and values ``v (..., kv_heads, T, dv)``, all in the compute dtype, query row ``i``
    attending key ``t`` where ``seen`` (broadcast to ``(..., heads, L, T)``) holds: scores
    scaled, soft-capped (``c · tanh(s / c)``), softmax over the seen keys. A row that sees
    none gives output 0 and lse ``−inf``.

    Examples
    --------
    >>> q, k, v = np.ones((1, 1, 2, 4)), np.ones((1, 1, 1, 4)), np.full((1, 1, 1, 3), 2.0)
    >>> out, lse = tail(q, k, v, np.array([[False], [True]]), 0.5, None)
    >>> out[0, 0].tolist(), lse[0, 0].tolist()
    ([[0.0, 0.0, 0.0], [2.0, 2.0, 2.0]], [-inf, 2.0])
    """
    group = q.shape[-3] // k.shape[-3]
    s = _scores(q, k, seen, scale, softcap, group)
    top = s.max(axis=-1)
    offset = np.where(np.isneginf(top), top.dtype.type(0), top)
    with np.errstate(invalid="ignore"):  # (a score of inf: not finite, for the caller's rules)
        p = np.exp(s - offset[..., None])
    return finish(grouped_matmul(p, v, group), p.sum(axis=-1), offset)


def with_tail(
    found: tuple[np.ndarray, np.ndarray],
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    seen: np.ndarray,
    scale: float,
    softcap: float | None,
) -> tuple[np.ndarray, np.ndarray]:
    """``found``, the ``(out, lse)`` of ``q`` over some keys (arrays of the caller's that
    this overwrites, in the compute dtype), merged with :func:`tail`'s over ``k`` and ``v``
    (disjoint keys, seen where ``seen`` holds): attention over both sets of keys.

    The merge of :func:`qkv.merge` written for this one case in a few whole-array
    operations, since the step's rows are few: the largest of the two parts' offsets, each
    part's share of the softmax denominator, one sum. A row that sees no key in either part
    gives output 0 and lse ``−inf``.

    Examples
    --------
    >>> q, k, v = np.ones((1, 1, 2, 4)), np.ones((1, 1, 1, 4)), np.full((1, 1, 1, 3), 2.0)
    >>> first = (np.zeros((1, 1, 2, 3)), np.full((1, 1, 2), 2.0))  # output 0 over other keys
    >>> out, lse = with_tail(first, q, k, v, np.array([[False], [True]]), 0.5, None)
    >>> out[0, 0, :, 0].tolist(), lse[0, 0].round(4).tolist()  # row 1: half from each part
    ([0.0, 1.0], [2.0, 2.6931])
    """
    out, lse = found
    group = q.shape[-3] // k.shape[-3]
    with np.errstate(over="ignore", invalid="ignore"):
        s = _scores(q, k, seen, scale, softcap, group)
        top = np.maximum(lse, s.max(axis=-1))
        if not np.isfinite(top).all():  # rows that see nothing, or a score not finite
            return merge_pair_into(tail(q, k, v, seen, scale, softcap), found)
        p = np.exp(s - top[..., None])
        share = np.exp(lse - top)
        denom = share + p.sum(axis=-1)
        p /= denom[..., None]
        out *= (share / denom)[..., None]
        _add_weighted(out, p, v, group)
        return out, top + np.log(denom)


def _scores(
    q: np.ndarray,
    k: np.ndarray,
    seen: np.ndarray,
    scale: float,
    softcap: float | None,
    group: int,
) -> np.ndarray:
    """The scaled, soft-capped scores of ``q`` against ``k``, ``−inf`` where ``seen`` is
    False."""
    s = grouped_matmul(q, np.swapaxes(k, -1, -2), group)
    s *= s.dtype.type(scale)
    if softcap is not None:
        s = s.dtype.type(softcap) * np.tanh(s / s.dtype.type(softcap))
    return np.where(seen, s, s.dtype.type(-np.inf))


#: The bytes of output :func:`_add_weighted` adds at a time: temporaries this small are
#: served from memory the process holds, where a temporary the size of a batch's output is
#: fresh memory (a page fault per 4 KiB on first touch), which cost more than the sums.
PIECE_BYTES = 64 << 10


def _add_weighted(out: np.ndarray, p: np.ndarray, v: np.ndarray, group: int) -> None:
    """``out (..., heads, L, dv) += p (..., heads, L, T) @ v (..., kv_heads, T, dv)``, with
    ``group`` query heads a kv head, a few sequences at a time. (A product over one key is
    an outer product, which ``einsum`` runs several times faster than ``matmul``; over more
    keys ``matmul`` is the faster.)"""
    heads, rows, t = p.shape[-3:]
    kvh, dv = v.shape[-3], v.shape[-1]
    product = _outer if t == 1 else np.matmul
    if not out.flags.c_contiguous or v.shape[:-3] != p.shape[:-3]:
        out += product(p.reshape(*p.shape[:-3], kvh, group * rows, t), v).reshape(out.shape)
        return
    og = out.reshape(-1, kvh, group * rows, dv)
    pg = p.reshape(-1, kvh, group * rows, t)
    vg = v.reshape(-1, kvh, t, dv)
    step = max(1, PIECE_BYTES // max(og[0].nbytes, 1))
    for i in range(0, og.shape[0], step):
        og[i : i + step] += product(pg[i : i + step], vg[i : i + step])


def _outer(p: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``p (..., r, 1) @ v (..., 1, d)``."""
    return np.einsum("...rt,...td->...rd", p, v)


def _native_step(plan: Plan, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """A causal plan of several rows on ``k`` and ``v`` (its K/V in the compute dtype, or
    stored in 16 bits) in one native step with its rows causal; None where the native step
    does not serve it, a row sees no key at all (the general kernels' rules) or a result is
    not finite."""
    if plan.S < plan.L:
        return None
    return native_decode.plain(plan.q, k, v, plan.scale, plan.softcap, causal=True)


def attend(plan: Plan) -> tuple[np.ndarray, np.ndarray]:
    """The router's "native decode, causal rows": a causal plan of ``2 … DECODE_MAX_L`` query
    rows with K/V in the compute dtype, on the native step with its rows causal; where that
    step does not serve it (or a result is not finite), the NumPy decode kernel
    (:func:`qkv.engine.kernels.decode.attend`), whose results the dispatcher checks as for
    every kernel."""
    assert plan.v is not None  # (the router asks for values)
    found = _native_step(plan, plan.k, plan.v)
    if found is not None:
        return found
    from . import decode

    return decode.attend(plan)


def attend_finite(plan: Plan) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`attend` where the native step serves the plan and its result is finite; else
    None (the shorter road the router tries first: the dispatcher then runs :func:`attend`
    with the overflow retries every kernel shares)."""
    assert plan.v is not None  # (the router asks for values)
    return _native_step(plan, plan.k, plan.v)


def keep(plan: Plan) -> Kept | None:
    """The native step with its rows causal kept for operands laid out as ``plan``'s
    (:func:`qkv.engine.kernels.native_decode.keep`): what a plain call of a few causal rows
    keeps per shapes (:func:`qkv.engine.run.plain`). None where a row sees no key."""
    return None if plan.S < plan.L else native_decode.keep(plan, causal=True)


def attend_stored(plan: Plan) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`attend` on a plan's float16/bfloat16 K/V read as stored (:attr:`Plan.stored`):
    float32 ``(out, lse)``, or None where not served (the dispatcher then widens them)."""
    assert plan.stored is not None
    return _native_step(plan, *plan.stored_kv())
