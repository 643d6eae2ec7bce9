"""Name the slip behind a failing output, as the practice mode does for learners.

Each slip is computed by the float64 reference on the failing case with the slip made
(:mod:`qkv.explanation.practice` names the scale slips and the wrong softmax axis the same
way); the obtained output is compared with each slip's output under the same tolerance. A slip
is named when the obtained numbers match it and it differs from the right answer.

Slips: the scale multiplied by √d or forgotten; top-left instead of bottom-right causal (and
the reverse for a kernel declared top-left); the mask's polarity inverted; the softmax taken
over the queries instead of the keys; grouped heads paired in the wrong order (query head ``h``
reading kv head ``h % Hkv``, a tiling, instead of ``h // group``, a repeat); NaN instead of 0
for a row with no key, or a finite fill (the values' mean) there; a keyword ignored.

Three more are named from what the kernel gave rather than from its numbers: an error raised
on a feature (:func:`diagnose_error` names the feature and what was asked), an output in
another dtype than the inputs' (:func:`wrong_dtype`), and, for a log-sum-exp
(``return_lse=True``, :func:`diagnose_lse`), one off by a constant, without the row's max
added back, in base 2, over the unscaled scores, or kept in a 16-bit float.

Examples
--------
>>> import numpy as np
>>> from qkv import reference
>>> from qkv.testing.features import _case
>>> from qkv.testing.strategies import Shape
>>> case = _case("plain", Shape(1, 1, 1, 2, 3, 4, 4), 0, {}, "bottom-right")
>>> got = reference.attention(case.q, case.k, case.v, scale=2.0)  # ×√4 instead of ÷√4
>>> diagnose(case, got, 1e-6)[0]
'multiplied by √d'
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import numpy as np

from .. import reference
from ..explanation.practice import SLIPS
from ..validate import make_plan
from .features import Case, top_left
from .kernel import FEATURES

__all__ = ["EXPLAIN", "diagnose", "diagnose_error", "diagnose_lse", "wrong_dtype"]

_FORGOT, _TIMES_SQRT_D = SLIPS[0], SLIPS[1]
_WRONG_AXIS = SLIPS[4]

#: Each slip's name and what to change.
EXPLAIN: dict[str, str] = {
    _TIMES_SQRT_D: "the scores are multiplied by √d; standard attention divides by √d "
    "(scale = 1/√d)",
    _FORGOT: "the scores are not scaled; multiply q·kᵀ by 1/√d",
    "explicit scale ignored": "the scale= given was ignored and 1/√d used",
    "top-left causal": "causal is aligned top-left (query i sees keys j <= i); bottom-right "
    "puts query i at position S - L + i (decoding with a cache needs it)",
    "bottom-right causal": "causal is aligned bottom-right, but the kernel was declared "
    "top-left (causal_alignment=)",
    "mask polarity inverted": "the boolean mask is read as True = masked out; True means may "
    "attend",
    "float mask subtracted": "the float mask is subtracted; it is added to the scores",
    _WRONG_AXIS: "the softmax normalises over the queries (axis -2); it normalises over the "
    "keys of each query (axis -1)",
    "grouped heads interleaved": "query head h reads kv head h % Hkv (kv heads tiled); it "
    "reads kv head h // (Hq / Hkv) (each kv head repeated for its group of query heads)",
    "NaN for a row with no key": "a row that may attend no key gives NaN; the convention is "
    "0 (declare masked_rows='nan' if NaN is yours)",
    "mean of values for a row with no key": "a row that may attend no key averages the "
    "values: a finite fill (-1e9, the dtype's minimum) used instead of -inf; the convention "
    "is 0",
    "causal ignored": "causal=True had no effect",
    "mask ignored": "the mask had no effect",
    "window ignored": "the window had no effect",
    "softcap ignored": "softcap had no effect",
    "sinks ignored": "the sinks had no effect",
    "alibi ignored": "the ALiBi slopes had no effect",
    "log-sum-exp off by a constant": "every row's log-sum-exp is off by the same amount; it is "
    "log Σ exp of the scaled, biased, masked scores (natural log), nothing added",
    "log-sum-exp without the max": "the row's max, subtracted before exp, is not added back: "
    "lse = m + log Σ exp(s - m)",
    "log-sum-exp in base 2": "the log-sum-exp is in base 2 (as kernels working with exp2 keep "
    "it); the convention is the natural log: multiply by ln 2",
    "log-sum-exp of unscaled scores": "the log-sum-exp is taken over q·kᵀ before the scale; it "
    "is over the scaled scores the softmax sees",
    "log-sum-exp in low precision": "the log-sum-exp is kept in a 16-bit float; keep it in "
    "float32 or wider (it is what a later merge or backward pass adds to)",
}

#: What a feature's case asks that a simple kernel may not do, and how to do it, for a kernel
#: that raised on it.
_RAISED = {
    "gqa": (
        "raised on grouped heads",
        "repeat each kv head over its group of query heads (np.repeat(k, Hq // Hkv, axis=-3)), "
        "or declare the features it supports (supports=) without gqa",
    ),
    "empty": (
        "raised on an empty input",
        "a softmax over no keys has no max: give the empty output for L = 0 and zeros for "
        "S = 0 before reducing, or declare the features it supports (supports=) without empty",
    ),
}


def _asked(case: Case) -> str:
    """What ``case`` asks of the kernel, in words."""
    s = case.shape
    if case.feature == "gqa":
        what = (
            f"{s.Hq} query heads over {s.Hkv} kv heads (query head h reads kv head "
            f"h // {s.Hq // max(s.Hkv, 1)})"
        )
    elif case.feature == "empty":
        what = "L = 0 (no queries)" if s.L == 0 else "S = 0 (no keys: every row gives 0)"
    else:
        what = f"{FEATURES[case.feature]} ({s.describe()})"
    keys = [f"{k}=" for k in case.options]
    return what + (f", with {', '.join(keys)}" if keys else "")


def diagnose_error(case: Case, exc: BaseException) -> tuple[str, str]:
    """The slip behind an error the kernel raised on ``case``: the feature and what was asked."""
    how = "leave it out of the features it declares (supports=) if it does not support it"
    name, how = _RAISED.get(case.feature, (f"raised on {case.feature}", how))
    text = f"asked for {_asked(case)}, it raised {type(exc).__name__}"
    return name, text if case.feature == "plain" else f"{text}; {how}"


def wrong_dtype(dtype: str, got: str) -> tuple[str, str]:
    """The slip of an output in ``got`` for ``dtype`` inputs."""
    work = "float64" if dtype == "float64" else "float32"
    return "wrong output dtype", (
        f"{dtype} inputs gave a {got} output; the output keeps the inputs' dtype (compute in "
        f"{work} or wider, then cast the output back to {dtype}; a NumPy float64 scalar such "
        f"as np.sqrt(d) turns float32 arrays into float64)"
    )


def _ref(case: Case, **change: Any) -> np.ndarray:
    opts = {**case.ref_options, **change}
    opts = {k: v for k, v in opts.items() if v is not None}
    return np.asarray(reference.attention(case.q, case.k, case.v, **opts))


def _wrong_axis(case: Case) -> np.ndarray:
    plan = make_plan(case.q, case.k, case.v, dtype=np.float64, **case.ref_options)
    z = reference._logits(plan)
    w = reference.softmax(z, axis=-2)
    assert plan.v is not None
    return np.asarray(w @ np.repeat(plan.v, plan.group, axis=-3))


def _interleaved(case: Case) -> np.ndarray:
    hq, hkv = case.shape.Hq, case.shape.Hkv
    pick = np.arange(hq) % hkv
    k, v = np.take(case.k, pick, axis=1), np.take(case.v, pick, axis=1)
    return np.asarray(reference.attention(case.q, k, v, **case.ref_options))


def _fill_rows(case: Case, expected: np.ndarray, fill: str) -> np.ndarray:
    out = expected.copy()
    rows = case.no_key_rows()
    if fill == "nan":
        out[rows] = np.nan
    else:
        vv = np.repeat(case.v, case.shape.Hq // max(case.shape.Hkv, 1), axis=1)
        mean = np.broadcast_to(vv.mean(axis=-2, keepdims=True), out.shape)
        out[rows] = mean[rows]
    return out


def _candidates(case: Case, expected: np.ndarray) -> Iterator[tuple[str, Callable[[], np.ndarray]]]:
    o, s = case.options, case.shape
    d = s.d
    # first: the other rows right and only the rows with no key wrong is the strongest evidence
    if case.no_key_rows().any():
        yield "NaN for a row with no key", lambda: _fill_rows(case, expected, "nan")
        yield "mean of values for a row with no key", lambda: _fill_rows(case, expected, "mean")
    if "scale" in o:
        yield "explicit scale ignored", lambda: _ref(case, scale=1 / np.sqrt(d))
    else:
        yield _TIMES_SQRT_D, lambda: _ref(case, scale=float(np.sqrt(d)))
        yield _FORGOT, lambda: _ref(case, scale=1.0)
    if o.get("causal") and s.L != s.S:
        if "causal" in case.ref_options:  # declared bottom-right
            yield "top-left causal", lambda: _ref(case, causal=False, mask=top_left(s.L, s.S))
        else:
            yield "bottom-right causal", lambda: _ref(case, causal=True, mask=None)
    m = o.get("mask")
    if m is not None and m.dtype == bool:
        yield "mask polarity inverted", lambda: _ref(case, mask=~m)
    elif m is not None:
        yield "float mask subtracted", lambda: _ref(case, mask=-m)
    yield _WRONG_AXIS, lambda: _wrong_axis(case)
    if s.Hkv > 1 and s.Hq != s.Hkv:
        yield "grouped heads interleaved", lambda: _interleaved(case)
    for name, key in (
        ("causal", "causal"),
        ("mask", "mask"),
        ("window", "window"),
        ("softcap", "softcap"),
        ("sinks", "sinks"),
        ("alibi", "alibi_slopes"),
    ):
        if key in o:
            yield f"{name} ignored", partial(_ref, case, **{key: None})


def _close(a: np.ndarray, b: np.ndarray, tol: float, lenient: bool = False) -> bool:
    """Entries within ``tol``, NaN where NaN; ``lenient``: a NaN row of ``a`` also matches a
    zero row of ``b`` (a second slip, NaN for rows with no key, on top of the one tried)."""
    if a.shape != b.shape:
        return False
    if lenient and a.ndim:
        rows = np.isnan(a).all(axis=-1) & (b == 0).all(axis=-1)
        a = np.where(rows[..., None], 0.0, a)
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    if not np.array_equal(nan_a, nan_b):
        return False
    with np.errstate(invalid="ignore"):
        return bool(np.all(np.abs(a[~nan_a] - b[~nan_b]) <= tol))


def diagnose(case: Case, obtained: np.ndarray, tol: float) -> tuple[str, str] | None:
    """The slip whose output ``obtained`` matches (name and explanation), or ``None``."""
    expected = case.expected()
    for name, make in _candidates(case, expected):
        try:
            slip = make()
        except Exception:  # a slip that cannot be computed on this case is not it
            continue
        if not _close(slip, expected, tol) and _close(obtained, slip, tol, lenient=True):
            return name, EXPLAIN[name]
    return None


def _lse(case: Case, **change: Any) -> np.ndarray:
    opts = {k: v for k, v in {**case.ref_options, **change}.items() if v is not None}
    return np.asarray(reference.attention(case.q, case.k, case.v, return_lse=True, **opts)[1])


def _row_max(case: Case) -> np.ndarray:
    plan = make_plan(case.q, case.k, case.v, dtype=np.float64, **case.ref_options)
    m = np.max(reference._logits(plan), axis=-1, initial=-np.inf)
    if plan.sinks is not None:
        m = np.maximum(m, plan.sinks[..., None])
    return np.broadcast_to(m, (case.shape.B, case.shape.Hq, case.shape.L))


def diagnose_lse(case: Case, obtained: np.ndarray, tol: float) -> tuple[str, str] | None:
    """The slip whose log-sum-exp ``obtained`` matches (name and explanation), or ``None``."""
    expected = _lse(case)
    if obtained.shape != expected.shape:
        return None
    candidates: list[tuple[str, Callable[[], np.ndarray]]] = [
        ("log-sum-exp without the max", lambda: expected - _row_max(case)),
        ("log-sum-exp in base 2", lambda: expected / np.log(2.0)),
        ("log-sum-exp of unscaled scores", lambda: _lse(case, scale=1.0)),
    ]
    for name, make in candidates:
        try:
            slip = make()
        except Exception:  # a slip that cannot be computed on this case is not it
            continue
        if not _close(slip, expected, tol) and _close(obtained, slip, tol):
            return name, EXPLAIN[name]
    # last, as one row is always "off by a constant"
    finite = np.isfinite(expected)
    with np.errstate(invalid="ignore"):
        shift = (obtained - expected)[finite]
    d = float(np.median(shift)) if shift.size else 0.0
    if abs(d) > tol and np.all(np.abs(shift - d) <= tol):
        name = "log-sum-exp off by a constant"
        return name, f"{EXPLAIN[name]} (here {d:+.3g})"
    return None
