"""The public functions: each signature written once, each call checked once.

:func:`scores`, :func:`attention_weights` and :func:`attention` build one checked
:class:`qkv.call.Call` (:func:`qkv.call.build`) and hand it to one back end, which runs it
without checking again:

- NumPy arrays, lists, scalars and CPU tensors → the NumPy engine (:func:`qkv.engine.run.run`);
- CPU tensors that require grad → the torch bridge's autograd (:func:`qkv.torch_bridge.run`);
- tensors on a GPU → the Triton kernels (:func:`qkv.gpu.api.run`, the ``gpu`` extra).

:func:`softmax` is the NumPy engine's under the same tensor policy (:mod:`qkv.tensors`):
tensors in, tensors out (dtype and device of the caller), autograd where qkv has a gradient and
a refusal by name where it has none; :mod:`qkv.wrapped` holds the engine's other public
functions (:func:`qkv.merge`, :func:`qkv.attention_vjp`, :func:`qkv.attention_varlen`,
:class:`qkv.KVCache`) under the same policy. The core never imports a bridge: the bridges
import the core.

Importing this module loads no kernel and no bridge: the NumPy engine
(:mod:`qkv.engine.run`, and the kernels under it) is imported by the first call that runs on
it, the torch bridge by the first call that wants a gradient (:func:`_engine`, :func:`_bridge`),
so that ``import qkv`` stays light.
"""

from __future__ import annotations

from functools import cache
from types import ModuleType
from typing import Any

import numpy as np

from .call import Call, build
from .errors import InputError
from .keywords import near_keywords
from .tensors import (
    give,
    give_at,
    give_pair,
    give_plain,
    one_device,
    read_at,
    read_plain,
    read_plain_mask,
    swap_axes,
    swapped_result,
    want_of,
    wants_grad,
)
from .validate import VARIANTS

__all__ = [
    "attention",
    "attention_weights",
    "scores",
    "softmax",
]


@cache
def _engine() -> ModuleType:
    """The NumPy engine's entry (:mod:`qkv.engine.run`), imported by the first call."""
    from .engine import run

    return run


def _bridge() -> ModuleType:
    """The torch bridge (:mod:`qkv.torch_bridge`), imported by the first call with gradients."""
    from . import torch_bridge

    return torch_bridge


def _run(call: Call) -> Any:
    """The back end for a checked call (see the module docstring)."""
    if call.route == "numpy":
        res = _engine().run(call.fn, call.plan, call.kernel, call.return_lse)
        return give_pair(res[0], res[1], call.want) if call.return_lse else give(res, call.want)
    if call.route == "autograd":
        return _bridge().run(call)
    one_device(call.given)  # another device is refused by name, with Triton or without
    return _gpu_run()(call)


@near_keywords()
def softmax(x: Any, axis: int = -1) -> Any:
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
    if wants_grad(x):
        return _bridge().softmax(x, axis)
    return give(_engine().softmax(x, axis=axis), want_of(x))


@near_keywords()
def scores(q: Any, k: Any, *, scale: Any = None) -> Any:
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
    return _run(build("scores", q, k, scale=scale))


