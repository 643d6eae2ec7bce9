"""Hypothesis strategies for attention inputs, public for your own property tests.

Every strategy shrinks toward the smallest problem (one batch, one head, few queries and keys,
small ``d``), so a failing property reports a case small enough to read. Values lie on a grid
of sixteenths in ``[-4, 4]``: exactly representable in every float dtype from bfloat16 up, so
rounding the inputs to the dtype under test changes nothing and printed numbers stay short.

- :func:`shapes`: a :class:`Shape` (batch, query heads, kv heads, ``L``, ``S``, ``d``, ``dv``);
- :func:`inputs`: ``(q, k, v)`` float64 arrays in the ``(batch, heads, L, d)`` layout;
- :func:`bool_masks` and :func:`float_masks`: masks broadcastable to ``(batch, heads, L, S)``;
- :func:`windows`: ``(left, right)`` sliding windows, ``None`` for an unbounded side;
- :func:`variants`: ``softcap``, ``sinks`` and ``alibi_slopes`` keywords of :func:`qkv.attention`;
- :func:`cu_seqlens`: cumulative offsets of a packed batch (:func:`qkv.attention_varlen`);
- :func:`caches`: the ``(prompt, steps)`` lengths of a KV cache filled then decoded.

Examples
--------
>>> from hypothesis import given
>>> import qkv
>>> from qkv import reference
>>> from qkv.testing import strategies as qs
>>> @given(qs.inputs(qs.shapes(grouped=True)))
... def test_matches(qkv_arrays):
...     q, k, v = qkv_arrays
...     assert np.allclose(qkv.attention(q, k, v), reference.attention(q, k, v))
>>> test_matches()
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from hypothesis import strategies as st

__all__ = [
    "Shape",
    "bool_masks",
    "caches",
    "cu_seqlens",
    "float_masks",
    "inputs",
    "shapes",
    "values",
    "variants",
    "windows",
]


class Shape(NamedTuple):
    """The sizes of one attention problem (``Hq`` query heads over ``Hkv`` kv heads)."""

    B: int
    Hq: int
    Hkv: int
    L: int
    S: int
    d: int
    dv: int

    def describe(self) -> str:
        """``B=1 Hq=2 Hkv=1 L=3 S=4 d=2 dv=2``."""
        return " ".join(f"{n}={getattr(self, n)}" for n in self._fields)


@st.composite
def _shapes(
    draw: Any,
    batch: tuple[int, int],
    heads: tuple[int, int],
    L: tuple[int, int],
    S: tuple[int, int],
    d: tuple[int, int],
    grouped: bool,
    dv_differs: bool,
) -> Shape:
    # the ranges' defaults are those of the public shapes(), the one place they are written
    B = draw(st.integers(*batch))
    if grouped:
        Hkv = draw(st.integers(2, max(2, heads[1])))
        Hq = Hkv * draw(st.integers(2, 3))
    else:
        Hq = Hkv = draw(st.integers(*heads))
    n_q, n_k, dim = draw(st.integers(*L)), draw(st.integers(*S)), draw(st.integers(*d))
    dv = dim
    if dv_differs:
        dv = draw(st.integers(1, max(2, d[1])).filter(lambda x: x != dim))
    return Shape(B, Hq, Hkv, n_q, n_k, dim, dv)


def values(rng: np.random.Generator, shape: tuple[int, ...], spread: float = 1.0) -> np.ndarray:
    """Normal-ish numbers on a grid of sixteenths in ``[-4, 4]`` (times ``spread``), float64."""
    x = np.clip(np.round(rng.standard_normal(shape) * 16) / 16, -4, 4)
    return x * spread


@st.composite
def _inputs(draw: Any, shape: Any = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(q, k, v)`` float64 arrays of a drawn :class:`Shape` (default :func:`shapes`)."""
    s = draw(shape if shape is not None else shapes())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = values(rng, (s.B, s.Hq, s.L, s.d))
    k = values(rng, (s.B, s.Hkv, s.S, s.d))
    return q, k, values(rng, (s.B, s.Hkv, s.S, s.dv))


