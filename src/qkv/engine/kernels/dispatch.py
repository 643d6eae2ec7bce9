"""Pick the kernel for a checked plan by its shape, or run the one the caller forces.

- ``"dense"``: the whole score matrix at once; fastest while ``L · S`` is small, and for a
  few queries against a K/V small enough to sit in the caches.
- ``"decode"``: few queries (``L <= DECODE_MAX_L``) against a large K/V (at least
  ``DECODE_MIN_BYTES``); memory-bound, streams K and V once, splits the keys over the cores
  when batch × heads are too few.
- ``"tiled"``: online-softmax prefill over tiles; ``O(tile · S)`` extra memory. Under
  ``"auto"``, plain problems (no mask, bias or score variant) run on the packed walk
  (:mod:`qkv.engine.kernels.packed`, the kernel of ``attention_varlen``: grouped heads stacked
  against their kv head, measured 4-20% faster); forcing ``"tiled"`` runs the general one.
  Where the optional native library is built, ``"auto"`` runs float32/float64 problems
  without score variants on its fused kernel instead (:mod:`qkv.engine.kernels.native`).

The thresholds were measured on a 2-core machine (see ``bench/``); they only pick the faster
path, never change a result.

``"auto"`` (the default) chooses among them; the others force one, for tests and benchmarks.
Every kernel returns ``(out, lse)`` in the plan's compute dtype and equals the reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from functools import cache
from typing import Any, NamedTuple

import numpy as np

from ...errors import InputError, InputTypeError
from ...validate import Plan
from . import decode, dense, mods, native, native_bf16, native_decode, packed, tiled
from .threads import team_preferred

__all__ = [
    "DECODE_MAX_L",
    "DECODE_MIN_BYTES",
    "DENSE_MAX_SCORES",
    "KERNELS",
    "attend",
    "attend_many",
    "check_kernel",
    "Choice",
    "check_overflow",
    "choose",
    "kv_bytes",
    "may_overflow",
    "scale_fits",
    "scale_in_range",
    "weights",
    "widened",
]

KERNELS = ("auto", "dense", "tiled", "decode")
DENSE_MAX_SCORES = 1 << 14  # L · S per head below which materialising the scores is fastest
DECODE_MAX_L = 8  # queries per head up to which the scores are small enough to keep whole
DECODE_MIN_BYTES = 16 << 20  # K/V bytes from which streaming them (decode) beats BLAS (dense)
# ... and where decode is compiled C++ (native_decode: measured on 2 cores, float32, grouped
# heads, it already beat BLAS at 0.5 MiB, 0.050 against 0.087 ms, and 3.6x at 2 MiB), or
# inside threads.compiled_team (between PyTorch's operations), where the compiled Numba decode
# starts its threads in C and BLAS finds the K/V out of cache: measured in a Llama-style
# model, 1 MiB of K/V per layer (prompt 1024) already ran faster streamed.
TEAM_DECODE_MIN_BYTES = 1 << 20


def check_kernel(kernel: Any) -> str:
    """Validate a ``kernel=`` argument (one of :data:`KERNELS`)."""
    if not isinstance(kernel, str):
        raise InputTypeError(f"kernel: expected one of {KERNELS}, got {type(kernel).__name__}")
    if kernel not in KERNELS:
        raise InputError(f"kernel: expected one of {KERNELS}, got {kernel!r}")
    return kernel


class Choice(NamedTuple):
    """The kernel a plan runs on, and the sizes it was chosen by (:func:`choose`).

    Attributes
    ----------
    name : str
        ``"dense"``, ``"tiled"`` or ``"decode"`` (the family, as ``kernel=`` names it).
    run : callable
        Computes ``(out, lse)`` of the plan: the family's NumPy kernel, or under ``"auto"``
        the packed walk or a native kernel where one serves the plan.
    kv_bytes : int
        The bytes of K and V in the compute dtype (:func:`kv_bytes`).
    scores : int
        ``L · S``, the scores per head.
    plain : bool
        A dense problem whose rows all see every key, with no variant:
        :func:`dense.attend_plain` serves it first.
    """

    name: str
    run: Callable[[Plan], tuple[np.ndarray, np.ndarray]]
    kv_bytes: int
    scores: int
    plain: bool = False


_new = tuple.__new__  # builds a Choice without the named tuple's keyword handling (small calls)

_FORCED: dict[str, Callable[[Plan], tuple[np.ndarray, np.ndarray]]] = {
    "dense": dense.attend,
    "tiled": tiled.attend,
    "decode": decode.attend,
}


def kv_bytes(plan: Plan) -> int:
    """The bytes of ``plan``'s K and V in its compute dtype (the decode thresholds' measure)."""
    d = plan.q.shape[-1]
    dv = 0 if plan.v is None else plan.v.shape[-1]
    return plan.k.size * (d + dv) // max(d, 1) * plan.acc_dtype.itemsize


def choose(plan: Plan, kernel: str = "auto") -> Choice:
    """The kernel ``plan`` runs on: the one ``"auto"`` picks by shape, or the one ``kernel``
    forces (the family's NumPy kernel).

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
    size = kv_bytes(plan)
    L, S = plan.q.shape[-2], plan.k.shape[-2]
    if kernel != "auto":
        name = check_kernel(kernel)
        return _new(Choice, (name, _FORCED[name], size, L * S, False))
    if L <= DECODE_MAX_L:
        if size >= TEAM_DECODE_MIN_BYTES or size >= DECODE_MIN_BYTES:  # decode may win
            if native_decode.supports(plan):  # the C++ decode step, when built
                least = TEAM_DECODE_MIN_BYTES
                fn = native_decode.attend
            else:
                compiled = decode.use_jit(plan) or (plan.mask is not None and L == 1)
                least = TEAM_DECODE_MIN_BYTES if compiled and team_preferred() else DECODE_MIN_BYTES
                fn = decode.attend
            if size >= least:
                return _new(Choice, ("decode", fn, size, L * S, False))
        return _new(Choice, ("dense", dense.attend, size, L * S, _plain(plan)))
    if L * S <= DENSE_MAX_SCORES:
        return _new(Choice, ("dense", dense.attend, size, L * S, _plain(plan)))
    if native.supports(plan):  # the fused C++ kernel, when built (kernels/native.py)
        return _new(Choice, ("tiled", native.attend, size, L * S, False))
    if packed.supports(plan):  # plain problems: the packed walk
        return _new(Choice, ("tiled", packed.attend_plan, size, L * S, False))
    return _new(Choice, ("tiled", tiled.attend, size, L * S, False))


def attend(
    plan: Plan, kernel: str = "auto", choice: Choice | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Run ``choice`` (default: what :func:`choose` decides for ``kernel``) on ``plan``:
    ``(out, lse)``, repaired or explained when not finite.

    Sinks are added once, to the kernel's finished result (:func:`mods.with_sinks`).
    """
    if plan.stored is not None:  # float16/bfloat16 K/V as given: read in place where served
        decoding = plan.L <= DECODE_MAX_L and kernel in ("auto", "decode")
        found = None
        if decoding and native_decode.supports(plan):
            found = native_decode.attend_stored(plan)
        elif _prefill(plan, kernel) and native_bf16.supports(plan):  # bfloat16 tile products
            found = native_bf16.attend(plan)
        elif _prefill(plan, kernel) and scale_fits(plan) and native.supports_stored(plan):
            found = native.attend_stored(plan)  # float32 products, K/V widened per work item
        if found is not None:  # else (not finite) the float32 kernels apply their rules
            return mods.with_sinks(plan, *found)
        plan, choice = plan.materialized(), None  # every other kernel reads widened K/V
    if choice is None:
        choice = choose(plan, kernel)
    if choice.plain:
        with np.errstate(over="ignore", invalid="ignore"):
            out, lse = dense.attend_plain(plan)
        if np.isfinite(out).all():
            return out, lse
    fn = choice.run
    # An intermediate may overflow on the way to a finite answer (the retries below repair it),
    # and NaN or inf inputs propagate by policy: neither is worth a NumPy warning.
    with np.errstate(over="ignore", invalid="ignore"):
        if not scale_fits(plan):
            out, lse = _in_float64(fn, plan)
        else:
            out, lse = fn(plan)
            assert plan.v is not None  # outputs: the plan carries values
            if not np.isfinite(out).all() and plan.v.size:
                out, lse = _rescaled(fn, plan, out, lse)
            if not np.isfinite(out).all() and plan.acc_dtype != np.float64 and may_overflow(plan):
                out, lse = _in_float64(fn, plan)
    if not np.isfinite(out).all():
        check_overflow(plan)
    return mods.with_sinks(plan, out, lse)


def _prefill(plan: Plan, kernel: str) -> bool:
    """Whether :func:`choose` sends ``plan`` to a prefill (``"tiled"``) kernel."""
    if kernel != "auto":
        return kernel == "tiled"
    return plan.L > DECODE_MAX_L and plan.L * plan.S > DENSE_MAX_SCORES


def _plain(plan: Plan) -> bool:
    """Whether every row of a problem :func:`choose` sends to the dense kernel sees every key,
    with no variant: :func:`dense.attend_plain` serves it (a single causal query sees all
    keys too). Written out in one function, as small calls pay for every attribute lookup."""
    if (
        plan.mask is not None
        or plan.bias is not None
        or plan.window is not None
        or plan.sinks is not None
        or plan.softcap is not None
        or plan.alibi is not None
        or plan.score_mod is not None
        or plan.mask_mod is not None
    ):
        return False
    q = plan.q
    if plan.k.shape[-2] == 0 or q.shape[-1] == 0 or (plan.causal and q.shape[-2] != 1):
        return False
    tiny, top = _normal_range(plan.acc_dtype)  # scale_fits, written out
    return tiny <= plan.scale <= top


def weights(plan: Plan) -> np.ndarray:
    """The attention weights ``(*batch, L, S)`` in the compute dtype (the dense kernel's).

    As in :func:`attend`, finite inputs whose scores overflow the compute dtype are redone in
    float64, without NumPy warnings on the way.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        w, _ = dense.softmax_rows(dense.logits(plan if scale_fits(plan) else widened(plan)))
        if not np.isfinite(w).all() and plan.acc_dtype != np.float64 and may_overflow(plan):
            w, _ = dense.softmax_rows(dense.logits(widened(plan)))
            w = w.astype(plan.acc_dtype)
    if not np.isfinite(w).all():
        check_overflow(plan)
    return w


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


def _in_float64(fn: Any, plan: Plan) -> tuple[np.ndarray, np.ndarray]:
    """Rerun in float64 when the scores may have overflowed the compute dtype on the way.

    ``q · kᵀ · scale`` can exceed float32's range (a large ``scale``, large entries) where
    the weights and the output — a weighted mean of the values — are perfectly finite. Only
    runs when the output is not finite and the finite inputs are that large.
    """
    out, lse = fn(widened(plan))
    return out.astype(plan.acc_dtype), lse.astype(plan.acc_dtype)


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


def scale_in_range(scale: float, dtype: np.dtype) -> bool:
    """Whether ``scale`` is a normal number of ``dtype`` (neither subnormal nor overflowing)."""
    tiny, top = _normal_range(np.dtype(dtype))
    return tiny <= scale <= top


@cache
def _normal_range(dtype: np.dtype) -> tuple[float, float]:
    info = np.finfo(dtype)  # looked up once per dtype: small calls pay for every microsecond
    return float(info.tiny), float(info.max)


def attend_many(plans: list[Plan], kernel: str = "auto") -> list[tuple[np.ndarray, np.ndarray]]:
    """:func:`attend` on each of ``plans``; the decode ones run in one parallel pass.

    ``"auto"`` picks decode for every plan when all have few queries and their K/V together
    are large enough (:data:`DECODE_MIN_BYTES`) — a batch of short caches is one large
    memory-bound job, not many small ones — and otherwise chooses for each plan alone.
    """
    choices = [choose(p, kernel) for p in plans]
    if kernel == "auto" and all(p.L <= DECODE_MAX_L for p in plans):
        if sum(c.kv_bytes for c in choices) >= DECODE_MIN_BYTES:
            choices = [c._replace(name="decode", run=decode.attend, plain=False) for c in choices]
    at = [i for i, c in enumerate(choices) if c.name == "decode"]
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
