"""Probes: does a kernel take a feature it did not declare?

A kernel whose features are read from its signature is asked for grouped heads and empty
inputs, which a simple kernel need not handle, and, when it takes ``**kwargs``, for each
keyword feature it does not name (``softcap=``, ``sinks=`` and ``alibi_slopes=`` reach
:func:`qkv.attention` that way). Before such a feature is checked, one small case is run:

- grouped heads or an empty input the kernel raises on is not supported;
- a keyword it raises on, or that leaves its output as it was without the keyword, is not
  supported (a ``**kwargs`` that swallows keywords is not a claim);
- ``return_lse=True`` that gives no ``(out, lse)`` pair is not supported.

Otherwise the feature is checked as a declared one, and any later error or wrong number is a
failure. Each probe case is one where the keyword moves the float64 reference's answer by
tenths, while "no effect" means outputs within one unit in the last place of the values' size.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .features import Case, _case
from .kernel import KEYWORDS, Kernel
from .strategies import Shape, values
from .tolerance import eps

__all__ = ["probe_cases", "refusal"]

_GQA = Shape(1, 4, 2, 3, 4, 4, 4)
_KEYED = Shape(1, 2, 2, 3, 4, 4, 4)


def _options(feature: str) -> dict[str, Any]:
    rng = np.random.default_rng(7)
    mask = np.array([[1, 0, 1, 0], [0, 1, 1, 0], [1, 1, 0, 1]], dtype=bool)[None, None]
    options: dict[str, dict[str, Any]] = {
        "scale": {"scale": 2.0},
        "causal": {"causal": True},
        "mask": {"mask": mask},
        "float_mask": {"mask": values(rng, (1, 1, 3, 4), 2.0)},
        "window": {"window": (1, 0)},
        "softcap": {"softcap": 1.0},
        "sinks": {"sinks": np.array([1.5, -0.5])},
        "alibi": {"alibi_slopes": np.array([2.0, 1.0])},
        "lse": {},
    }
    return options[feature]


def probe_cases(feature: str, alignment: str = "bottom-right") -> list[Case]:
    """The cases a kernel is asked before ``feature`` is checked."""
    if feature == "gqa":
        return [_case("gqa", _GQA, 7, {}, alignment)]
    if feature == "empty":
        return [
            _case("empty", Shape(1, 1, 1, 0, 3, 2, 2), 7, {}, alignment),
            _case("empty", Shape(1, 1, 1, 2, 0, 2, 2), 7, {}, alignment),
        ]
    return [_case(feature, _KEYED, 7, _options(feature), alignment, (2.0, 1.0))]


def refusal(kernel: Kernel, feature: str, dtype: str) -> str:
    """Why ``kernel`` does not support ``feature`` in ``dtype``, as the report card says it;
    '' when it does (then the feature is checked)."""
    for case in probe_cases(feature, kernel.causal_alignment):
        why = _refused(kernel, case, feature, dtype)
        if why:
            return f"not supported: {why}"
    return ""


def _refused(kernel: Kernel, case: Case, feature: str, dtype: str) -> str:
    q, k, v = case.q, case.k, case.v
    kw = KEYWORDS.get(feature)
    given = {**case.options, "return_lse": True} if feature == "lse" else case.options
    try:
        with np.errstate(all="ignore"):
            out = kernel.run(q, k, v, given, dtype)
    except Exception as exc:  # a refusal: what was asked, and the error's type
        s = case.shape
        if feature == "gqa":
            asked = f"{s.Hq} query heads over {s.Hkv} kv heads"
        elif feature == "empty":
            asked = "L = 0" if s.L == 0 else "S = 0"
        else:
            asked = f"{kw}= (through **kwargs)"
        return f"it raised {type(exc).__name__} on {asked}"
    if feature == "lse":
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            return "return_lse=True (through **kwargs) gave no (out, lse) pair"
        return ""
    if kw is None:
        return ""
    try:
        with np.errstate(all="ignore"):
            with_kw = kernel.from_arrays(out)
            without = kernel.call(q, k, v, {}, dtype)
    except Exception:  # the check of the feature shows what goes wrong
        return ""
    # an ignored keyword leaves the same numbers; the float64 reference moves by tenths
    tol = eps(dtype) * max(float(np.max(np.abs(v))), 1.0)
    with np.errstate(invalid="ignore"):
        same = with_kw.shape == without.shape and bool(np.all(np.abs(with_kw - without) <= tol))
    return f"{kw}= (through **kwargs) had no effect" if same else ""