@st.composite
def _bool_masks(
    draw: Any, B: int, H: int, L: int, S: int, *, every_row_sees: bool = True
) -> np.ndarray:
    b = draw(st.sampled_from([1, B]))
    h = draw(st.sampled_from([1, H]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    m = rng.random((b, h, L, S)) < draw(st.sampled_from([0.5, 0.25, 0.75]))
    if every_row_sees and S > 0:
        rows = ~m.any(axis=-1)
        m[rows, rng.integers(0, S, size=int(rows.sum()))] = True
    return m


@st.composite
def _float_masks(draw: Any, B: int, H: int, L: int, S: int) -> np.ndarray:
    """A float mask (added to the scaled scores), shape ``(B or 1, H or 1, L, S)``."""
    b = draw(st.sampled_from([1, B]))
    h = draw(st.sampled_from([1, H]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return values(rng, (b, h, L, S), spread=2.0)


def windows(max_side: int = 4) -> Any:
    """``(left, right)`` windows: each side ``None`` (unbounded) or ``0 .. max_side``."""
    side = st.one_of(st.integers(0, max_side), st.none())
    return st.tuples(side, side).filter(lambda w: w != (None, None))


@st.composite
def _variants(
    draw: Any, heads: int, *, which: tuple[str, ...] = ("softcap", "sinks", "alibi")
) -> dict:
    names = draw(st.lists(st.sampled_from(which), min_size=1, max_size=len(which), unique=True))
    out: dict[str, Any] = {}
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if "softcap" in names:
        out["softcap"] = float(draw(st.sampled_from([1.0, 2.0, 5.0, 20.0])))
    if "sinks" in names:
        out["sinks"] = values(rng, (heads,))
    if "alibi" in names:
        out["alibi_slopes"] = 2.0 ** -np.arange(1, heads + 1, dtype=np.float64)
    return out


@st.composite
def _cu_seqlens(
    draw: Any, *, batch: tuple[int, int] = (1, 4), length: tuple[int, int] = (0, 6)
) -> np.ndarray:
    """Cumulative offsets ``[0, n0, n0 + n1, ...]`` (int64) of a packed batch; lengths may be 0."""
    lengths = draw(st.lists(st.integers(*length), min_size=batch[0], max_size=batch[1]))
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)


def caches(prompt: tuple[int, int] = (0, 8), steps: tuple[int, int] = (1, 4)) -> Any:
    """``(prompt, steps)``: a KV cache filled with ``prompt`` keys, then ``steps`` single-query
    decoding steps each appending one key."""
    return st.tuples(st.integers(*prompt), st.integers(*steps))


# The public strategies are plain functions (documentable, introspectable) over the composites.


def shapes(
    *,
    batch: tuple[int, int] = (1, 2),
    heads: tuple[int, int] = (1, 2),
    L: tuple[int, int] = (1, 6),
    S: tuple[int, int] = (1, 6),
    d: tuple[int, int] = (1, 8),
    grouped: bool = False,
    dv_differs: bool = False,
) -> Any:
    """A strategy of :class:`Shape` with sizes in the given inclusive ranges.

    ``grouped=True`` gives grouped-query attention with at least two kv heads, each serving
    at least two query heads (so that pairing heads in the wrong order shows). ``dv_differs``
    draws a value width different from ``d``; otherwise ``dv == d``.
    """
    return _shapes(batch, heads, L, S, d, grouped, dv_differs)


def inputs(shape: Any = None) -> Any:
    """A strategy of ``(q, k, v)`` float64 arrays of a drawn :class:`Shape` (default
    :func:`shapes`), in the ``(batch, heads, L, d)`` layout."""
    return _inputs(shape)


def bool_masks(B: int, H: int, L: int, S: int, *, every_row_sees: bool = True) -> Any:
    """A strategy of boolean masks (``True`` = may attend), shape ``(B or 1, H or 1, L, S)``.

    With ``every_row_sees`` each query row keeps at least one key; otherwise whole rows may be
    masked out.
    """
    return _bool_masks(B, H, L, S, every_row_sees=every_row_sees)


def float_masks(B: int, H: int, L: int, S: int) -> Any:
    """A strategy of float masks (added to the scaled scores), shape ``(B or 1, H or 1, L, S)``."""
    return _float_masks(B, H, L, S)


def variants(heads: int, *, which: tuple[str, ...] = ("softcap", "sinks", "alibi")) -> Any:
    """A strategy of keywords of :func:`qkv.attention`'s variants, at least one of ``which``.

    ``softcap`` is one of 1, 2, 5, 20; ``sinks`` and ``alibi_slopes`` have shape ``(heads,)``.
    """
    return _variants(heads, which=which)


def cu_seqlens(*, batch: tuple[int, int] = (1, 4), length: tuple[int, int] = (0, 6)) -> Any:
    """A strategy of cumulative offsets ``[0, n0, n0 + n1, ...]`` (int64) of a packed batch of
    ``batch`` sequences whose lengths (in the range ``length``) may be 0."""
    return _cu_seqlens(batch=batch, length=length)
