"""The definitional formula, in float64: the oracle every other path is tested against.

``attention(q, k, v) = softmax(q kᵀ · scale + bias, masked) v``, computed literally: the full
score matrix, kv heads repeated for grouped-query attention, a max-subtracted softmax. Slow and
memory-hungry on purpose; short enough to read in one screen.

Examples
--------
>>> from qkv import reference
>>> reference.scores([2, 1], [[1, 0], [3, 2]], scale=1 / 2).tolist()
[1.0, 4.0]
>>> reference.attention([2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4]], scale=1 / 2).round(4).tolist()
[2.9051, 3.9051]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .masks import allowed
from .validate import Plan, make_plan

__all__ = ["attention", "attention_weights", "scores", "softmax"]


def _repeat_kv(x: np.ndarray, plan: Plan) -> np.ndarray:
    """kv head ``h // group`` serves query head ``h``."""
    return np.repeat(x, plan.group, axis=-3) if plan.group > 1 else x


def _logits(plan: Plan) -> np.ndarray:
    """Scaled scores plus bias, with ``-inf`` where a query may not attend a key."""
    s = plan.q @ np.swapaxes(_repeat_kv(plan.k, plan), -1, -2) * plan.scale
    if plan.bias is not None:
        s = s + plan.bias
    ok = allowed(plan.L, plan.S, causal=plan.causal, window=plan.window)
    if plan.mask is not None:
        ok = plan.mask if ok is None else ok & plan.mask
    return s if ok is None else np.where(ok, s, -np.inf)


def softmax(x: Any, axis: int = -1) -> np.ndarray:
    """``exp(x - max) / sum(exp(x - max))`` in float64; an all ``-inf`` slice gives zeros."""
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x, axis=axis, keepdims=True, initial=-np.inf)  # no keys at all: -inf too
    m = np.where(m == -np.inf, 0.0, m)
    e = np.exp(x - m)
    total = np.sum(e, axis=axis, keepdims=True)
    empty = total == 0  # nothing to attend: zeros; a NaN row stays NaN
    return np.where(empty, 0.0, e / np.where(empty, 1.0, total))


def scores(q: Any, k: Any, *, scale: Any = None) -> np.ndarray:
    """Scaled pre-softmax scores ``q kᵀ · scale``, shape ``(..., L, S)`` (``(S,)`` for 1-D q)."""
    plan = make_plan(q, k, need_v=False, scale=scale, dtype=np.float64)
    s = plan.q @ np.swapaxes(_repeat_kv(plan.k, plan), -1, -2) * plan.scale
    return s[..., 0, :] if plan.squeeze else s


def attention_weights(
    q: Any,
    k: Any,
    *,
    scale: Any = None,
    causal: bool = False,
    mask: Any = None,
    window: Any = None,
) -> np.ndarray:
    """Softmax of the masked logits, shape ``(..., L, S)``; masked keys get weight 0."""
    plan = make_plan(
        q, k, need_v=False, scale=scale, causal=causal, mask=mask, window=window, dtype=np.float64
    )
    w = softmax(_logits(plan))
    return w[..., 0, :] if plan.squeeze else w


def attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    scale: Any = None,
    causal: bool = False,
    mask: Any = None,
    window: Any = None,
    return_lse: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """``softmax(q kᵀ · scale) v`` in float64, optionally with the rows' log-sum-exp."""
    plan = make_plan(
        q, k, v, scale=scale, causal=causal, mask=mask, window=window, dtype=np.float64
    )
    z = _logits(plan)
    out = softmax(z) @ _repeat_kv(plan.v, plan)
    m = np.max(z, axis=-1, initial=-np.inf)
    finite_m = np.where(m == -np.inf, 0.0, m)
    with np.errstate(divide="ignore"):
        lse = finite_m + np.log(np.sum(np.exp(z - finite_m[..., None]), axis=-1))
    if plan.squeeze:
        out, lse = out[..., 0, :], lse[..., 0]
    return (out, lse) if return_lse else out