@near_keywords(VARIANTS)
def attention_weights(
    q: Any,
    k: Any,
    *,
    scale: Any = None,
    causal: bool = False,
    mask: Any = None,
    window: Any = None,
    **variants: Any,
) -> Any:
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
    return _run(
        build("attention_weights", q, k, scale=scale, causal=causal, mask=mask, window=window,
              **variants)
    )  # fmt: skip


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
    layout: str = "bhld",
    **variants: Any,
) -> Any:
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
        ``"auto"`` picks by shape (:mod:`qkv.engine.kernels.router`): ``"dense"`` for tiny
        problems, ``"decode"`` for a few queries per head against many keys, ``"tiled"``
        (online softmax, ``O(tile · S)`` extra memory) otherwise. Forcing one is for tests
        and benchmarks.
    layout : {"bhld", "blhd"}, optional
        How ``q``, ``k`` and ``v`` are laid out: ``"bhld"`` (the default) is qkv's and PyTorch
        SDPA's ``(..., heads, L, d)``; ``"blhd"`` is FlashAttention's and transformers'
        ``(..., L, heads, d)`` (at least 3 dimensions each). The output follows the layout,
        ``(..., L, heads, dv)`` for ``"blhd"``, and so does the log-sum-exp,
        ``(..., L, heads)``; a ``mask`` is always laid out like the scores, ``(..., heads, L,
        S)``. Where the shapes fit both readings qkv cannot tell which was meant: say it.
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

    FlashAttention's layout, ``(batch, L, heads, d)``:

    >>> import numpy as np
    >>> x = np.random.default_rng(0).standard_normal((1, 5, 2, 4))
    >>> out = qkv.attention(x, x, x, causal=True, layout="blhd")
    >>> out.shape
    (1, 5, 2, 4)
    >>> t = x.swapaxes(1, 2)
    >>> bool(np.allclose(out, qkv.attention(t, t, t, causal=True).swapaxes(1, 2)))
    True
    """
    if (
        window is None
        and not variants
        and return_lse is False
        and check_finite is False
        and type(kernel) is str
        and kernel == "auto"
        and type(layout) is str
    ):  # the commonest call (no mask, or a padding mask): its checked plan and kernel kept
        # per shapes (engine.run.plain)
        if layout == "bhld":
            out = _plain(q, k, v, scale, causal, mask)
            if out is not None:
                return out
        elif layout == "blhd" and getattr(q, "ndim", 0) >= 3 and getattr(k, "ndim", 0) >= 3:
            if getattr(v, "ndim", 0) >= 3:  # (else the checks say what is wrong with them)
                qs, ks, vs = (swap_axes(x, -3, -2) for x in (q, k, v))
                out = _plain(qs, ks, vs, scale, causal, mask, True)
                if out is not None:  # (written rows first where the road can: no copy)
                    return swapped_result(out, -3, -2)
    return _checked(
        q, k, v, scale=scale, causal=causal, mask=mask, window=window, return_lse=return_lse,
        check_finite=check_finite, kernel=kernel, layout=layout, **variants,
    )  # fmt: skip


def _plain(
    q: Any, k: Any, v: Any, scale: Any, causal: Any, mask: Any, rows_first: bool = False
) -> Any:
    """:func:`attention`'s commonest call on the road kept for its shapes
    (:func:`qkv.engine.run.plain`), or None where it is not such a call or that road is not
    kept yet; ``rows_first``: the output is to be given back as ``(..., L, heads, dv)``
    (``q``, ``k``, ``v`` are views of ``layout="blhd"`` arrays)."""
    if type(q) is np.ndarray and type(k) is np.ndarray and type(v) is np.ndarray:
        return _engine().plain(q, k, v, scale, causal, mask, rows_first)
    at = read_at(q, k, v)
    keep = mask if mask is None else read_plain_mask(mask)
    if at is not None and (mask is None or keep is not None):
        out = _engine().plain_at(*at, scale, causal, keep, rows_first)
        if out is not None:  # (None before the key's road is kept: its first call)
            return give_at(out, q)
    arrays = read_plain(q, k, v)
    if arrays is not None and (mask is None or keep is not None):
        out = _engine().plain(*arrays, scale, causal, keep, rows_first)
        if out is not None:
            return give_plain(out)
    return None


# (the keyword check wraps the general road alone: a call that takes the kept road above was
# given no keyword but attention's own, and the wrapper cost a tenth of a small call's time)
@near_keywords(VARIANTS, like=attention)
def _checked(
    q: Any,
    k: Any,
    v: Any,
    *,
    scale: Any,
    causal: bool,
    mask: Any,
    window: Any,
    return_lse: bool,
    check_finite: bool,
    kernel: str,
    layout: str,
    **variants: Any,
) -> Any:
    """:func:`attention`'s general road: the checked call, then its back end."""
    call = build(
        "attention", q, k, v, scale=scale, causal=causal, mask=mask, window=window,
        return_lse=return_lse, check_finite=check_finite, kernel=kernel, layout=layout,
        **variants,
    )  # fmt: skip
    if call.layout == "bhld":
        return _run(call)
    res = _run(call)  # (..., heads, L, dv): back to the caller's layout, contiguous
    if return_lse:
        return swapped_result(res[0], -3, -2), swapped_result(res[1], -2, -1)
    return swapped_result(res, -3, -2)


def _gpu_run() -> Any:
    """:func:`qkv.gpu.api.run`, or a clear error when Triton is not installed."""
    try:
        from .gpu.api import run
    except ImportError as exc:
        raise InputError(
            f"q: tensors on a GPU need Triton ({exc}); install the gpu extra "
            "(pip install 'qkv[gpu]', or '.[gpu]' in qkv's source tree) or move them with .cpu()"
        ) from None
    return run
