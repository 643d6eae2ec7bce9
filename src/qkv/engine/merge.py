"""Combine attention over disjoint key sets: ``merge([(out_a, lse_a), (out_b, lse_b), …])``.

Attention over keys ``A ∪ B`` is a weighted mean of the attentions over ``A`` and over ``B``,
each weighted by its share of the softmax denominator, ``exp(lse_part - lse_union)``::

    lse = log Σ_i exp(lse_i)
    out = Σ_i exp(lse_i - lse) · out_i

This is the primitive behind split-K decoding, chunked prefill and attention spread over
several processes. A part whose lse is ``-inf`` (it saw no key) has weight 0 and contributes
nothing, even if its output holds garbage; if every part is ``-inf`` the result is output 0
and lse ``-inf``, as for any row that may attend no key.

Sinks (a per-head logit in every row's denominator, with no value) belong to the whole row,
not to any key set: compute the parts *without* sinks and pass ``sinks=`` here, and the sink
is added once, after the parts are combined. (Parts that each included the sink would count
it once per part.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import InputError, InputTypeError
from ..keywords import near_keywords
from ..validate import as_array
from .kernels.blocks import merge_arrays
from .kernels.mods import add_sink

__all__ = ["check", "merge", "merge_arrays", "merge_vjp"]


@near_keywords()
def merge(parts: Sequence[tuple[Any, Any]], *, sinks: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """Attention over the union of disjoint key sets, from the attention over each set.

    Parameters
    ----------
    parts : sequence of (out, lse)
        ``out`` of shape ``(..., dv)`` and ``lse`` of shape ``(...)``, as returned by
        ``qkv.attention(..., return_lse=True)`` over disjoint sets of keys for the same queries.
        Every part has the same shapes. Parts are computed without sinks.
    sinks : array_like, optional
        One logit per query head, shape ``(heads,)``, as in :func:`qkv.attention`: for lse of
        shape ``(..., heads, L)`` it is applied as ``sinks[..., None]``. Added once, to the
        merged result.

    Returns
    -------
    out : ndarray, shape ``(..., dv)``
        In the outputs' common dtype (computed in at least float32).
    lse : ndarray, shape ``(...)``
        Log-sum-exp over the union (``-inf`` for rows that no part saw any key for), in the
        lse's common dtype.

    Raises
    ------
    InputError
        No parts, a part that is not a pair, or shapes that disagree.

    Examples
    --------
    Split the keys in two, attend to each half, and merge: the same as attending to all.

    >>> import numpy as np
    >>> import qkv
    >>> q, k, v = np.array([2.0, 1.0]), np.array([[1.0, 0], [3, 2]]), np.array([[1.0, 2], [3, 4]])
    >>> a = qkv.attention(q, k[:1], v[:1], scale=0.5, return_lse=True)
    >>> b = qkv.attention(q, k[1:], v[1:], scale=0.5, return_lse=True)
    >>> out, lse = qkv.merge([a, b])
    >>> out.round(6).tolist(), round(float(lse), 6)
    ([2.905148, 3.905148], 4.048587)
    >>> qkv.merge([(np.zeros(2), -np.inf), b])[0].round(6).tolist()  # an empty part adds nothing
    [3.0, 4.0]
    >>> s = qkv.merge([a, b], sinks=0.5)   # == qkv.attention(q, k, v, scale=0.5, sinks=0.5)
    >>> bool(np.allclose(s[0], qkv.attention(q, k, v, scale=0.5, sinks=0.5)))
    True
    """
    arrays, s = check(parts, sinks)
    out, lse = merge_arrays(arrays)
    return (out, lse) if s is None else add_sink(out, lse, s)


def check(
    parts: Sequence[tuple[Any, Any]], sinks: Any = None
) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray | None]:
    """The checked arguments of :func:`merge`: the parts as arrays and the sinks broadcast to
    the lse's shape (``None`` without sinks)."""
    if isinstance(parts, (str, bytes)) or not isinstance(parts, Sequence):
        raise InputTypeError(
            f"parts: expected a sequence of (out, lse) pairs, got {type(parts).__name__}"
        )
    if len(parts) == 0:
        raise InputError("parts: expected at least one (out, lse) pair, got none")
    arrays: list[tuple[np.ndarray, np.ndarray]] = []
    for i, part in enumerate(parts):
        if not isinstance(part, (tuple, list)) or len(part) != 2:
            raise InputError(f"parts[{i}]: expected an (out, lse) pair, got {type(part).__name__}")
        o, lse = as_array(part[0], f"parts[{i}] out"), as_array(part[1], f"parts[{i}] lse")
        if o.ndim < 1 or o.shape[:-1] != lse.shape:
            raise InputError(
                f"parts[{i}]: out must have shape (..., dv) and lse the shape (...): got out "
                f"{o.shape} and lse {lse.shape}"
            )
        if arrays and o.shape != arrays[0][0].shape:
            raise InputError(
                f"parts[{i}]: out has shape {o.shape} but parts[0] out has shape "
                f"{arrays[0][0].shape}"
            )
        arrays.append((o, lse))
    if sinks is None:
        return arrays, None
    lse_shape = arrays[0][1].shape
    s = as_array(sinks, "sinks")
    try:
        s = s.reshape(()) if s.size == 1 else np.broadcast_to(s[..., None], lse_shape)
    except ValueError:
        raise InputError(
            f"sinks: shape {s.shape} does not match the heads of lse {lse_shape} (axis -2)"
        ) from None
    if not np.all(np.isfinite(s)):
        raise InputError(f"sinks: must be finite (shape {s.shape})")
    return arrays, s


