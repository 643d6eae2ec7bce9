"""The three readings of "scale by √d" for the same inputs: divide by √d, multiply, no scale.

The seed's third card writes the scale as a multiplication by √d; standard attention divides.
:func:`scale_readings` explains one trace's inputs (same ``d``, masks and labels) under each
reading with :func:`qkv.explain`, and says which reading the trace itself used. The explore
page (:func:`qkv.render.explore.explore_page`) only formats what this returns.

Examples
--------
>>> import qkv
>>> r = scale_readings(qkv.explain([2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4]], d=4))
>>> r.initial, {k: t.scaled.tolist() for k, t in r.traces.items()}
('divide', {'divide': [[1.0, 4.0]], 'multiply': [[4.0, 16.0]], 'none': [[2.0, 8.0]]})
>>> scale_readings(qkv.explain([2, 1], [[1, 0], [3, 2]], scale=1)).initial
'none'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .trace import Trace, explain

__all__ = ["READINGS", "Readings", "scale_readings"]

#: The three readings of "scale by √d": (key, button text, scale expression in d).
READINGS = (
    ("divide", "divide by √d (standard)", "1/sqrt(d)"),
    ("multiply", "multiply by √d (a common slip)", "sqrt(d)"),
    ("none", "no scale", "1"),
)


@dataclass(frozen=True)
class Readings:
    """One trace's inputs under each of :data:`READINGS`.

    Attributes
    ----------
    traces : dict of str to Trace
        By reading key, in the order of :data:`READINGS`.
    initial : str
        The reading whose scale is the given trace's own (``"divide"`` when none is).
    """

    traces: dict[str, Trace]
    initial: str

    @property
    def shown(self) -> Trace:
        """The trace of the initial reading."""
        return self.traces[self.initial]


def scale_readings(t: Trace) -> Readings:
    """The trace's inputs explained under each of :data:`READINGS` (same ``d``, masks, labels).

    ``d`` is the trace's own ``d`` when its scale used one, else ``len(q)``.
    """
    d = t.scale.d if t.scale.d is not None else t.d
    mask = t.mask if t.mask is not None else t.bias
    q = t.q[0] if t.squeeze else t.q
    traces = {}
    for key, _, expr in READINGS:
        kw: dict[str, Any] = {"scale": expr} if expr != "1/sqrt(d)" else {}
        if "d" in expr:
            kw["d"] = d
        traces[key] = explain(
            q,
            t.k,
            t.v,
            causal=t.causal,
            window=t.window,
            mask=mask,
            key_labels=t.key_labels,
            query_labels=t.query_labels,
            **kw,
        )
    initial = next((k for k, r in traces.items() if r.scale.value == t.scale.value), "divide")
    return Readings(traces, initial)
