"""What the engine does with a result that is not finite: qkv's overflow ladder, written once
for the attention, its weights and its gradients.

A kernel computes in the plan's compute dtype; where a result is not finite, the ladder tries
the next rung: the values rescaled by a power of two (an accumulator that overflowed), then the
plan redone in float64 where its finite inputs can overflow the compute dtype, then a refusal
that names the scores' size where even float64 cannot hold them. NaN and infinity in the
inputs propagate by policy. A scale that is not a normal number of the compute dtype (the
kernels fold it into ``q``) runs in float64 at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from ...errors import InputError
from ...numerics import scale_in_range
from ...validate import Plan

__all__ = [
    "check_overflow",
    "ladder",
    "may_overflow",
    "rescaled",
    "scale_fits",
    "widened",
]


def ladder(
    plan: Plan,
    run: Callable[[Plan], Any],
    finite: Callable[[Any], bool],
    *,
    repair: Callable[[Any], Any] | None = None,
    narrow: Callable[[Any], Any] | None = None,
    whole: Callable[[], Plan] | None = None,
) -> Any:
    """``run(plan)`` with qkv's rules for results that are not finite, written once for the
    attention, its weights and its gradients.

    The rungs: a scale that is not a normal number of the compute dtype runs in float64 at
    once; else ``run(plan)``, then (where not ``finite``) ``repair`` (the attention's rescaled
    values), then float64 where the finite inputs can overflow the compute dtype
    (:func:`may_overflow`); a result still not finite from finite inputs whose scores pass
    float64's range is refused (:func:`check_overflow`), while NaN and infinity in the inputs
    propagate by policy. A float64 run's result is brought back by ``narrow`` (default: each
    array to the compute dtype). No NumPy warning is raised on the way: an intermediate may
    overflow on the way to a finite answer. ``whole()`` gives the plan with its stored K/V
    widened, for the rungs after the first (``run`` may read them as stored); without it,
    ``plan`` holds none.
    """

    def in_float64() -> Any:
        res = run(widened(whole() if whole is not None else plan))
        if narrow is not None:
            return narrow(res)
        return tuple(None if x is None else x.astype(plan.acc_dtype) for x in res)

    with np.errstate(over="ignore", invalid="ignore"):
        if not scale_fits(plan):
            res = in_float64()
        else:
            res = run(plan)
            if repair is not None and not finite(res):
                res = repair(res)
            if not finite(res) and plan.acc_dtype != np.float64:
                if may_overflow(whole() if whole is not None else plan):
                    res = in_float64()
    if not finite(res):
        check_overflow(whole() if whole is not None else plan)
    return res


def check_overflow(plan: Plan) -> None:
    """Raise :class:`InputError` when finite inputs give scores beyond float64's range.

    Called when a result is not finite after every retry. NaN and infinity in ``q``, ``k``,
    ``v`` or the bias propagate by policy, so they are left alone; but finite inputs whose
    scores ``q·kᵀ·scale`` overflow even float64 (``q = k = 1e200``) would otherwise give NaN
    without a word. The softmax of such scores has no float64 computation, so it is refused.
    ``plan`` holds no stored K/V (:meth:`Plan.materialized`).
    """
    arrays = [a for a in (plan.q, plan.k, plan.v) if a is not None]
    if not all(np.isfinite(a).all() for a in arrays):
        return
    if plan.bias is not None and (np.isnan(plan.bias).any() or np.isposinf(plan.bias).any()):
        return
    f64 = float(np.finfo(np.float64).max)
    if _score_bound(plan) > f64 / 4:
        raise InputError(
            f"q, k: the scaled scores q·kᵀ·scale may reach {_magnitude(plan)} (scale "
            f"{plan.scale:.5g}, "
            f"q {plan.q.shape}, k {plan.k.shape}), beyond float64's range (±{f64:.4g}), so the "
            "softmax would be NaN; divide q or k (or the scale) by a constant first"
        )


def may_overflow(plan: Plan) -> bool:
    """Whether the finite entries of ``q``, ``k`` and the bias can make a score overflow the
    compute dtype (a bound: ``scale · d · max|q| · max|k| + max|bias|``; ``plan`` holds no
    stored K/V)."""
    return _score_bound(plan) > float(np.finfo(plan.acc_dtype).max) / 4


def _magnitude(plan: Plan) -> str:
    """``scale · d · max|q| · max|k|`` written as a power of ten (it may exceed float64)."""
    parts = [plan.scale, plan.d, float(np.max(np.abs(plan.q))), float(np.max(np.abs(plan.k)))]
    if min(parts) <= 0:
        return "0"
    return f"1e{math.floor(sum(math.log10(x) for x in parts))}"


def _score_bound(plan: Plan) -> float:
    """``scale · d · max|q| · max|k| + max|bias|`` over finite entries, in Python floats
    (``inf`` past float64)."""

    def finite_max(a: np.ndarray) -> float:
        return float(np.max(np.abs(a), where=np.isfinite(a), initial=0.0)) if a.size else 0.0

    bound = plan.scale * plan.d * finite_max(plan.q) * finite_max(plan.k)
    if plan.bias is not None:
        bound += finite_max(plan.bias)
    return bound


def widened(plan: Plan) -> Plan:
    """``plan`` (with no stored K/V) computed in float64."""
    f64 = np.dtype(np.float64)
    return replace(
        plan,
        q=plan.q.astype(f64),
        k=plan.k.astype(f64),
        v=None if plan.v is None else plan.v.astype(f64),
        bias=None if plan.bias is None else plan.bias.astype(f64),
        acc_dtype=f64,
    )


def scale_fits(plan: Plan) -> bool:
    """Whether the scale is a normal number of the compute dtype (the kernels fold it into
    ``q`` there); a scale like ``1e-50`` or ``1e39`` needs float64 for float32 inputs."""
    return scale_in_range(plan.scale, plan.acc_dtype)


def rescaled(fn: Any, plan: Plan, out: np.ndarray, lse: np.ndarray) -> tuple[np.ndarray, ...]:
    """Rerun with ``v`` divided by a power of two when the kernel's accumulator overflowed.

    Tiled and decode sum ``exp(s - m) · v`` before dividing by the softmax denominator, so
    ``S · max|v|`` beyond the dtype's maximum overflows although the answer (a weighted mean of
    the values) fits. Scaling by ``2**-e`` is exact, and the check costs nothing on the usual
    path: it only runs when the output is not finite (NaN and inf in ``v`` are left out of the
    measure: they reach their own rows either way).
    """
    assert plan.v is not None  # outputs: the plan carries values
    vmax = float(np.max(np.abs(plan.v), where=np.isfinite(plan.v), initial=0.0))
    room = float(np.finfo(plan.acc_dtype).max) / 2**20
    # in logarithms: vmax · S / room may underflow (tiny values) or overflow
    need = math.log2(vmax) + math.log2(max(plan.S, 1)) - math.log2(room) if vmax > 0 else 0.0
    e = max(0, math.ceil(need))
    if e == 0:
        return out, lse  # not an accumulator overflow: NaN or inf came from q or k
    f = plan.acc_dtype.type(2.0**e)
    out2, lse2 = fn(replace(plan, v=plan.v / f))
    return out2 * f, lse2
