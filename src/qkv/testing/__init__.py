"""qkv.testing: a conformance kit that tells you whether an attention kernel is right.

:func:`check_attention` runs a kernel on every feature it supports (plain attention, causal in
its declared alignment, boolean and float masks, windows, grouped heads, ``dv != d``, empty and
single rows, long rows, extreme magnitudes, rows with no key, soft-capping, sinks, ALiBi, the
log-sum-exp, gradients) against the float64 reference :mod:`qkv.reference`, under the
tolerance rule of :mod:`qkv.testing.tolerance` (relative to the error a same-precision
reference makes, plus a floor). Its :class:`Report` is truthy when everything supported
passes; ``str(report)`` is the report card, with the smallest failing input hypothesis found
for each failure, the expected and obtained numbers, and the slip they point to
(:mod:`qkv.testing.diagnose`).

The kit needs hypothesis, which the ``testing`` extra brings (``python -m pip install
".[testing]"`` in qkv's source folder); ``import qkv`` never imports it.

Examples
--------
>>> import qkv
>>> from qkv.testing import check_attention
>>> report = check_attention(qkv.attention, examples=3, features=["plain", "gqa"])
>>> print(str(report).splitlines()[-1])
PASS: 2 passed, 0 failed, 0 not checked
"""

from __future__ import annotations

try:
    import hypothesis  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised with hypothesis absent
    from ..extras import MissingExtraError

    raise MissingExtraError(
        'qkv.testing needs hypothesis: pip install "qkv[testing]" (or ".[testing]" in qkv\'s '
        "source folder, or pip install hypothesis)"
    ) from exc

from .check import assert_attention, check_attention
from .kernel import FEATURES, Kernel
from .report import Failure, FeatureResult, Report
from .tolerance import allowed

__all__ = [
    "FEATURES",
    "Failure",
    "FeatureResult",
    "Kernel",
    "Report",
    "allowed",
    "assert_attention",
    "check_attention",
]
