"""The report card: one line per feature and dtype, then each failure's smallest input."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .tolerance import FACTOR, FLOOR_ULPS

__all__ = ["Failure", "FeatureResult", "Report"]

_MARK = {"pass": "PASS", "fail": "FAIL", "unsupported": " -- ", "skipped": "SKIP"}


@dataclass
class Failure:
    """The smallest failing input found for a feature, with the numbers."""

    shape: str
    inputs: dict[str, Any]
    expected: Any
    obtained: Any
    error: float
    allowed: float
    message: str = ""
    slip: str | None = None
    why: str | None = None

    def lines(self) -> list[str]:
        """The failure as lines of the report card."""
        out = [f"smallest failing input: {self.shape}"]
        for name, value in self.inputs.items():
            out.append(f"  {name} = {_fmt(value)}")
        if self.message:
            out.append(f"  {self.message}")
        else:
            out.append(f"  expected = {_fmt(self.expected)}")
            out.append(f"  obtained = {_fmt(self.obtained)}")
            out.append(f"  largest error {self.error:.3g}, allowed {self.allowed:.3g}")
        if self.slip:
            out.append(f"  diagnosis: {self.slip} — {self.why}")
        elif self.obtained is not None:
            out.append("  diagnosis: no common slip matches these numbers")
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data (NaN as ``None``)."""
        return {
            "shape": self.shape,
            "inputs": {k: _plain(v) for k, v in self.inputs.items()},
            "expected": _plain(self.expected),
            "obtained": _plain(self.obtained),
            "error": _finite(self.error),
            "allowed": _finite(self.allowed),
            "message": self.message,
            "slip": self.slip,
            "why": self.why,
        }


@dataclass
class FeatureResult:
    """The verdict on one feature in one dtype."""

    feature: str
    dtype: str
    status: str  # pass | fail | unsupported | skipped
    examples: int = 0
    worst: float = 0.0
    allowed: float = 0.0
    note: str = ""
    failure: Failure | None = None

    def line(self) -> str:
        """The feature's line of the report card."""
        mark = _MARK[self.status]
        what = f"{self.feature} [{self.dtype}]"
        if self.status == "pass":
            err, tol = f"{self.worst:.2g}", f"{self.allowed:.2g}"
            rest = f"{self.examples} examples, largest error {err} (allowed {tol})"
        elif self.status == "fail":
            slip = self.failure.slip if self.failure else None
            rest = f"at example {self.examples}" + (f": {slip}" if slip else "")
        else:
            rest = self.note
        return f"  {mark}  {what:<26} {rest}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data (NaN as ``None``)."""
        return {
            "feature": self.feature,
            "dtype": self.dtype,
            "status": self.status,
            "examples": self.examples,
            "largest_error": _finite(self.worst),
            "allowed": _finite(self.allowed),
            "note": self.note,
            "failure": self.failure.to_dict() if self.failure else None,
        }


@dataclass
class Report:
    """The result of :func:`qkv.testing.check_attention`.

    Truthy when no supported feature failed (and at least one passed); ``str()`` is the report
    card; :meth:`to_dict` the same as JSON-ready data.
    """

    kernel: str
    layout: str
    arrays: str
    causal_alignment: str
    examples: int
    seed: int
    results: list[FeatureResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return not self.failures and any(r.status == "pass" for r in self.results)

    @property
    def failures(self) -> list[FeatureResult]:
        """The results that failed."""
        return [r for r in self.results if r.status == "fail"]

    def result(self, feature: str, dtype: str | None = None) -> FeatureResult:
        """The result for ``feature`` (in ``dtype``, default the first checked)."""
        for r in self.results:
            if r.feature == feature and (dtype is None or r.dtype == dtype):
                return r
        raise KeyError(feature)

    def __str__(self) -> str:
        n_pass = sum(r.status == "pass" for r in self.results)
        verdict = "PASS" if self else "FAIL"
        head = [
            f"qkv.testing report card: {self.kernel}",
            f"layout {self.layout}, {self.arrays} arrays, causal {self.causal_alignment}, "
            f"up to {self.examples} examples per feature, seed {self.seed}",
            f"tolerance: |out - ref64| <= {FACTOR:g} x (error of a same-precision reference) "
            f"+ {FLOOR_ULPS:g} eps(dtype) max(|v|, 1)",
        ]
        head += [f"note: {n}" for n in self.notes]
        body = [r.line() for r in self.results]
        tail: list[str] = []
        for r in self.failures:
            assert r.failure is not None
            tail += ["", f"FAIL {r.feature} [{r.dtype}]"] + r.failure.lines()
        summary = f"{verdict}: {n_pass} passed, {len(self.failures)} failed, " + (
            f"{sum(r.status in ('unsupported', 'skipped') for r in self.results)} not checked"
        )
        return "\n".join(head + [""] + body + tail + ["", summary])

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (what ``qkv conform --json`` prints)."""
        return {
            "kernel": self.kernel,
            "passed": bool(self),
            "layout": self.layout,
            "arrays": self.arrays,
            "causal_alignment": self.causal_alignment,
            "examples": self.examples,
            "seed": self.seed,
            "tolerance": {"factor": FACTOR, "floor_ulps": FLOOR_ULPS},
            "notes": self.notes,
            "results": [r.to_dict() for r in self.results],
        }


def _finite(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_plain(v) for v in x]
    if isinstance(x, np.ndarray):
        if x.dtype.kind != "f":
            return x.tolist()
        return (
            [None if np.isnan(e) else e for e in x.ravel().tolist()]
            if x.ndim == 0
            else [_plain(row) for row in x]
            if x.ndim > 1
            else [None if np.isnan(e) else float(e) for e in x.tolist()]
        )
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, tuple):
        return list(x)
    return x


def _fmt(x: Any) -> str:
    if isinstance(x, dict):
        return "\n      ".join(f"{k} = {_fmt(v)}" for k, v in x.items())
    if isinstance(x, list) and all(isinstance(a, np.ndarray) for a in x):
        return "\n      ".join(_fmt(a) for a in x) if x else "(none)"
    if isinstance(x, np.ndarray):
        if x.dtype == bool:
            x = x.astype(int)
        if x.ndim == 4 and x.shape[:2] != (1, 1) and x.size <= 96:
            # one (L, S) or (L, d) matrix per batch and head, each labelled
            blocks = [f"[batch {b}, head {h}] {_fmt(x[b, h])}" for b in range(x.shape[0])
                      for h in range(x.shape[1])]  # fmt: skip
            return "\n      ".join(blocks)
        arr = x[0, 0] if x.ndim == 4 and x.shape[:2] == (1, 1) else x  # one batch, one head
        text = np.array2string(
            arr, precision=5, separator=", ", threshold=48, edgeitems=2, max_line_width=96
        )
        return text.replace("\n\n", "\n").replace("\n", "\n      ")
    return repr(x)