def merge_vjp(
    arrays: Sequence[tuple[np.ndarray, np.ndarray]],
    sinks: np.ndarray | None,
    grad_out: Any,
    grad_lse: Any,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Gradients ``(d out_i, d lse_i)`` of every part, for upstream gradients of the merged
    ``out`` and ``lse`` (either may be ``None``: zero); parts as :func:`check` returns them.

    With ``w_i = exp(lse_i − lse)`` the merged ``out = Σ w_i out_i``, so ``d out_i = w_i · g``
    and ``d lse_i = w_i · (g_lse + Σ_dv g · (out_i − out))``. Sinks (constants here) first pass
    the gradients through ``out' = a · out``, ``lse' = log(e^lse + e^sink)``, ``a = e^(lse−lse')``.
    """
    out, lse = merge_arrays(arrays)
    dt = np.result_type(np.float32, out.dtype, lse.dtype)
    out, lse = out.astype(dt), lse.astype(dt)
    g = np.zeros(out.shape, dt) if grad_out is None else np.asarray(grad_out, dtype=dt)
    gl = np.zeros(lse.shape, dt) if grad_lse is None else np.asarray(grad_lse, dtype=dt)
    if sinks is not None:
        out2, lse2 = add_sink(out, lse, sinks.astype(dt))
        with np.errstate(invalid="ignore"):
            a = np.where(np.isneginf(lse), dt.type(0), np.exp(lse - lse2))
        dot = np.sum(g * out, axis=-1)
        g, gl = g * a[..., None], gl * a + dot * a * (1 - a)
    shift = np.where(np.isneginf(lse), dt.type(0), lse)
    grads = []
    for o, lse_i in arrays:
        w = np.where(np.isneginf(lse_i), dt.type(0), np.exp(lse_i.astype(dt) - shift))
        do = (w[..., None] * g).astype(o.dtype, copy=False)
        with np.errstate(invalid="ignore"):
            diff = np.where(w[..., None] != 0, o.astype(dt) - out, dt.type(0))
        dl = (w * (gl + np.sum(g * diff, axis=-1))).astype(lse_i.dtype, copy=False)
        grads.append((do, dl))
    return grads
