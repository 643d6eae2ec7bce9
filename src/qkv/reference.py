"""The definitional formula, in float64: the oracle every other path is tested against.

``attention(q, k, v) = softmax(q kᵀ · scale + bias, masked) v``, computed literally: the full
score matrix, kv heads repeated for grouped-query attention, a max-subtracted softmax. Slow and
memory-hungry on purpose; short enough to read in one screen.

Variants, in the order they apply: ``softcap`` (``c · tanh(s / c)`` of the scaled scores),
ALiBi (``− slope · (query position − key position)`` for keys at or before the query),
``score_mod``, the float mask, then the masks (``causal``, ``window``, ``mask``, ``mask_mod``).
``sinks`` are one more column of the softmax, with no value.

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

from .keywords import near_keywords
from .masks import allowed
from .validate import VARIANTS, Plan, make_plan

__all__ = ["attention", "attention_weights", "scores", "softmax"]


def _repeat_kv(x: np.ndarray, plan: Plan) -> np.ndarray:
    """kv head ``h // group`` serves query head ``h``."""
    return np.repeat(x, plan.group, axis=-3) if plan.group > 1 else x


def _indices(plan: Plan) -> tuple[np.ndarray, ...]:
    """Batch, head, query-position and key-position index arrays broadcasting to the scores."""
    n = len(plan.batch)
    shape = plan.batch or (1,)
    flat = np.arange(int(np.prod(shape))).reshape(shape)
    b = (flat // shape[-1]).reshape(plan.batch + (1, 1))
    h = (flat % shape[-1]).reshape(plan.batch + (1, 1))
    p = np.arange(plan.L).reshape((1,) * n + (plan.L, 1)) + plan.S - plan.L
    j = np.arange(plan.S).reshape((1,) * n + (1, plan.S))
    return b, h, p, j


def _logits(plan: Plan) -> np.ndarray:
    """Scaled scores with the variants and bias, ``-inf`` where a query may not attend a key."""
    s = plan.q @ np.swapaxes(_repeat_kv(plan.k, plan), -1, -2) * plan.scale
    b, h, p, j = _indices(plan)
    if plan.softcap is not None:
        s = plan.softcap * np.tanh(s / plan.softcap)
    if plan.alibi is not None:
        s = s - plan.alibi[..., None, None] * np.where(j <= p, p - j, 0)
    if plan.score_mod is not None:
        s = np.broadcast_to(np.asarray(plan.score_mod(s.copy(), b, h, p, j), float), s.shape)
    if plan.bias is not None:
        s = s + plan.bias
    ok = allowed(plan.L, plan.S, causal=plan.causal, window=plan.window)
    if plan.mask is not None:
        ok = plan.mask if ok is None else ok & plan.mask
    if plan.mask_mod is not None:
        mm = np.asarray(plan.mask_mod(b, h, p, j), dtype=bool)
        ok = mm if ok is None else ok & mm
    return s if ok is None else np.where(ok, s, -np.inf)


def _with_sink(z: np.ndarray, plan: Plan) -> np.ndarray:
    """The logits with the sink as one more column (``-inf`` when there are no sinks)."""
    sink = np.full(z.shape[:-1] + (1,), -np.inf)
    if plan.sinks is not None:
        sink[...] = plan.sinks[..., None, None]
    return np.concatenate([z, sink], axis=-1)


@near_keywords()
def softmax(x: Any, axis: int = -1) -> np.ndarray:
    """``exp(x - max) / sum(exp(x - max))`` in float64; an all ``-inf`` slice gives zeros."""
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x, axis=axis, keepdims=True, initial=-np.inf)  # no keys at all: -inf too
    m = np.where(m == -np.inf, 0.0, m)
    e = np.exp(x - m)
    total = np.sum(e, axis=axis, keepdims=True)
    empty = total == 0  # nothing to attend: zeros; a NaN row stays NaN
    return np.where(empty, 0.0, e / np.where(empty, 1.0, total))


@near_keywords()
def scores(q: Any, k: Any, *, scale: Any = None) -> np.ndarray:
    """Scaled pre-softmax scores ``q kᵀ · scale``, shape ``(..., L, S)`` (``(S,)`` for 1-D q)."""
    plan = make_plan(q, k, need_v=False, scale=scale, dtype=np.float64)
    s = plan.q @ np.swapaxes(_repeat_kv(plan.k, plan), -1, -2) * plan.scale
    return s[..., 0, :] if plan.squeeze else s


@near_keywords(VARIANTS)
def attention_weights(
    q: Any,
    k: Any,
    *,
    scale: Any = None,
    causal: bool = False,
    mask: Any = None,
    window: Any = None,
    **variants: Any,
) -> np.ndarray:
    """Softmax of the masked logits, shape ``(..., L, S)``; masked keys get weight 0.

    ``variants``: ``softcap``, ``sinks``, ``alibi_slopes``, ``score_mod``, ``mask_mod`` as in
    :func:`qkv.attention`. With sinks the weights sum to less than 1.
    """
    plan = make_plan(
        q,
        k,
        need_v=False,
        scale=scale,
        causal=causal,
        mask=mask,
        window=window,
        dtype=np.float64,
        **variants,
    )
    w = softmax(_with_sink(_logits(plan), plan))[..., :-1]
    return w[..., 0, :] if plan.squeeze else w


@near_keywords(VARIANTS)
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
    **variants: Any,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """``softmax(q kᵀ · scale) v`` in float64, optionally with the rows' log-sum-exp.

    ``variants``: ``softcap``, ``sinks``, ``alibi_slopes``, ``score_mod``, ``mask_mod`` as in
    :func:`qkv.attention`. A sink is one more logit in each row's softmax, with no value.
    """
    plan = make_plan(
        q, k, v, scale=scale, causal=causal, mask=mask, window=window, dtype=np.float64, **variants
    )
    z = _with_sink(_logits(plan), plan)
    assert plan.v is not None  # made with values
    out = softmax(z)[..., :-1] @ _repeat_kv(plan.v, plan)
    m = np.max(z, axis=-1, initial=-np.inf)
    finite_m = np.where(m == -np.inf, 0.0, m)
    with np.errstate(divide="ignore"):
        lse = finite_m + np.log(np.sum(np.exp(z - finite_m[..., None]), axis=-1))
    if plan.squeeze:
        out, lse = out[..., 0, :], lse[..., 0]
    return (out, lse) if return_lse else out
