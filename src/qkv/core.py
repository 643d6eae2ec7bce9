"""The NumPy path of the public attention functions: validate once, then run a kernel.

:mod:`qkv.front` holds the public functions and their documentation; it sends NumPy arrays,
lists and scalars here, and tensors to :mod:`qkv.torch_bridge`, which calls here too.
Nothing here knows of PyTorch: tensors reach the core only as arrays.

Semantics (shapes, scale, bottom-right causal alignment, masks, windows, grouped-query heads,
dtypes) are those of :mod:`qkv.reference`, which every path here is tested to equal.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .checks import check_int
from .errors import InputError
from .kernels import dense, dispatch, mods
from .validate import as_array, check_flag, make_plan

__all__ = ["attention", "attention_weights", "scores", "softmax"]


def softmax(x: Any, axis: int = -1) -> np.ndarray:
    """The NumPy path of :func:`qkv.softmax` (documented there)."""
    check_int(axis, "axis")
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
    """The NumPy path of :func:`qkv.scores` (documented there)."""
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
    """The NumPy path of :func:`qkv.attention_weights` (documented there)."""
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
    """The NumPy path of :func:`qkv.attention` (documented there)."""
    check_flag(return_lse, "return_lse")
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
