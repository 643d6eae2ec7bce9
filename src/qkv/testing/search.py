"""The search behind every row of the report card: hypothesis looks for the smallest case a
kernel fails, and the search keeps what it saw on the way (how many cases were judged, which
one failed first, the largest error that still passed).

Every feature, the gradients and the packed sequences search the same way: the same settings
(no example database, no deadline, generate then shrink, no health checks) and a random
generator seeded from a text key, so a report is the same on every run.

Examples
--------
>>> from hypothesis import strategies as st
>>> search = Search(examples=20, key="doc")
>>> search.smallest_failure(st.integers(0, 9), lambda n: (n < 5, float(n), 4.0))
5
>>> search.count > 0, search.first > 0, search.worst <= 4.0
(True, True, True)
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, Phase, find, settings
from hypothesis.errors import NoSuchExample

__all__ = ["Search"]


@dataclass
class Search:
    """One search for a failing case, and what it saw.

    Attributes
    ----------
    examples : int
        The most cases hypothesis draws.
    key : str
        Seeds the search (the seed, the feature and the dtype), so that it is reproducible.
    count : int
        Cases judged so far (shrinking included).
    first : int
        The number of the first case that failed; 0 while none has.
    worst, allowed : float
        The largest error among the cases that passed, and the tolerance it passed within.
    """

    examples: int
    key: str
    count: int = 0
    first: int = 0
    worst: float = 0.0
    allowed: float = 0.0

    def smallest_failure(
        self, strategy: Any, judge: Callable[[Any], tuple[bool, float, float]]
    ) -> Any | None:
        """The smallest drawn value that ``judge`` fails (``None`` when every case passed);
        ``judge(drawn)`` gives ``(passed, error, tolerance)``."""

        def fails(drawn: Any) -> bool:
            self.count += 1
            ok, error, tol = judge(drawn)
            if ok and error >= self.worst:
                self.worst, self.allowed = error, tol
            if not ok and not self.first:
                self.first = self.count
            return not ok

        conf = settings(
            max_examples=self.examples,
            database=None,
            deadline=None,
            derandomize=False,
            phases=[Phase.generate, Phase.shrink],
            suppress_health_check=list(HealthCheck),
        )
        try:
            return find(strategy, fails, settings=conf, random=random.Random(self.key))
        except NoSuchExample:
            return None
