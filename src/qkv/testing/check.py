"""``check_attention``: run a kernel on every feature it supports and write the report card.

For each feature and dtype, hypothesis draws cases (:mod:`qkv.testing.features`) until one
fails or ``examples`` have passed; a failure is shrunk to the smallest failing case hypothesis
finds, and the slip behind it named (:mod:`qkv.testing.diagnose`). The verdict on one case:
the output's shape must be the reference's; rows that may attend no key must hold the declared
value (0 by default); every other entry must be within the tolerance of
:mod:`qkv.testing.tolerance`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis.errors import Unsatisfiable

from ..checks import check_int
from ..errors import InputError
from ..extras import require
from .diagnose import diagnose
from .features import Case, case_strategy
from .kernel import FEATURES, Kernel
from .report import Failure, FeatureResult, Report
from .search import Search
from .tolerance import DTYPES, allowed

__all__ = ["assert_attention", "check_attention"]

# Features that cost more per example run fewer of them.
_FEWER = {"long": 4, "empty": 8, "grad": 8, "varlen": 10}


@dataclass
class _Verdict:
    """One case's verdict: ``ok``, the largest error and what was allowed, or what went wrong."""

    ok: bool
    error: float
    tol: float
    obtained: Any = None
    message: str = ""


def judge(kernel: Kernel, case: Case, dtype: str) -> _Verdict:
    """Run ``kernel`` on ``case`` in ``dtype`` and judge the output."""
    expected = case.expected()
    tol = allowed(case.q, case.k, case.v, case.ref_options, dtype, expected)
    try:
        with np.errstate(all="ignore"):
            got = kernel.call(case.q, case.k, case.v, case.options, dtype)
    except Exception as exc:  # any error of the kernel is a failure to report
        return _Verdict(False, np.inf, tol, None, f"raised {type(exc).__name__}: {exc}")
    if got.shape != expected.shape:
        return _Verdict(
            False, np.inf, tol, got, f"output shape {got.shape}, expected {expected.shape}"
        )
    rows = case.no_key_rows()
    if rows.any() and kernel.masked_rows != "any":
        want = np.isnan(got[rows]) if kernel.masked_rows == "nan" else got[rows] == 0
        if not np.all(want):
            return _Verdict(False, np.inf, tol, got)
    seen = got[~rows] if rows.any() else got
    with np.errstate(invalid="ignore"):
        diff = np.abs(seen - (expected[~rows] if rows.any() else expected))
    if diff.size and not np.all(np.isfinite(diff)):
        return _Verdict(False, np.inf, tol, got)
    err = float(diff.max()) if diff.size else 0.0
    return _Verdict(err <= tol, err, tol, got)


def _inputs(case: Case) -> dict[str, Any]:
    out: dict[str, Any] = {"q": case.q, "k": case.k, "v": case.v}
    out.update(case.options)
    return out


def _check_feature(
    kernel: Kernel, feature: str, dtype: str, examples: int, seed: int
) -> FeatureResult:
    strategy = case_strategy(
        feature,
        alignment=kernel.causal_alignment,
        supports=frozenset(kernel.supports or ()),
        dtype=dtype,
    )
    n = min(examples, _FEWER.get(feature, examples))
    search = Search(n, f"{seed}:{feature}:{dtype}")

    def judged(case: Case) -> tuple[bool, float, float]:
        v = judge(kernel, case, dtype)
        return v.ok, v.error, v.tol

    try:
        case = search.smallest_failure(strategy, judged)
    except Unsatisfiable:
        case = None
    if case is None:
        if not search.count:
            return FeatureResult(feature, dtype, "skipped", note="no case could be drawn")
        return FeatureResult(
            feature, dtype, "pass", min(search.count, n), search.worst, search.allowed
        )
    v = judge(kernel, case, dtype)
    expected = case.expected()
    slip = diagnose(case, v.obtained, v.tol) if v.obtained is not None else None
    failure = Failure(
        shape=case.shape.describe(),
        inputs=_inputs(case),
        expected=expected,
        obtained=v.obtained,
        error=v.error,
        allowed=v.tol,
        message=v.message,
        slip=slip[0] if slip else None,
        why=slip[1] if slip else None,
    )
    return FeatureResult(feature, dtype, "fail", search.first, failure=failure)


