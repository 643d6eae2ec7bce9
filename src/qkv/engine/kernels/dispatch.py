"""Run the kernel the router picks for a checked plan, or the one the caller forces.

Which kernel runs is decided in one place, :mod:`qkv.engine.kernels.router` (one ordered
table of kernels with their conditions); this module runs its choice, with the overflow
retries every kernel shares. The kernel families ``kernel=`` names:

- ``"dense"``: the whole score matrix at once; fastest while ``L · S`` is small, and for a
  few queries against a K/V small enough to sit in the caches.
- ``"decode"``: few queries against a large K/V; memory-bound, streams K and V once, splits
  the keys over the cores when batch × heads are too few.
- ``"tiled"``: online-softmax prefill over tiles; ``O(tile · S)`` extra memory.

``"auto"`` (the default) lets the router choose among them and their native versions; the
others force the family's NumPy kernel, for tests and benchmarks. Every kernel returns
``(out, lse)`` in the plan's compute dtype and equals the reference.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np

from ...errors import InputError, InputTypeError
from ...validate import Plan
from . import (
    decode,
    dense,
    key_counts,
    mods,
    native,
    native_bf16,
    native_decode,
    packed,
    router,
    stacked,
    tiled,
    tiled_backward,
)
from .router import (
    DECODE_MAX_L,
    DECODE_MIN_BYTES,
    DENSE_MAX_SCORES,
    KERNELS,
    TEAM_DECODE_MIN_BYTES,
    kv_bytes,
    scale_in_range,
)

__all__ = [
    "DECODE_MAX_L",
    "DECODE_MIN_BYTES",
    "DENSE_MAX_SCORES",
    "KERNELS",
    "TEAM_DECODE_MIN_BYTES",
    "attend",
    "attend_many",
    "backward",
    "check_kernel",
    "Choice",
    "check_overflow",
    "choose",
    "kv_bytes",
    "ladder",
    "may_overflow",
    "scale_fits",
    "scale_in_range",
    "weights",
    "widened",
]


def check_kernel(kernel: Any) -> str:
    """Validate a ``kernel=`` argument (one of :data:`KERNELS`)."""
    if not isinstance(kernel, str):
        raise InputTypeError(f"kernel: expected one of {KERNELS}, got {type(kernel).__name__}")
    if kernel not in KERNELS:
        raise InputError(f"kernel: expected one of {KERNELS}, got {kernel!r}")
    return kernel


Runner = Callable[[Plan], Any]


class Choice(NamedTuple):
    """The kernel a plan runs on, and the sizes it was chosen by (:func:`choose`).

    Attributes
    ----------
    name : str
        ``"dense"``, ``"tiled"`` or ``"decode"`` (the family, as ``kernel=`` names it).
    run : callable
        Computes ``(out, lse)`` of the plan (a row of the router's table that reads stored
        K/V gives None where its result is not finite: the general road then runs).
    kv_bytes : int
        The bytes of K and V in the compute dtype (:func:`kv_bytes`).
    scores : int
        ``L · S``, the scores per head.
    first : callable or None
        A shorter road tried before ``run``: it gives a finite ``(out, lse)`` or None (then
        ``run`` and the overflow retries follow). The dense kernel's for a problem whose rows
        all see every key, with no variant (:func:`dense.attend_plain`); the native decode
        step's for a plan with no mask (it checks its own result); the native prefill's on its
        own tile products where the scale is a normal number.
    kernel : str
        The router's name of the kernel (a row of :data:`~qkv.engine.kernels.router.FORWARD`).
    stored : bool
        Whether it reads the plan's stored K/V in place.
    counts : str or None
        For a plan run on its key counts, the router's road for them (a row of
        :data:`~qkv.engine.kernels.router.KEY_COUNTS`); the other fields are then its unmasked
        twin's.
    """

    name: str
    run: Runner
    kv_bytes: int
    scores: int
    first: Runner | None = None
    kernel: str = ""
    stored: bool = False
    counts: str | None = None


_new = tuple.__new__  # builds a Choice without the named tuple's keyword handling (small calls)

# Each row of the router's forward table, by name: the module and function that run it
# (looked up on each call, so that a test may stand in for a kernel).
RUNNERS: dict[str, tuple[Any, str]] = {
    "native decode, stored K/V": (native_decode, "attend_stored"),
    "native bfloat16 prefill": (native_bf16, "attend"),
    "native prefill, own tiles, stored K/V": (native, "attend_stored_own"),
    "native prefill, stored K/V": (native, "attend_stored"),
    "dense (forced)": (dense, "attend"),
    "tiled (forced)": (tiled, "attend"),
    "decode (forced)": (decode, "attend"),
    "native decode": (native_decode, "attend"),
    "decode": (decode, "attend"),
    "dense": (dense, "attend"),
    "native prefill, own tiles": (stacked, "attend_own"),
    "native prefill": (stacked, "attend"),
    "packed walk": (packed, "attend_plan"),
    "tiled": (tiled, "attend"),
}
# The shorter roads of the router's SHORT table, by name.
SHORT_RUNNERS: dict[str, tuple[Any, str]] = {
    "dense, every key seen": (dense, "attend_plain_finite"),
    "native decode, checked finite": (native_decode, "attend_finite"),
    "native prefill, own tiles, checked finite": (stacked, "attend_own_finite"),
}


def choose(plan: Plan, kernel: str = "auto", counts: bool = True) -> Choice:
    """The kernel ``plan`` runs on: the router's choice (:func:`router.choose`), with the
    functions that run it (``counts=False``: on the plan's mask, not its key counts).

    Examples
    --------
    >>> import numpy as np
    >>> from qkv.validate import make_plan
    >>> choose(make_plan(np.ones((4, 8)), np.ones((4, 8)), np.ones((4, 8)))).name
    'dense'
    >>> choose(make_plan(np.ones((1, 8)), np.ones((5000, 8)), np.ones((5000, 8)))).name
    'dense'
    >>> choose(make_plan(np.ones((1, 8)), np.ones((200_000, 8)), np.ones((200_000, 8)))).name
    'decode'
    >>> choose(make_plan(np.ones((500, 8)), np.ones((500, 8)), np.ones((500, 8)))).name
    'tiled'
    >>> choose(make_plan(np.ones((4, 8)), np.ones((4, 8)), np.ones((4, 8))), "tiled").name
    'tiled'
    """
    if kernel != "auto":
        check_kernel(kernel)
    row, short, road, size = router.choose(plan, kernel, counts)
    name = row.name
    module, function = RUNNERS[name]
    first = None if short is None else getattr(*SHORT_RUNNERS[short])
    values = (row.family, getattr(module, function), size, plan.L * plan.S, first, name)
    return _new(Choice, (*values, row.stored, road))


def attend(
    plan: Plan, kernel: str = "auto", choice: Choice | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Run ``choice`` (default: what :func:`choose` decides for ``kernel``) on ``plan``:
    ``(out, lse)``, repaired or explained when not finite.

    Sinks are added once, to the kernel's finished result (:func:`mods.with_sinks`).
    """
    if choice is None:
        choice = choose(plan, kernel)
    if choice.counts is not None:
        found = _on_key_counts(plan, choice)
        if found is not None:
            return found
        choice = choose(plan, kernel, counts=False)
    if plan.stored is not None:  # float16/bfloat16 K/V as given: read in place where served
        if choice.stored:
            found = choice.run(plan)
            if found is not None:  # else (not finite) the float32 kernels apply their rules
                return mods.with_sinks(plan, *found)
        plan = plan.materialized()  # every other kernel reads widened K/V
        if choice.stored:
            choice = choose(plan, kernel, counts=False)
    if choice.first is not None:
        found = choice.first(plan)
        if found is not None:
            return mods.with_sinks(plan, *found)
    fn = choice.run
    assert plan.v is not None  # outputs: the plan carries values
    out, lse = ladder(
        plan, lambda p: fn(p), lambda res: bool(np.isfinite(res[0]).all()),
        repair=(lambda res: _rescaled(fn, plan, *res)) if plan.v.size else None,
    )  # fmt: skip
    return mods.with_sinks(plan, out, lse)


def ladder(
    plan: Plan,
    run: Callable[[Plan], Any],
    finite: Callable[[Any], bool],
    *,
    repair: Callable[[Any], Any] | None = None,
    narrow: Callable[[Any], Any] | None = None,
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
    overflow on the way to a finite answer.
    """

    def in_float64() -> Any:
        res = run(widened(plan))
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
            if not finite(res) and plan.acc_dtype != np.float64 and may_overflow(plan):
                res = in_float64()
    if not finite(res):
        check_overflow(plan)
    return res


def _on_key_counts(plan: Plan, choice: Choice) -> tuple[np.ndarray, np.ndarray] | None:
    """A plan whose padding mask was read as key counts, run without it
    (:mod:`~qkv.engine.kernels.key_counts`) on the road the router chose
    (:data:`~qkv.engine.kernels.router.KEY_COUNTS`; ``choice`` is its unmasked twin's); None
    where that road cannot serve it (the general road then reads the mask)."""
    if choice.counts == "one call per key count":
        return key_counts.attend_grouped(plan, attend)
    base = key_counts.bare(plan)
    counted: Any = choice.run  # (the dense kernel's, or a runner that takes counts=)
    if choice.counts == "dense on key counts":
        counted = key_counts.attend_dense
    run = functools.partial(counted, counts=router.key_counts_per_row(plan))
    if choice.stored:  # None (not finite): the caller's general road, on the mask
        found = run(base)
        return None if found is None else mods.with_sinks(base, *found)
    # (the shorter road reads no counts)
    return attend(base, choice=choice._replace(run=run, first=None, counts=None))


def weights(plan: Plan) -> np.ndarray:
    """The attention weights ``(*batch, L, S)`` in the compute dtype (the dense kernel's).

    As in :func:`attend`, finite inputs whose scores overflow the compute dtype are redone in
    float64, without NumPy warnings on the way.
    """
    return ladder(
        plan,
        lambda p: dense.softmax_rows(dense.logits(p))[0],
        lambda w: bool(np.isfinite(w).all()),
        narrow=lambda w: w.astype(plan.acc_dtype),
    )


def check_overflow(plan: Plan) -> None:
    """Raise :class:`InputError` when finite inputs give scores beyond float64's range.

    Called when a result is not finite after every retry. NaN and infinity in ``q``, ``k``,
    ``v`` or the bias propagate by policy, so they are left alone; but finite inputs whose
    scores ``q·kᵀ·scale`` overflow even float64 (``q = k = 1e200``) would otherwise give NaN
    without a word. The softmax of such scores has no float64 computation, so it is refused.
    """
    plan = plan.materialized()
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
    compute dtype (a bound: ``scale · d · max|q| · max|k| + max|bias|``)."""

    return _score_bound(plan.materialized()) > float(np.finfo(plan.acc_dtype).max) / 4


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
    """``plan`` computed in float64."""
    plan = plan.materialized()
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


def attend_many(plans: list[Plan], kernel: str = "auto") -> list[tuple[np.ndarray, np.ndarray]]:
    """:func:`attend` on each of ``plans``; the decode ones run in one parallel pass.

    ``"auto"`` picks decode for every plan where the router says so
    (:func:`router.decode_together`), and otherwise chooses for each plan alone.
    """
    choices = [choose(p, kernel) for p in plans]
    if router.decode_together(plans, kernel, [c.kv_bytes for c in choices]):
        choices = [
            c._replace(name="decode", run=decode.attend, first=None, kernel="decode")
            for c in choices
        ]
    at = [i for i, c in enumerate(choices) if c.run is decode.attend]  # NumPy decode, together
    results: list[Any] = [None] * len(plans)
    if at:
        with np.errstate(over="ignore", invalid="ignore"):
            done = decode.attend_many([plans[i] for i in at])
        for i, (out, lse) in zip(at, done, strict=True):
            plan = plans[i]
            assert plan.v is not None  # outputs: the plan carries values
            if scale_fits(plan) and (np.isfinite(out).all() or not plan.v.size):
                results[i] = mods.with_sinks(plan, out, lse)
    for i, (plan, choice) in enumerate(zip(plans, choices, strict=True)):
        if results[i] is None:  # not decode, or a rare retry: run's full path
            results[i] = attend(plan, choice=choice)
    return results


def _rescaled(fn: Any, plan: Plan, out: np.ndarray, lse: np.ndarray) -> tuple[np.ndarray, ...]:
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


def backward(
    plan: Plan, d_out: np.ndarray, out: np.ndarray, lse: np.ndarray, block: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dq, dk, dv)`` of ``plan`` on the kernel the router picks (:func:`router.backward`):
    the native backward where it serves the plan, else the NumPy one
    (:func:`tiled_backward.backward`, ``block`` its tile size).

    ``d_out`` and ``out`` are ``(*batch, L, dv)``, ``lse`` is ``(*batch, L)``; ``out`` and
    ``lse`` in the accumulation dtype (or ``out`` as the bfloat16 forward gave it).
    """
    name = router.backward(plan).name
    if name == "native bfloat16 backward":  # takes dO as given: a bfloat16 model's is rounded
        return native_bf16.backward(plan, d_out, (out, lse))
    d_out = d_out.astype(plan.acc_dtype, copy=False)
    if name == "native backward, stored K/V":  # K/V widened a key block at a time
        return native.backward(plan, d_out, out, lse)
    plan = plan.materialized()
    if name == "native backward":
        return native.backward(plan, d_out, out, lse)
    return tiled_backward.backward(plan, d_out, out, lse, block)
