"""The public attention functions: validate once, then run a kernel.

Semantics (shapes, scale, bottom-right causal alignment, masks, windows, grouped-query heads,
dtypes) are those of :mod:`qkv.reference`, which every path here is tested to equal.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import InputError, InputTypeError
from .integrations import torch as _torch
from .kernels import dense, dispatch, mods
from .validate import as_array, check_flag, make_plan

__all__ = ["attention", "attention_weights", "scores", "softmax"]


def softmax(x: Any, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax along ``axis``.

    The maximum is subtracted before exponentiating, so no finite input overflows. A slice
    that is all ``-inf`` (nothing to attend) gives zeros, not NaN. float16 is computed in
    float32; integers and lists in float64.

    Parameters
    ----------
    x : array_like
        Real numbers.
    axis : int, optional
        The axis to normalise over (default: the last).

    Returns
    -------
    ndarray
        Same shape as ``x``; each slice along ``axis`` sums to 1 (or is all zeros).

    Examples
    --------
    >>> import qkv
    >>> qkv.softmax([1.0, 4.0]).round(5).tolist()
    [0.04743, 0.95257]
    >>> qkv.softmax([-float("inf"), -float("inf")]).tolist()
    [0.0, 0.0]
    """
    if _torch.is_tensor_input(x):
        return _torch.softmax(x, axis=axis)
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise InputTypeError(f"axis: expected an int, got {type(axis).__name__}")
    a = as_array(x, "x")
    if a.ndim == 0:
        raise InputError(f"x: expected at least 1 dimension, got shape {a.shape}")
    if not -a.ndim <= axis < a.ndim:
        raise InputError(f"axis: {axis} is out of range for x with shape {a.shape}")
    acc = np.float32 if a.dtype == np.float16 else a.dtype
    z = np.moveaxis(a.astype(acc, copy=True), axis, -1)
    w, _ = dense.softmax_rows(z)
    return np.moveaxis(w, -1, axis).astype(a.dtype, copy=False)


def scores(q: Any, k: Any, *, scale: Any = None) -> np.ndarray:
    """Scaled pre-softmax scores ``q · kᵀ · scale``.

    Parameters
    ----------
    q : array_like, shape ``(..., L, d)`` or ``(d,)``
        Queries.
    k : array_like, shape ``(..., S, d)``
        Keys. Leading dimensions broadcast; fewer kv heads (axis -3) than query heads group.
    scale : float, optional
        Multiplier of the dot products; default ``1/sqrt(d)`` with ``d = q.shape[-1]``.
        ``scale=1.0`` gives the raw dot products.

    Returns
    -------
    ndarray, shape ``(..., L, S)`` or ``(S,)`` for a 1-D ``q``
        In the inputs' dtype (float16 is accumulated in float32 and rounded at the end).

    Examples
    --------
    A worked example: ``q = [2, 1]``, ``K = [[1, 0], [3, 2]]`` and ``d = 4`` (not ``len(q)``):

    >>> import qkv
    >>> qkv.scores([2, 1], [[1, 0], [3, 2]], scale=1.0).tolist()     # raw q·kᵀ
    [2.0, 8.0]
    >>> qkv.scores([2, 1], [[1, 0], [3, 2]], scale=1 / 4**0.5).tolist()  # ÷√d, standard
    [1.0, 4.0]
    >>> qkv.scores([2, 1], [[1, 0], [3, 2]], scale=4**0.5).tolist()  # ×√d, a common slip
    [4.0, 16.0]
    """
    if _torch.is_tensor_input(q, k):
        return _torch.scores(q, k, scale=scale)
    plan = make_plan(q, k, need_v=False, scale=scale)
    s = dense.raw_scores(plan).astype(plan.out_dtype, copy=False)
    return s[..., 0, :] if plan.squeeze else s


def attention_weights(
    q: Any,
    k: Any,
    *,
    scale: Any = None,
    causal: bool = False,
    mask: Any = None,
    window: Any = None,
    **variants: Any,
) -> np.ndarray:
    """Attention weights ``softmax(q · kᵀ · scale + bias)`` with masked keys at weight 0.

    Parameters
    ----------
    q, k, scale
        As in :func:`scores`.
    causal : bool, optional
        Bottom-right aligned: query row ``i`` of ``L`` sits at position ``S - L + i`` and sees
        keys ``j <= S - L + i``. (PyTorch's ``is_causal=True`` is top-left aligned and differs
        when ``L < S``.)
    mask : array_like, optional
        Boolean (``True`` = may attend) or float (added to the scaled scores), broadcastable to
        ``(..., L, S)``. Combines with ``causal`` and ``window`` by AND.
    window : (int or None, int or None), optional
        ``(left, right)``: the query at position ``p`` sees keys ``p - left <= j <= p + right``;
        ``None`` on a side is unbounded.
    **variants
        ``softcap``, ``sinks``, ``alibi_slopes``, ``score_mod``, ``mask_mod``: see
        :func:`attention`.

    Returns
    -------
    ndarray, shape ``(..., L, S)`` or ``(S,)`` for a 1-D ``q``
        Rows sum to 1 (less with sinks), or are all zeros where a row may attend no key.

    Examples
    --------
    >>> import qkv
    >>> qkv.attention_weights([[1, 0], [0, 1]], [[1, 0], [0, 1]], causal=True).round(4).tolist()
    [[1.0, 0.0], [0.3302, 0.6698]]
    """
    if _torch.is_tensor_input(q, k):
        return _torch.attention_weights(
            q, k, scale=scale, causal=causal, mask=mask, window=window, **variants
        )
    plan = make_plan(
        q, k, need_v=False, scale=scale, causal=causal, mask=mask, window=window, **variants
    )
    w = dispatch.weights(plan)
    if plan.sinks is not None:
        _, lse = dense.softmax_rows(dense.logits(plan))
        w *= mods.sink_factor(plan, lse)[0][..., None]
    w = w.astype(plan.out_dtype, copy=False)
    return w[..., 0, :] if plan.squeeze else w


def attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    scale: Any = None,
    causal: bool = False,
    mask: Any = None,
    window: Any = None,
    return_lse: bool = False,
    check_finite: bool = False,
    kernel: str = "auto",
    **variants: Any,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Scaled dot-product attention ``softmax(q · kᵀ · scale + bias) · v``.

    Parameters
    ----------
    q : array_like, shape ``(..., L, d)`` or ``(d,)``
        Queries; a 1-D ``q`` is a single query and gives a 1-D output.
    k : array_like, shape ``(..., S, d)``
        Keys.
    v : array_like, shape ``(..., S, dv)``
        Values; ``dv`` may differ from ``d``.
    scale, causal, mask, window
        As in :func:`attention_weights`.
    return_lse : bool, optional
        Also return the natural-log log-sum-exp of each row's scaled, biased, masked scores
        (``-inf`` for a row that may attend nothing).
    check_finite : bool, optional
        Raise on NaN or infinity in ``q``, ``k`` or ``v`` instead of letting them propagate to
        the rows they touch (the default, as in every framework).
    kernel : {"auto", "dense", "tiled", "decode"}, optional
        Which kernel computes the result; all give the same numbers (up to rounding).
        ``"auto"`` picks by shape (:func:`qkv.kernels.dispatch.choose`): ``"dense"`` for tiny
        problems, ``"decode"`` for a few queries per head against many keys, ``"tiled"``
        (online softmax, ``O(tile · S)`` extra memory) otherwise. Forcing one is for tests
        and benchmarks.
    **variants
        Attention variants, applied in this order to the scaled scores (then the float mask is
        added and the masks applied):

        - ``softcap=c`` (float > 0): scores become ``c · tanh(s / c)`` (Gemma 2).
        - ``alibi_slopes`` (shape ``(heads,)``): adds ``−slope · (query position − key
          position)`` for keys at or before the query (BLOOM, MPT); positions bottom-right.
        - ``score_mod(score, batch, head, q_idx, kv_idx)``: returns new scores of the same
          shape, from NumPy operations on broadcastable index arrays (absolute positions).
        - ``mask_mod(batch, head, q_idx, kv_idx)``: boolean, ``True`` = may attend; ANDed with
          the other masks. Tiles it rules out entirely are skipped (see :mod:`qkv.variants`).
        - ``sinks`` (shape ``(heads,)``): a logit per query head that joins every row's
          softmax denominator with no value (gpt-oss); a row with no key gives output 0 and
          lse equal to the sink.

    Returns
    -------
    out : ndarray, shape ``(..., L, dv)`` or ``(dv,)``
        In the inputs' dtype (NumPy's ``result_type``; ints and lists give float64). A row
        that may attend no key is 0.
    lse : ndarray, shape ``(..., L)`` or ``()``
        Only with ``return_lse``; in the accumulation dtype (float32 for float16 inputs).

    Examples
    --------
    The worked example ``q = [2, 1]``, ``K = [[1, 0], [3, 2]]`` with ``d = 4``:

    >>> import qkv
    >>> out = qkv.attention([2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4]], scale=1 / 2)
    >>> out.round(6).tolist()
    [2.905148, 3.905148]
    """
    check_flag(return_lse, "return_lse")
    if _torch.is_tensor_input(q, k, v):
        return _torch.attention(
            q,
            k,
            v,
            scale=scale,
            causal=causal,
            mask=mask,
            window=window,
            return_lse=return_lse,
            check_finite=check_finite,
            kernel=kernel,
            **variants,
        )
    kernel = dispatch.check_kernel(kernel)
    plan = make_plan(
        q,
        k,
        v,
        scale=scale,
        causal=causal,
        mask=mask,
        window=window,
        check_finite=check_finite,
        **variants,
    )
    out, lse = dispatch.attend(plan, kernel)
    out = out.astype(plan.out_dtype, copy=False)
    if plan.squeeze:
        out, lse = out[..., 0, :], lse[..., 0]
    return (out, lse) if return_lse else out
