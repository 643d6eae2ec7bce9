"""Padding masks as key counts: a plan whose mask only hides a tail of keys per batch row.

A tokenizer's padding mask, boolean or ``0``/``-inf``, ``(B, 1, 1, S)`` or ``(B, 1, L, S)``, is
read once by the validation layer as a key count per batch row (:attr:`Plan.key_counts`,
:func:`qkv.masks.tail_counts`); here such a plan runs without its mask, on the road the router
chooses (:data:`qkv.engine.kernels.router.KEY_COUNTS`):

- where the router sends the unmasked problem to the dense kernel (short rows), one call of
  :func:`attend_dense`: the scores of every key, the hidden tail of each batch row set to
  ``-inf`` by one slice per row (the mask is never broadcast to the scores nor read
  elementwise), then the softmax and the values' product as usual;
- where it sends it to the native prefill (float32/float64, K/V in their dtype or stored in
  16 bits), one call that clips each batch row's keys to its count
  (:func:`qkv.engine.kernels.native.attend`'s ``counts``): the padding's tiles are skipped;
- otherwise, where the rows have at most :data:`~qkv.engine.kernels.router.MAX_GROUPS`
  distinct counts (one sentence, or a batch of full rows and one length), the batch rows of
  each count run together on keys ``[:count]`` with no mask at all, on the kernel the router
  picks for them
  (:func:`attend_grouped`): the native prefill then skips the padding's tiles. With more
  distinct counts the native prefill reads the mask itself: measured on 2 cores (B8 and B32,
  H8, L = S = 256 and 512, lengths drawn in [S/2, S]), one call with the mask took as long as
  one call per count or less.

Causal and the window stay aligned to all ``S`` keys (query ``i`` sits at ``S - L + i``):
keys ``[:c]`` with the query positions moved ``S - c`` places later are a window
``(left - (S - c), min(right, 0 if causal) + (S - c))`` on the shorter problem. A left side that
would go below 0 keeps those rows on their mask. Rows with count 0 give output 0 and lse
``-inf``. Both roads equal :func:`qkv.reference.attention` on the plan with its mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from ...masks import Window
from ...validate import Plan, stand_in
from .blocks import grouped_matmul
from .dense import logits, softmax_rows

__all__ = [
    "attend_dense",
    "attend_grouped",
    "bare",
    "shifted",
]

Result = tuple[np.ndarray, np.ndarray]


def bare(plan: Plan) -> Plan:
    """``plan`` without its mask (and key counts): what the router chooses a kernel for."""
    return plan.but(mask=None, bias=None, key_counts=None)


def attend_dense(plan: Plan, counts: np.ndarray) -> Result:
    """The dense kernel on a plan without mask whose batch row ``b`` may attend only keys
    ``[:counts[b]]``: the hidden keys' scores set to ``-inf`` one slice per row.

    Must equal :func:`qkv.reference.attention` with the padding mask of ``counts``.
    """
    s = logits(plan)
    if not s.flags.writeable:
        s = s.copy()
    S = plan.S
    if not plan.batch or counts.size == 1:
        c = int(counts[0])
        if c < S:
            s[..., c:] = -np.inf
    else:
        for b in np.flatnonzero(counts < S).tolist():
            s[b, ..., int(counts[b]) :] = -np.inf
    w, lse = softmax_rows(s)
    assert plan.v is not None  # attention's output needs values
    return grouped_matmul(w, plan.v, plan.group), lse


def shifted(plan: Plan, c: int) -> tuple[bool, Window | None] | None:
    """``(causal, window)`` of ``plan`` on its first ``c`` keys with the queries' positions
    kept (moved ``S - c`` places later in the shorter problem's bottom-right alignment); None
    where that needs a negative left side."""
    delta = plan.S - c
    if not delta or not (plan.causal or plan.window is not None):
        return plan.causal, plan.window
    left, right = plan.window if plan.window is not None else (None, None)
    if plan.causal:
        right = 0 if right is None else min(right, 0)
    if left is not None:
        if left < delta:
            return None
        left -= delta
    if right is not None:
        right += delta
        if right >= plan.L + c:
            right = None
    return False, None if left is None and right is None else (left, right)


def _rows(plan: Plan, rows: Any, c: int, rule: tuple[bool, Window | None]) -> Plan:
    """Batch rows ``rows`` (a slice or indices of axis 0) of an unmasked ``plan`` on their
    first ``c`` keys, under ``rule`` (:func:`shifted`)."""
    assert plan.v is not None

    def take(a: np.ndarray, keys: bool) -> np.ndarray:
        if plan.batch:
            a = a[rows]
        return a[..., :c, :] if keys else a

    fields: dict[str, Any] = {"q": take(plan.q, False), "causal": rule[0], "window": rule[1]}
    if plan.sinks is not None:
        fields["sinks"] = plan.sinks[rows] if plan.batch else plan.sinks
    if plan.stored is None:
        k, v = take(plan.k, True), take(plan.v, True)
    else:  # 16-bit K/V as given: slice them, with stand-ins of the new shapes
        ks, vs = (take(a, True) for a in plan.stored_kv())
        fields["stored"] = (ks, vs)
        k = stand_in(plan.acc_dtype, ks.shape[:-1] + plan.k.shape[-1:])
        v = stand_in(plan.acc_dtype, vs.shape[:-1] + plan.v.shape[-1:])
    return replace(plan, k=k, v=v, given=(), **fields)


def attend_grouped(plan: Plan, counts: np.ndarray, run: Callable[[Plan], Result]) -> Result | None:
    """``plan`` (with key ``counts``, one per batch row) as one call of ``run`` per distinct
    count, each on the batch rows of that count and their first ``count`` keys, with no mask;
    rows of count 0 give 0 and ``-inf``. None where some rows would need a negative window
    side, or where rows of count 0 meet sinks (the caller then runs the plan on its mask)."""
    if plan.sinks is not None and not counts.all():
        return None
    base = bare(plan)
    todo: list[tuple[Any, int, tuple[bool, Window | None]]] = []
    for c in np.unique(counts).tolist():
        if c == 0:
            continue
        rule = shifted(base, c)
        if rule is None:
            return None
        if counts.size == 1:
            rows: Any = slice(None)
        else:
            at = np.flatnonzero(counts == c)
            rows = slice(at[0], at[-1] + 1) if at[-1] - at[0] + 1 == at.size else at
        todo.append((rows, c, rule))
    assert plan.v is not None
    dt = plan.acc_dtype
    out = np.zeros(plan.batch + (plan.L, plan.dv), dtype=dt)
    lse = np.full(plan.batch + (plan.L,), -np.inf, dtype=dt)
    for rows, c, rule in todo:
        o, m = run(_rows(base, rows, c, rule))
        if plan.batch:
            out[rows], lse[rows] = o, m
        else:
            out[...], lse[...] = o, m
    return out, lse
