"""The numeric rules every path shares, each written once.

- :func:`acc_dtype`: the dtype a call is computed and accumulated in, from its input dtype
  (float16 and bfloat16 in float32, wider floats in themselves);
- :func:`default_scale`: the scale when none is given, ``1/sqrt(d)``;
- :func:`ladder`: what a computation does with a result that is not finite (qkv's overflow
  rules, for the attention, its weights and its gradients): the values rescaled by a power of
  two (an accumulator that overflowed), then the plan redone in float64 where its finite
  inputs can overflow the compute dtype, then a refusal naming the scores' size where even
  float64 cannot hold them; a scale that is not a normal number of the compute dtype
  (:func:`scale_in_range`) runs in float64 at once. NaN and infinity in the inputs propagate;
- :data:`STORED_FORMS`: the forms K and V can be stored in (name, NumPy storage dtype, whether
  a float32 scale per row goes with the codes, and the code the native library's
  ``qkv_decode_args.kv_format`` takes). :mod:`qkv.engine.quant` and
  :mod:`qkv.engine.kernels.native_lib` derive their tables from it; the library's C enum
  (``native_src/abi.h``) is checked against it when the library loads.

The checked plan (:func:`qkv.validate.make_plan`) takes its compute dtype and default scale
from here, so every road that runs a plan (the NumPy kernels, the cache, the torch bridge, the
GPU path) follows them; varlen, softmax and the native decode step call them directly. This
module imports nothing of qkv but its errors, so every layer may import it (the ladder reads a
checked plan's fields, :class:`qkv.validate.Plan`, without importing it).

Examples
--------
>>> import numpy as np
>>> acc_dtype(np.float16), acc_dtype(np.float64)
(dtype('float32'), dtype('float64'))
>>> default_scale(4)
0.5
>>> [(f.name, f.code) for f in STORED_FORMS if f.scaled]
[('int8', 3), ('float8_e4m3fn', 4)]
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import DTypeLike

from .errors import InputError

__all__ = [
    "FAST_CODE",
    "FAST_FORMS",
    "PRECISIONS",
    "SAME_CODE",
    "STORED_FORMS",
    "StoredForm",
    "acc_dtype",
    "check_overflow",
    "default_scale",
    "ladder",
    "may_overflow",
    "normal_range",
    "rescaled",
    "scale_fits",
    "scale_in_range",
    "widened",
]

_F32 = np.dtype(np.float32)


def acc_dtype(dtype: DTypeLike) -> np.dtype:
    """The dtype a call on inputs of ``dtype`` is computed and accumulated in.

    Products and sums narrower than float32 lose too much: float16 and bfloat16 (every dtype
    of fewer than 4 bytes) are computed in float32, so products accumulate in at least float32
    and the log-sum-exp is float32 or wider. float32 and float64 are computed in themselves.

    Parameters
    ----------
    dtype : dtype_like
        The inputs' (result) dtype: a NumPy dtype or anything :class:`numpy.dtype` reads
        (ml_dtypes' ``bfloat16`` included).

    Returns
    -------
    numpy.dtype
        float32 for a dtype of fewer than 4 bytes, else ``dtype`` itself.

    Examples
    --------
    >>> import numpy as np
    >>> [str(acc_dtype(t)) for t in (np.float16, np.float32, np.float64)]
    ['float32', 'float32', 'float64']
    """
    dt = np.dtype(dtype)
    return _F32 if dt.itemsize < 4 else dt


def default_scale(d: int) -> float:
    """The scale that multiplies the scores when none is given: ``1/sqrt(d)``.

    Parameters
    ----------
    d : int
        The head size (``q.shape[-1]``), at least 1.

    Returns
    -------
    float
        ``1.0 / math.sqrt(d)`` (which is not always the same float as ``d ** -0.5``).

    Examples
    --------
    >>> default_scale(64)
    0.125
    >>> default_scale(2) == 1 / 2**0.5
    True
    """
    return 1.0 / math.sqrt(d)


def scale_in_range(scale: float, dtype: np.dtype) -> bool:
    """Whether ``scale`` is a normal number of ``dtype`` (neither subnormal nor overflowing)."""
    tiny, top = normal_range(np.dtype(dtype))
    return tiny <= scale <= top


@functools.cache
def normal_range(dtype: np.dtype) -> tuple[float, float]:
    """The smallest normal and the largest finite ``dtype`` number (looked up once per dtype:
    small calls pay for every microsecond)."""
    info = np.finfo(dtype)
    return float(info.tiny), float(info.max)


class StoredForm(NamedTuple):
    """One form K and V can be stored in (see :mod:`qkv.engine.quant` for each one's rule).

    Attributes
    ----------
    name : str
        The form's name, as ``KVCache(dtype=...)`` and ``quantize_kv`` take it.
    storage : numpy.dtype
        The NumPy dtype that holds its codes (bfloat16 as ``uint16`` bits, float8 e4m3fn as
        ``uint8`` bits).
    scaled : bool
        Whether each row of codes comes with a float32 scale (the 8-bit forms).
    code : int
        Its ``kv_format`` code in the native library's C ABI (``native_src/abi.h``).
    """

    name: str
    storage: np.dtype
    scaled: bool
    code: int


#: ``kv_format`` when K and V are in the compute dtype itself (abi.h's ``KV_SAME``).
SAME_CODE = 0

#: The decode step's ``precision`` values: ``"exact"`` (the default: every product in
#: float32 of the stored values) and ``"fast"`` (opt in: the query rows rounded to int8 before
#: their products with int8 keys, :mod:`qkv.engine.kernels.decode_fast`).
PRECISIONS = ("exact", "fast")

#: The stored forms ``precision="fast"`` changes; on the others it runs the exact road.
FAST_FORMS = ("int8",)

#: Added to a form's code on the fast road (abi.h's ``KV_FAST``).
FAST_CODE = 256

#: The stored forms of K and V, in the order they are listed to users. The C enum in
#: ``native_src/abi.h`` mirrors the codes; the loader refuses a library that disagrees.
STORED_FORMS: tuple[StoredForm, ...] = (
    StoredForm("bfloat16", np.dtype(np.uint16), False, 1),
    StoredForm("float16", np.dtype(np.float16), False, 2),
    StoredForm("int8", np.dtype(np.int8), True, 3),
    StoredForm("float8_e4m3fn", np.dtype(np.uint8), True, 4),
)


def ladder(
    plan: Any,
    run: Callable[[Any], Any],
    finite: Callable[[Any], bool],
    *,
    repair: Callable[[Any], Any] | None = None,
    narrow: Callable[[Any], Any] | None = None,
    whole: Callable[[], Any] | None = None,
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
            ok = finite(res)
        else:
            res = run(plan)
            ok = finite(res)  # (once per result: a large one's check is not free)
            if repair is not None and not ok:
                res = repair(res)
                ok = finite(res)
            if not ok and plan.acc_dtype != np.float64:
                if may_overflow(whole() if whole is not None else plan):
                    res = in_float64()
                    ok = finite(res)
    if not ok:
        check_overflow(whole() if whole is not None else plan)
    return res


def check_overflow(plan: Any) -> None:
    """Raise :class:`InputError` when finite inputs give scores beyond float64's range.

    Called when a result is not finite after every retry. NaN and infinity in ``q``, ``k``,
    ``v`` or the bias propagate by policy, so they are left alone; but finite inputs whose
    scores ``q·kᵀ·scale`` overflow even float64 (``q = k = 1e200``) would otherwise give NaN
    without a word. The softmax of such scores has no float64 computation, so it is refused.
    ``plan`` holds no stored K/V (:meth:`qkv.validate.Plan.materialized`).
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


def may_overflow(plan: Any) -> bool:
    """Whether the finite entries of ``q``, ``k`` and the bias can make a score overflow the
    compute dtype (a bound: ``scale · d · max|q| · max|k| + max|bias|``; ``plan`` holds no
    stored K/V)."""
    return _score_bound(plan) > float(np.finfo(plan.acc_dtype).max) / 4


def _magnitude(plan: Any) -> str:
    """``scale · d · max|q| · max|k|`` written as a power of ten (it may exceed float64)."""
    parts = [plan.scale, plan.d, float(np.max(np.abs(plan.q))), float(np.max(np.abs(plan.k)))]
    if min(parts) <= 0:
        return "0"
    return f"1e{math.floor(sum(math.log10(x) for x in parts))}"


def _score_bound(plan: Any) -> float:
    """``scale · d · max|q| · max|k| + max|bias|`` over finite entries, in Python floats
    (``inf`` past float64)."""

    def finite_max(a: np.ndarray) -> float:
        return float(np.max(np.abs(a), where=np.isfinite(a), initial=0.0)) if a.size else 0.0

    bound = plan.scale * plan.d * finite_max(plan.q) * finite_max(plan.k)
    if plan.bias is not None:
        bound += finite_max(plan.bias)
    return bound


def widened(plan: Any) -> Any:
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


def scale_fits(plan: Any) -> bool:
    """Whether the scale is a normal number of the compute dtype (the kernels fold it into
    ``q`` there); a scale like ``1e-50`` or ``1e39`` needs float64 for float32 inputs."""
    return scale_in_range(plan.scale, plan.acc_dtype)


def rescaled(fn: Any, plan: Any, out: np.ndarray, lse: np.ndarray) -> tuple[np.ndarray, ...]:
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
