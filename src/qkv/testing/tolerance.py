"""The tolerance rule: a kernel is judged against the error a same-precision reference makes.

For inputs in a dtype (their values exactly representable in it), the expected output is the
float64 reference (:func:`qkv.reference.attention`) on those inputs. A *same-precision
reference* computes the same formula the way a careful kernel in that dtype would: scores and
softmax in float32 (float64 for float64 inputs), the weights rounded to the dtype before the
product with ``v`` when the dtype is narrower than float32 (as FlashAttention rounds ``P``), the
output rounded to the dtype. Its error ``e_ref = max |same − ref64|`` is what that precision
costs on this very input. A kernel passes when::

    max |out − ref64|  <=  FACTOR · e_ref  +  FLOOR_ULPS · eps(dtype) · max(|v|max, 1)

entry by entry over the rows that see at least one key (rows that see none must be exactly
the declared value, 0 by default). ``FACTOR`` is 4 and ``FLOOR_ULPS`` 8: a bfloat16 kernel is
judged as a bfloat16 kernel, a float32 kernel as a float32 one, and a float64 kernel to within
a few units in the last place.

A log-sum-exp (``return_lse=True``) is judged the same way, against the same-precision
reference's log-sum-exp, with the floor in units of the precision a log-sum-exp is kept in
(float32, float64 for float64 inputs) times the size of the scores: ``allowed_lse``.

Examples
--------
>>> import numpy as np
>>> q = k = v = np.eye(2)[None, None]
>>> allowed(q, k, v, {}, "float32") < 1e-5
True
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import reference
from ..validate import make_plan

__all__ = [
    "DTYPES",
    "FACTOR",
    "FLOOR_ULPS",
    "allowed",
    "allowed_lse",
    "eps",
    "round_to",
    "same_precision",
    "same_precision_lse",
]

FACTOR = 4.0
FLOOR_ULPS = 8.0

#: The dtypes the kit can judge, by name.
DTYPES = ("float64", "float32", "float16", "bfloat16")

_EPS = {"float64": 2.0**-52, "float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}


def eps(dtype: str) -> float:
    """Machine epsilon of ``dtype`` (by name)."""
    return _EPS[dtype]


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` (to nearest even) and back to float64."""
    x = np.asarray(x, dtype=np.float64)
    if dtype == "float64":
        return x
    if dtype in ("float32", "float16"):
        return x.astype(dtype).astype(np.float64)
    # bfloat16: the top 16 bits of float32, rounded to nearest even
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + np.uint64(0x7FFF) + ((bits >> np.uint64(16)) & np.uint64(1))) & np.uint64(
        0xFFFF0000
    )
    out = rounded.astype(np.uint32).view(np.float32).astype(np.float64)
    return np.where(np.isnan(x), np.nan, out)


def _work(dtype: str) -> Any:
    """The precision a careful ``dtype`` kernel scores and keeps its softmax in."""
    return np.float64 if dtype == "float64" else np.float32


def _scores(q: np.ndarray, k: np.ndarray, v: np.ndarray, options: dict, dtype: str) -> Any:
    """The plan, and the scaled, biased, masked scores in the working precision with the
    sink's logit (or ``-inf``) as one more column."""
    work = _work(dtype)
    plan = make_plan(q, k, v, dtype=work, **options)
    z = reference._logits(plan).astype(work)
    sink = np.full(z.shape[:-1] + (1,), -np.inf, dtype=work)
    if plan.sinks is not None:
        sink[...] = plan.sinks[..., None, None]
    return plan, np.concatenate([z, sink], axis=-1)


def same_precision(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, options: dict, dtype: str
) -> np.ndarray:
    """The reference formula computed as a careful ``dtype`` kernel would (module docstring)."""
    work = _work(dtype)
    plan, z = _scores(q, k, v, options, dtype)
    m = np.max(z, axis=-1, keepdims=True)
    m = np.where(m == -np.inf, 0, m)
    e = np.exp(z - m)
    total = e.sum(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.where(total == 0, 0, e / total)[..., :-1].astype(work)
    if dtype in ("float16", "bfloat16"):
        p = round_to(p, dtype).astype(work)
    assert plan.v is not None  # made with values
    vv = np.repeat(plan.v, plan.group, axis=-3) if plan.group > 1 else plan.v
    return round_to(p @ vv.astype(work), dtype)


def same_precision_lse(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, options: dict, dtype: str
) -> np.ndarray:
    """Each row's log-sum-exp as a careful ``dtype`` kernel keeps it (float32, or float64
    for float64 inputs), ``-inf`` for a row with no key."""
    _, z = _scores(q, k, v, options, dtype)
    m = np.max(z, axis=-1, keepdims=True)
    m = np.where(m == -np.inf, 0, m)
    with np.errstate(divide="ignore"):
        return np.asarray(m[..., 0] + np.log(np.exp(z - m).sum(axis=-1)), dtype=np.float64)


def allowed(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, options: dict, dtype: str, expected: Any = None
) -> float:
    """The largest error allowed on this input in ``dtype`` (module docstring).

    ``expected`` is the float64 reference, computed here when not given.
    """
    ref = reference.attention(q, k, v, **options) if expected is None else expected
    with np.errstate(all="ignore"):
        diff = np.abs(same_precision(q, k, v, options, dtype) - ref)
    diff = diff[np.isfinite(diff)]
    e_ref = float(diff.max()) if diff.size else 0.0
    vmax = float(np.max(np.abs(v))) if np.size(v) else 0.0
    return FACTOR * e_ref + FLOOR_ULPS * eps(dtype) * max(vmax, 1.0)


def allowed_lse(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, options: dict, dtype: str, expected: Any = None
) -> float:
    """The largest error allowed on this input's log-sum-exp in ``dtype``: ``FACTOR`` times
    the same-precision reference's error plus ``FLOOR_ULPS`` units of the working precision
    (float32, float64 for float64) times ``max(|scores|max, |lse|max, 1)``.

    ``expected`` is the float64 reference's log-sum-exp, computed here when not given.
    """
    if expected is None:
        expected = reference.attention(q, k, v, return_lse=True, **options)[1]
    ref = np.asarray(expected, dtype=np.float64)
    with np.errstate(all="ignore"):
        diff = np.abs(same_precision_lse(q, k, v, options, dtype) - ref)
        z = np.abs(_scores(q, k, v, options, dtype)[1])
    diff, z, ref = diff[np.isfinite(diff)], z[np.isfinite(z)], ref[np.isfinite(ref)]
    e_ref = float(diff.max()) if diff.size else 0.0
    size = max(float(z.max()) if z.size else 0.0, float(np.abs(ref).max()) if ref.size else 0.0)
    work = "float64" if dtype == "float64" else "float32"
    return FACTOR * e_ref + FLOOR_ULPS * eps(work) * max(size, 1.0)
