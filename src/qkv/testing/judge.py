"""The verdict on one case: run the kernel, and say whether its answer is right.

An output passes when its shape is the reference's, its dtype the inputs', the rows that may
attend no key hold the declared value (0 by default) and every other entry is within the
tolerance of :mod:`qkv.testing.tolerance`. A log-sum-exp (``return_lse=True``, the ``lse``
feature) passes when it has the shape ``(batch, heads, L)`` in every layout, is kept in
float32 or wider, and is within :func:`~qkv.testing.tolerance.allowed_lse` of the reference's.
An error the kernel raises or a log-sum-exp in a 16-bit float is a failure named on the spot
(:mod:`qkv.testing.diagnose`); an output in another dtype, once its numbers pass
(:func:`with_dtype`); wrong numbers are diagnosed once the search has shrunk them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import reference
from .diagnose import EXPLAIN, diagnose_error, wrong_dtype
from .features import Case
from .kernel import Kernel, dtype_name
from .tolerance import allowed, allowed_lse

__all__ = ["Verdict", "expected_lse", "judge", "judge_lse", "with_dtype"]


@dataclass
class Verdict:
    """One case's verdict: ``ok``, the largest error and what was allowed, what the kernel
    gave, what went wrong (``message``) and, when known without the numbers, the slip."""

    ok: bool
    error: float
    tol: float
    obtained: Any = None
    message: str = ""
    slip: tuple[str, str] | None = None
    out_dtype: str | None = None


def judge(kernel: Kernel, case: Case, dtype: str) -> Verdict:
    """Run ``kernel`` on ``case`` in ``dtype`` and judge the output."""
    expected = case.expected()
    tol = allowed(case.q, case.k, case.v, case.ref_options, dtype, expected)
    try:
        with np.errstate(all="ignore"):
            raw = kernel.run(case.q, case.k, case.v, case.options, dtype)
            got = kernel.from_arrays(raw)
    except Exception as exc:  # any error of the kernel is a failure to report
        msg = f"raised {type(exc).__name__}: {exc}"
        return Verdict(False, np.inf, tol, None, msg, diagnose_error(case, exc))
    if got.shape != expected.shape:
        return Verdict(
            False, np.inf, tol, got, f"output shape {got.shape}, expected {expected.shape}"
        )
    rows = case.no_key_rows()
    if rows.any() and kernel.masked_rows != "any":
        want = np.isnan(got[rows]) if kernel.masked_rows == "nan" else got[rows] == 0
        if not np.all(want):
            return Verdict(False, np.inf, tol, got)
    seen = got[~rows] if rows.any() else got
    with np.errstate(invalid="ignore"):
        diff = np.abs(seen - (expected[~rows] if rows.any() else expected))
    if diff.size and not np.all(np.isfinite(diff)):
        return Verdict(False, np.inf, tol, got)
    err = float(diff.max()) if diff.size else 0.0
    return Verdict(err <= tol, err, tol, got, out_dtype=dtype_name(raw))


def with_dtype(v: Verdict, dtype: str) -> Verdict:
    """``v``, failed with the slip named when its numbers pass but its output is not in the
    inputs' ``dtype``."""
    if v.ok and v.out_dtype is not None and v.out_dtype != dtype:
        msg = (
            f"output dtype {v.out_dtype} for {dtype} inputs (the numbers are right: error "
            f"{v.error:.3g})"
        )
        return Verdict(False, v.error, v.tol, v.obtained, msg, wrong_dtype(dtype, v.out_dtype))
    return v


def expected_lse(case: Case) -> np.ndarray:
    """The float64 reference's log-sum-exp on ``case``, shape ``(B, Hq, L)``."""
    out = reference.attention(case.q, case.k, case.v, return_lse=True, **case.ref_options)
    return np.asarray(out[1])


def judge_lse(kernel: Kernel, case: Case, dtype: str) -> Verdict:
    """Run ``kernel`` on ``case`` with ``return_lse=True`` and judge its log-sum-exp."""
    expected = expected_lse(case)
    tol = allowed_lse(case.q, case.k, case.v, case.ref_options, dtype, expected)
    try:
        with np.errstate(all="ignore"):
            raw = kernel.run(case.q, case.k, case.v, {**case.options, "return_lse": True}, dtype)
    except Exception as exc:
        msg = f"raised {type(exc).__name__}: {exc}"
        return Verdict(False, np.inf, tol, None, msg, diagnose_error(case, exc))
    if not isinstance(raw, (tuple, list)) or len(raw) != 2:
        what = f"a {type(raw).__name__}" + (
            f" of {len(raw)}" if isinstance(raw, (tuple, list)) else ""
        )
        return Verdict(False, np.inf, tol, None, f"return_lse=True gave {what}, not (out, lse)")
    got = kernel.from_arrays(raw[1])
    if got.shape != expected.shape:
        msg = f"log-sum-exp shape {got.shape}, expected {expected.shape} (batch, heads, L)"
        return Verdict(False, np.inf, tol, got, msg)
    with np.errstate(invalid="ignore"):
        diff = np.where(got == expected, 0.0, np.abs(got - expected))
    if diff.size and not np.all(np.isfinite(diff)):
        return Verdict(False, np.inf, tol, got)
    err = float(diff.max()) if diff.size else 0.0
    kept = dtype_name(raw[1])
    if kept in ("float16", "bfloat16"):
        name = "log-sum-exp in low precision"
        msg = f"log-sum-exp dtype {kept} (largest error {err:.3g}, allowed {tol:.3g})"
        return Verdict(False, err, tol, got, msg, (name, EXPLAIN[name]))
    return Verdict(err <= tol, err, tol, got)
