"""Dense kernel: the whole ``L x S`` score matrix at once, in the compute dtype.

Must equal :func:`qkv.reference.attention`. Grouped-query heads are served by reshaping the
queries to ``(..., Hkv, group, L, d)`` so that K and V are never repeated in memory. float16
inputs are computed in float32, so ``q·k`` beyond 65504 does not overflow.
"""

from __future__ import annotations

import numpy as np

from ...masks import allowed, query_positions
from ...validate import Plan
from . import mods
from .blocks import finish, grouped_matmul

__all__ = [
    "attend",
    "attend_plain",
    "attend_plain_finite",
    "logits",
    "raw_scores",
    "row_max",
    "softmax_rows",
]


def raw_scores(plan: Plan) -> np.ndarray:
    """``q kᵀ · scale`` in the compute dtype, shape ``(*batch, L, S)``.

    The scale is folded into ``q`` first, as in the other kernels, so a product ``q·k`` beyond
    the dtype's range whose scaled value fits does not overflow.
    """
    q = plan.q * plan.acc_dtype.type(plan.scale)
    return grouped_matmul(q, np.swapaxes(plan.k, -1, -2), plan.group)


def logits(plan: Plan) -> np.ndarray:
    """Scaled scores with the variants (:func:`mods.apply`) plus bias, ``-inf`` where masked."""
    s = raw_scores(plan)
    if plan.modded:
        p = query_positions(plan.L, plan.S)[:, None]
        s = mods.apply(plan, s, ..., p, np.arange(plan.S)[None, :])
    if plan.bias is not None:
        s += plan.bias
    ok = allowed(plan.L, plan.S, causal=plan.causal, window=plan.window)
    if plan.mask is not None:
        ok = plan.mask if ok is None else ok & plan.mask
    if ok is not None:
        s = np.where(ok, s, plan.acc_dtype.type(-np.inf))
    return s


def row_max(z: np.ndarray) -> np.ndarray:
    """Row maxima (keepdims) that softmax subtracts; 0 for a row that is all ``-inf``."""
    m = np.max(z, axis=-1, keepdims=True, initial=-np.inf)
    m[m == -np.inf] = 0.0
    return m


def softmax_rows(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row softmax of ``z`` (in place) and its log-sum-exp; all ``-inf`` rows give zeros."""
    m = row_max(z)
    z -= m
    np.exp(z, out=z)
    return finish(z, np.sum(z, axis=-1), m[..., 0])


def attend(plan: Plan) -> tuple[np.ndarray, np.ndarray]:
    """Output ``(*batch, L, dv)`` and lse ``(*batch, L)``, both in the compute dtype."""
    w, lse = softmax_rows(logits(plan))
    assert plan.v is not None  # attention's output needs values
    return grouped_matmul(w, plan.v, plan.group), lse


def attend_plain(plan: Plan) -> tuple[np.ndarray, np.ndarray]:
    """:func:`attend` for a plan with no mask, bias, window or variant and ``S >= 1``, where
    every row sees every key: the same steps with nothing to mask (small calls cost little).

    A row's maximum is finite for finite scores, so its denominator is at least 1; a non-finite
    maximum (an overflow or a NaN/inf input) gives a non-finite output, which the caller
    (:func:`qkv.engine.kernels.dispatch.attend`) hands to the general path.
    """
    g = plan.group
    s = grouped_matmul(plan.q * plan.acc_dtype.type(plan.scale), np.swapaxes(plan.k, -1, -2), g)
    m = s.max(axis=-1, keepdims=True)
    s -= m
    np.exp(s, out=s)
    denom = s.sum(axis=-1)
    assert plan.v is not None  # attention's output needs values
    out = grouped_matmul(s, plan.v, g)
    out /= denom[..., None]
    return out, m[..., 0] + np.log(denom)


def attend_plain_finite(plan: Plan) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`attend_plain`'s result where it is finite, else None (the caller's general road
    and its overflow rules follow)."""
    with np.errstate(over="ignore", invalid="ignore"):
        out, lse = attend_plain(plan)
    return (out, lse) if np.isfinite(out).all() else None
