"""The one number formatter of the learner side: every number a person reads goes through it.

Exceptions, each for a reason: JSON keeps numbers as numbers (:mod:`.document`), and a scale
formula writes ``d`` in full because it is exact (:func:`qkv.explanation.scale`).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["fmt"]


def fmt(x: Any) -> str:
    """A number for people: integers plainly, otherwise at least 4 significant digits.

    Examples
    --------
    >>> import numpy as np
    >>> [fmt(x) for x in (2.0, 0.04742587, 0.9525741, 2.905148, 1e-7, -np.inf)]
    ['2', '0.04743', '0.95257', '2.90515', '1e-07', '-inf']
    """
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    if x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    if 1e-2 <= abs(x) < 1e5:
        return f"{x:.5f}".rstrip("0").rstrip(".")
    return f"{x:.5g}"
