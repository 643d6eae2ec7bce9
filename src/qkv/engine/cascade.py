"""A prompt prefix shared by many sequences, attended once per step (FlashInfer's cascade).

Requests forked from one prompt hold its pages once: the same leading block ids in every row
of the block table (:meth:`qkv.PagedKVCache.fork`, or a server's prefix cache). A decoding step
that reads each sequence's pages reads those shared pages once per sequence. Attention splits
over disjoint key sets instead (:func:`qkv.merge`)::

    attention(q_b, keys_b) = merge(attention(q_b, prefix), attention(q_b, own_b))

and the prefix part of every sequence is one problem: all the sequences' queries of a kv head
are the query rows of one prefill-shaped call against the prefix's keys (no causal mask: each
query sits after the whole prefix), so the prefix is read once and its products run as matrix
products, not one streamed pass per sequence. The own parts are the usual paged step on the
rest of each row of the table. :func:`shared_columns` finds the prefix; the router decides
whether the step splits there (:func:`qkv.engine.kernels.router.cascade`); :func:`attend` runs
the split. Both parts and the merge are qkv's own kernels, so the result equals the reference on
each sequence's keys within the same tolerance as the unsplit step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..validate import Plan, make_plan, stand_in
from .kernels.blocks import merge_arrays, merge_pair_into

__all__ = ["Prefix", "attend", "shared_columns"]


def shared_columns(table: np.ndarray, lengths: np.ndarray, page: int, rows: int) -> int:
    """The leading columns of the checked block ``table`` that every sequence shares (equal
    block ids in every row) and that every one of their ``rows`` queries sees whole under a
    bottom-right causal mask (the prefix ends at or before each sequence's first query:
    ``columns · page ≤ lengths − rows + 1``). Whether that is worth a split is the router's
    call (:func:`qkv.engine.kernels.router.cascade`).

    >>> t = np.array([[3, 4, 7], [3, 4, 9], [3, 4, 2]], dtype=np.int32)
    >>> shared_columns(t, np.array([300, 290, 280]), 128, 1)
    2
    >>> shared_columns(t, np.array([300, 200, 280]), 128, 1)  # 200 keys: one whole page
    1
    """
    B, cols = table.shape
    if B == 0 or cols == 0:
        return 0
    same = (table == table[:1]).all(axis=0)
    n = cols if same.all() else int(np.argmin(same))
    n = min(n, int((lengths.min() - rows + 1) // page))
    return max(n, 0)


@dataclass(frozen=True)
class Prefix:
    """A prefix's ``keys`` over ``kv_heads`` heads with values of size ``dv``, and ``attend``:
    the ``(out, lse)`` of a checked plan whose K/V are stand-ins of the prefix's shapes
    ``(kv_heads, keys, ·)`` (the prefix read where it lies: its pages), arrays of its own
    that :func:`attend` may overwrite."""

    keys: int
    kv_heads: int
    dv: int
    attend: Callable[[Plan], tuple[np.ndarray, np.ndarray]]


def attend(
    plan: Plan,
    prefix: Prefix,
    own: Callable[[np.ndarray, tuple[np.ndarray, np.ndarray]], tuple[np.ndarray, np.ndarray, bool]],
    lengths: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """``(out, lse)`` of a checked paged step ``plan`` (``q (batch, heads, Lq, d)`` in the
    compute dtype; no window, no position-dependent variant) split at a shared ``prefix``.

    ``own(rest, prior)`` runs the paged step on the rest of each sequence's keys (``rest`` of
    them, after the prefix's) and gives ``(out, lse, merged)``: with ``merged``, its result
    with the prefix part ``prior`` merged in (the native step's :meth:`DecodePlan.run_after
    <qkv.engine.decoding.DecodePlan.run_after>`); else its own part, arrays of its own, as
    ``prefix.attend`` gives them, and the two parts are merged here, in their memory where they
    are of the compute dtype. ``lengths`` are the sequences' key counts, all at least
    ``prefix.keys + Lq − 1``.
    """
    q = plan.q
    B, H, Lq, d = q.shape
    kvh, P, dv = prefix.kv_heads, prefix.keys, prefix.dv
    g = H // kvh
    # every sequence's queries of kv head h as the rows of one problem: (kv_heads, B·g·Lq, d)
    rows = q.reshape(B, kvh, g * Lq, d).transpose(1, 0, 2, 3).reshape(kvh, B * g * Lq, d)
    dt = plan.acc_dtype
    part = make_plan(
        rows, stand_in(dt, (kvh, P, d)), stand_in(dt, (kvh, P, dv)), scale=plan.scale,
        softcap=plan.softcap,
    )  # fmt: skip
    out_p, lse_p = prefix.attend(part)
    # (batch, kv_heads, g·Lq, ·) views of the prefix part's rows
    out_p = out_p.reshape(kvh, B, g * Lq, dv).transpose(1, 0, 2, 3)
    lse_p = lse_p.reshape(kvh, B, g * Lq).transpose(1, 0, 2)
    rest = lengths - P
    if not rest.any():
        return out_p.reshape(B, H, Lq, dv), lse_p.reshape(B, H, Lq)
    out_o, lse_o, merged = own(rest, (out_p, lse_p))
    if merged:
        return out_o, lse_o
    owned = out_p.flags.writeable and out_o.flags.writeable and out_o.flags.c_contiguous
    if all(x.dtype == dt for x in (out_p, lse_p, out_o, lse_o)) and owned:
        # both parts' outputs are this call's own: merged in their memory, in the own part's
        # (batch, heads, Lq, dv) layout
        out, lse = merge_pair_into(
            (out_p, lse_p), (out_o.reshape(out_p.shape), lse_o.reshape(lse_p.shape))
        )
        return out.reshape(B, H, Lq, dv), lse.reshape(B, H, Lq)
    return merge_arrays([(out_p.reshape(B, H, Lq, dv), lse_p.reshape(B, H, Lq)), (out_o, lse_o)])