def check_attention(
    fn: Callable[..., Any] | Kernel,
    *,
    layout: str = "bhld",
    supports: Iterable[str] | None = None,
    dtypes: Iterable[str] = ("float32",),
    causal_alignment: str = "bottom-right",
    masked_rows: str = "zero",
    arrays: str = "numpy",
    examples: int = 25,
    seed: int = 0,
    features: Iterable[str] | None = None,
    varlen: Callable[..., Any] | None = None,
    device: str = "cpu",
) -> Report:
    """Check an attention kernel against the float64 reference, feature by feature.

    Parameters
    ----------
    fn : callable or Kernel
        Called as :func:`qkv.attention` is: ``fn(q, k, v, **keywords)`` with ``(batch, heads,
        L, d)`` arrays (see ``layout``) and only the keywords of the feature being checked
        (``causal``, ``mask`` — boolean, True = may attend, or float — ``scale``, ``window``,
        ``softcap``, ``sinks``, ``alibi_slopes``). A :class:`~qkv.testing.Kernel` (such as the
        adapters in :mod:`qkv.testing.adapters`) brings its own conventions, and the keywords
        below are then ignored.
    layout : {"bhld", "blhd"}
        The axes of ``q``, ``k``, ``v`` and the output.
    supports : iterable of str, optional
        The features the kernel supports (keys of :data:`~qkv.testing.FEATURES`); the others
        are reported as not supported. Default: read from the signature.
    dtypes : iterable of str
        Input dtypes to check, among ``float64``, ``float32``, ``float16``, ``bfloat16``
        (NumPy bfloat16 needs ml_dtypes). Each is judged by the tolerance rule of
        :mod:`qkv.testing.tolerance`.
    causal_alignment : {"bottom-right", "top-left"}
        What ``causal=True`` means for ``L != S``.
    masked_rows : {"zero", "nan", "any"}
        The kernel's output for a row that may attend no key.
    arrays : {"numpy", "torch", "jax"}
        The array type ``fn`` takes and returns.
    examples : int
        Cases per feature (fewer for long rows); more find rarer bugs.
    seed : int
        Makes the run repeatable.
    features : iterable of str, optional
        Check only these features (default: all).
    varlen : callable, optional
        The kernel's packed variable-length entry (``cu_seqlens``), checked as the ``varlen``
        feature (:mod:`qkv.testing.varlen`).
    device : str
        Where PyTorch tensors are made (``"cpu"``, ``"cuda"``).

    Returns
    -------
    Report
        Truthy when every supported feature passes; ``str(report)`` is the report card.

    Examples
    --------
    >>> import qkv
    >>> from qkv.testing import check_attention
    >>> report = check_attention(qkv.attention, examples=3, features=["plain", "causal"])
    >>> bool(report)
    True
    >>> def slipped(q, k, v):                     # multiplies by √d instead of dividing
    ...     return qkv.attention(q, k, v, scale=q.shape[-1] ** 0.5)
    >>> report = check_attention(slipped, examples=5, features=["plain"])
    >>> bool(report), report.result("plain").failure.slip
    (False, 'multiplied by √d')
    """
    if isinstance(fn, Kernel):
        kernel = fn
    else:
        kernel = Kernel(
            fn,
            varlen=varlen,
            device=device,
            layout=layout,
            arrays=arrays,
            supports=supports,
            causal_alignment=causal_alignment,
            masked_rows=masked_rows,
        )
    check_int(examples, "examples", minimum=1)
    check_int(seed, "seed", minimum=0)
    wanted = list(FEATURES) if features is None else list(features)
    unknown = [f for f in wanted if f not in FEATURES]
    if unknown:
        raise InputError(
            f"features: unknown {', '.join(unknown)}; expected some of {', '.join(FEATURES)}"
        )
    dtypes = list(dtypes)
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        raise InputError(f"dtypes: expected some of {', '.join(DTYPES)}, got {dtypes}")
    if kernel.arrays != "numpy":  # a missing library is a usage error, not a failing kernel
        require(kernel.arrays, f"{kernel.name} ({kernel.arrays} arrays)")
    report = Report(
        kernel.name,
        kernel.layout,
        kernel.arrays,
        kernel.causal_alignment,
        examples,
        seed,
        notes=list(kernel.notes),
    )
    sup = set(kernel.supports or ())
    for dtype in dtypes:
        usable = _dtype_usable(kernel, dtype)
        for feature in wanted:
            if feature not in sup:
                report.results.append(
                    FeatureResult(feature, dtype, "unsupported", note="not supported")
                )
            elif usable:
                report.results.append(FeatureResult(feature, dtype, "skipped", note=usable))
            elif feature == "grad":
                report.results.append(_check_grad(kernel, dtype, examples, seed))
            elif feature == "varlen":
                from .varlen import check_varlen

                n = min(examples, _FEWER["varlen"])
                report.results.append(check_varlen(kernel, dtype, n, seed))
            else:
                report.results.append(_check_feature(kernel, feature, dtype, examples, seed))
    return report


def _dtype_usable(kernel: Kernel, dtype: str) -> str:
    """Why ``dtype`` cannot be checked for this kernel ('' when it can)."""
    try:
        kernel.to_arrays(np.zeros(1), dtype, layout=False)
    except Exception as exc:
        return f"{dtype} not available: {exc}"
    return ""


def _check_grad(kernel: Kernel, dtype: str, examples: int, seed: int) -> FeatureResult:
    from .grad import check_grad

    return check_grad(kernel, dtype, min(examples, _FEWER["grad"]), seed)


def assert_attention(fn: Callable[..., Any] | Kernel, **options: Any) -> Report:
    """:func:`check_attention`, raising ``AssertionError`` with the report card on a failure.

    The one line a project's test needs::

        def test_my_kernel():
            qkv.testing.assert_attention(my_attention, supports={"causal", "mask"})
    """
    start = time.perf_counter()
    report = check_attention(fn, **options)
    if not report:
        raise AssertionError(f"{report}\n(checked in {time.perf_counter() - start:.1f} s)")
    return report
