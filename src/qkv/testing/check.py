"""``check_attention``: run a kernel on every feature it supports and write the report card.

For each feature and dtype, hypothesis draws cases (:mod:`qkv.testing.features`) until one
fails or ``examples`` have passed; a failure is shrunk to the smallest failing case hypothesis
finds, and the slip behind it named (:mod:`qkv.testing.diagnose`). The verdict on one case is
:mod:`qkv.testing.judge`'s. The features checked are those the kernel supports; the ones it
was only probed for (:mod:`qkv.testing.probe`) are first tried, and reported as not supported
when it refuses or ignores them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from hypothesis.errors import Unsatisfiable

from ..checks import check_int
from ..errors import InputError
from ..extras import require
from .diagnose import diagnose, diagnose_lse
from .features import Case, case_strategy, unaskable
from .judge import Verdict, expected_lse, judge, judge_lse, with_dtype
from .kernel import FEATURES, Kernel
from .probe import refusal
from .report import Failure, FeatureResult, Report
from .search import Search
from .tolerance import DTYPES

__all__ = ["assert_attention", "check_attention"]

# Features that cost more per example run fewer of them.
_FEWER = {"long": 4, "empty": 8, "grad": 8, "varlen": 10}


def _inputs(case: Case) -> dict[str, Any]:
    out: dict[str, Any] = {"q": case.q, "k": case.k, "v": case.v}
    out.update(case.options)
    if case.feature == "lse":
        out["return_lse"] = True
    return out


def _smallest_failure(search: Search, strategy: Any, judged: Any) -> Case | None:
    try:
        found: Case | None = search.smallest_failure(strategy, judged)
    except Unsatisfiable:
        return None
    return found


def _check_feature(
    kernel: Kernel, feature: str, dtype: str, examples: int, seed: int, supports: frozenset[str]
) -> FeatureResult:
    strategy = case_strategy(
        feature, alignment=kernel.causal_alignment, supports=supports, dtype=dtype
    )
    n = min(examples, _FEWER.get(feature, examples))
    lse = feature == "lse"
    judge_case = judge_lse if lse else judge
    dtype_slipped = False  # numbers right in another dtype than the inputs'

    def judged(case: Case) -> tuple[bool, float, float]:
        nonlocal dtype_slipped
        v = judge_case(kernel, case, dtype)
        dtype_slipped = dtype_slipped or (v.ok and not with_dtype(v, dtype).ok)
        return v.ok, v.error, v.tol

    search = Search(n, f"{seed}:{feature}:{dtype}")
    case = _smallest_failure(search, strategy, judged)
    if case is None and dtype_slipped:
        # the numbers pass: the dtype is the slip, shown on its own smallest case (searched
        # second, so that a wrong number is never hidden behind it)
        def judge_case(kernel: Kernel, case: Case, dtype: str) -> Verdict:
            return with_dtype(judge(kernel, case, dtype), dtype)

        search = Search(n, f"{seed}:{feature}:{dtype}:dtype")
        case = _smallest_failure(search, strategy, judged)
    if case is None:
        if not search.count:
            return FeatureResult(feature, dtype, "skipped", note="no case could be drawn")
        return FeatureResult(
            feature, dtype, "pass", min(search.count, n), search.worst, search.allowed
        )
    v = judge_case(kernel, case, dtype)
    expected = expected_lse(case) if lse else case.expected()
    slip = v.slip
    if slip is None and v.obtained is not None and not v.message:
        slip = (diagnose_lse if lse else diagnose)(case, v.obtained, v.tol)
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
        ``softcap``, ``sinks``, ``alibi_slopes``, ``return_lse`` for the ``lse`` feature, whose
        answer is ``(out, lse)`` with ``lse`` of shape ``(batch, heads, L)``). A
        :class:`~qkv.testing.Kernel` (such as the
        adapters in :mod:`qkv.testing.adapters`) brings its own conventions, and the keywords
        below are then ignored.
    layout : {"bhld", "blhd"}
        The axes of ``q``, ``k``, ``v`` and the output.
    supports : iterable of str, optional
        The features the kernel supports (keys of :data:`~qkv.testing.FEATURES`): exactly
        these are checked, the others reported as not supported. Default: read from the
        signature, the kernel then asked only the keywords it names, and probed
        (:mod:`qkv.testing.probe`) for grouped heads, empty inputs and, with ``**kwargs``,
        the keyword features it does not name.
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
        refused = {} if usable else _refusals(kernel, dtype)
        taken = frozenset(sup - set(refused))
        for feature in wanted:
            why = unaskable(feature, taken, kernel.causal_alignment)
            if feature not in sup:
                report.results.append(
                    FeatureResult(feature, dtype, "unsupported", note="not supported")
                )
            elif usable:
                report.results.append(FeatureResult(feature, dtype, "skipped", note=usable))
            elif feature in refused:
                report.results.append(
                    FeatureResult(feature, dtype, "unsupported", note=refused[feature])
                )
            elif why:
                report.results.append(FeatureResult(feature, dtype, "skipped", note=why))
            elif feature == "grad":
                report.results.append(_check_grad(kernel, dtype, examples, seed))
            elif feature == "varlen":
                from .varlen import check_varlen

                n = min(examples, _FEWER["varlen"])
                report.results.append(check_varlen(kernel, dtype, n, seed))
            else:
                result = _check_feature(kernel, feature, dtype, examples, seed, taken)
                report.results.append(result)
    return report


def _refusals(kernel: Kernel, dtype: str) -> dict[str, str]:
    """The probed features ``kernel`` refuses in ``dtype``, each with the card's note."""
    out = {}
    for feature in sorted(kernel.probe or ()):
        why = refusal(kernel, feature, dtype)
        if why:
            out[feature] = why
    return out


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
