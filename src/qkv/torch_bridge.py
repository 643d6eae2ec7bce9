"""PyTorch tensors in, PyTorch tensors out: :func:`qkv.attention` and friends on ``torch.Tensor``.

The public functions in :mod:`qkv` send tensor inputs here by themselves, so users never call
this module directly::

    out = qkv.attention(q, k, v, causal=True)   # q, k, v: CPU tensors -> out: a tensor
    out.sum().backward()                        # gradients from qkv.attention_vjp

What happens to a tensor:

- It is read as a NumPy array (no copy for contiguous CPU tensors), qkv computes exactly as for
  NumPy input, and the result comes back as a tensor of the inputs' dtype. ``bfloat16``, which
  NumPy lacks, is computed in float32 and rounded back to ``bfloat16``.
- When gradients are enabled and ``q``, ``k`` or ``v`` requires grad, :func:`attention` runs
  through a :class:`torch.autograd.Function` whose backward is :func:`qkv.attention_vjp`, so
  ``loss.backward()`` gives the gradients PyTorch's own attention would. A float ``mask`` is a
  constant bias: it cannot require grad. :func:`scores` and :func:`attention_weights` return
  tensors that are not part of the autograd graph.
- Attention variants (``softcap``, ``sinks``, ``alibi_slopes``, ``score_mod``, ``mask_mod``)
  pass through. ``sinks`` may be a tensor that requires grad (gpt-oss's learned sinks): its
  gradient comes from :func:`qkv.attention_vjp` like the others. A ``score_mod`` has no
  gradient in qkv and is refused when gradients are wanted.
- Masks may be tensors too (bool: ``True`` = may attend; float: added bias), as may any mix of
  tensors, arrays and lists (the result is a tensor when ``q``, ``k`` or ``v`` is one).
- :func:`qkv.attention` on tensors on a GPU does not come here: the public front
  (:mod:`qkv.front`) sends them to qkv's Triton kernels (:mod:`qkv.gpu`, the ``gpu`` extra),
  which fall back to this bridge, with a warning, for what they do not cover. The functions
  here refuse device tensors with :class:`qkv.InputError`: silently copying across devices
  would hide a large cost.
- Importing this module teaches the NumPy core to read tensors
  (:func:`qkv.validate.add_reader`), so the NumPy-only functions (:func:`qkv.merge`,
  :class:`qkv.KVCache`, :func:`qkv.attention_vjp`...) accept CPU tensors as arrays.

Alignment differs from PyTorch in one place: ``causal=True`` is bottom-right aligned (PyTorch's
``causal_lower_right``); ``scaled_dot_product_attention(is_causal=True)`` is top-left aligned.
They agree when ``L == S``.

Importing this module does not import torch; torch is imported on the first tensor call.
"""

from __future__ import annotations

import sys
from functools import cache
from typing import TYPE_CHECKING, Any

import numpy as np

from . import core
from .errors import InputError, InputTypeError
from .grad import attention_vjp
from .validate import add_reader, as_array, check_flag

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "attention",
    "attention_weights",
    "is_tensor_input",
    "on_device",
    "scores",
    "softmax",
]


def is_tensor_input(*xs: Any) -> bool:
    """True when any of ``xs`` is a ``torch.Tensor``; never imports torch itself.

    A tensor can only exist once torch has been imported, so the check looks in
    ``sys.modules`` and costs nothing for NumPy users.

    Examples
    --------
    >>> from qkv.torch_bridge import is_tensor_input
    >>> is_tensor_input([1.0, 2.0], None)
    False
    """
    torch = sys.modules.get("torch")
    tensor = getattr(torch, "Tensor", None)
    return tensor is not None and any(isinstance(x, tensor) for x in xs)


def _torch() -> Any:
    import torch

    return torch


@cache
def _NUMPY_FLOATS() -> tuple[Any, ...]:  # noqa: N802 (a constant, built once torch is imported)
    torch = _torch()
    return (torch.float16, torch.float32, torch.float64)


def on_device(*xs: Any) -> bool:
    """True when any of ``xs`` is a tensor on a device other than the CPU (the public front
    sends those to :mod:`qkv.gpu`)."""
    if not is_tensor_input(*xs):
        return False
    torch = _torch()
    return any(isinstance(x, torch.Tensor) and x.device.type != "cpu" for x in xs)


def _read_tensor(x: Any, name: str) -> Any:
    """A tensor given to a NumPy-only function (``merge``, ``KVCache``, ``attention_vjp``...)
    as a NumPy array, with an error naming the argument for tensors NumPy cannot hold."""
    try:
        x = x.detach().cpu()
        if x.is_floating_point() and x.dtype not in _NUMPY_FLOATS():
            x = x.float()  # bfloat16 and float8, which NumPy lacks
        return x.numpy()
    except (TypeError, RuntimeError) as exc:
        raise InputTypeError(
            f"{name}: a tensor NumPy cannot read (shape {tuple(x.shape)}, dtype {x.dtype}, "
            f"layout {x.layout}): {exc}"
        ) from None


# Importing the bridge teaches the NumPy core to read tensors (the core never imports torch).
add_reader(is_tensor_input, _read_tensor)


def _to_numpy(x: Any, name: str) -> Any:
    """A CPU tensor as a NumPy array (bfloat16 and other NumPy-less floats as float32)."""
    torch = _torch()
    if not isinstance(x, torch.Tensor):
        return x
    if x.device.type != "cpu":
        raise InputError(
            f"{name}: tensors on device {x.device} are not supported yet (shape "
            f"{tuple(x.shape)}); qkv computes on the CPU, so move them with .cpu()"
        )
    if x.layout != torch.strided or x.is_quantized:
        kind = "quantized" if x.is_quantized else f"{x.layout}".replace("torch.", "")
        raise InputTypeError(
            f"{name}: {kind} tensors are not supported (shape {tuple(x.shape)}, dtype "
            f"{x.dtype}); convert with .to_dense() or .dequantize() first"
        )
    x = x.detach()
    if x.is_floating_point() and x.dtype not in _NUMPY_FLOATS():
        x = x.float()
    return x.resolve_conj().resolve_neg().numpy()


def _out_dtype(result: np.dtype, inputs: tuple[Any, ...]) -> torch.dtype:
    """The tensor dtype for a result computed in NumPy as ``result``.

    All-``bfloat16`` inputs give ``bfloat16`` (computed in float32); otherwise NumPy's dtype.
    """
    torch = _torch()
    if all(isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 for x in inputs):
        return torch.bfloat16
    return torch.from_numpy(np.empty(0, dtype=result)).dtype


def _tensor(a: np.ndarray) -> torch.Tensor:
    """``a`` as a CPU tensor, copied only when it is not a writeable contiguous array."""
    a = np.asarray(a)
    if not (a.flags.writeable and a.flags.c_contiguous):
        a = np.array(a, order="C")
    return _torch().from_numpy(a)


def _as_tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return _tensor(a).to(dtype)


def softmax(x: Any, axis: int = -1) -> torch.Tensor:
    """:func:`qkv.softmax` for a tensor ``x``; returns a tensor of ``x``'s dtype."""
    w = core.softmax(_to_numpy(x, "x"), axis=axis)
    return _as_tensor(w, _out_dtype(w.dtype, (x,)))


def scores(q: Any, k: Any, *, scale: Any = None) -> torch.Tensor:
    """:func:`qkv.scores` for tensor inputs; returns a tensor (outside the autograd graph)."""
    s = core.scores(_to_numpy(q, "q"), _to_numpy(k, "k"), scale=scale)
    return _as_tensor(s, _out_dtype(s.dtype, (q, k)))


def attention_weights(
    q: Any,
    k: Any,
    *,
    scale: Any = None,
    causal: bool = False,
    mask: Any = None,
    window: Any = None,
    **variants: Any,
) -> torch.Tensor:
    """:func:`qkv.attention_weights` for tensor inputs; returns a tensor (outside autograd)."""
    w = core.attention_weights(
        _to_numpy(q, "q"),
        _to_numpy(k, "k"),
        scale=scale,
        causal=causal,
        mask=_to_numpy(mask, "mask"),
        window=window,
        **_variant_arrays(variants),
    )
    return _as_tensor(w, _out_dtype(w.dtype, (q, k)))


def _variant_arrays(variants: dict[str, Any]) -> dict[str, Any]:
    """Per-head tensors among the variants as NumPy arrays."""
    return {
        key: _to_numpy(x, key) if key in ("sinks", "alibi_slopes") else x
        for key, x in variants.items()
    }


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
    **more: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`qkv.attention` for tensor inputs, differentiable when they require grad.

    Returns a tensor of the inputs' dtype (and the log-sum-exp as a tensor with
    ``return_lse``; it carries no gradient). Keywords in ``more`` (such as a choice of kernel)
    go to :func:`qkv.attention` unchanged; the gradient does not depend on them.
    """
    check_flag(return_lse, "return_lse")
    torch = _torch()
    sinks = more.pop("sinks", None)
    options = {
        "scale": scale,
        "causal": causal,
        "mask": _to_numpy(mask, "mask"),
        "window": window,
        "check_finite": check_finite,
        **_variant_arrays(more),
    }
    if sinks is not None:
        options["sinks"] = _to_numpy(sinks, "sinks")
    arrays = (_to_numpy(q, "q"), _to_numpy(k, "k"), _to_numpy(v, "v"))
    wants_grad = torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in (q, k, v, sinks)
    )
    if wants_grad and options.get("score_mod") is not None:
        raise InputError(
            "score_mod: qkv cannot differentiate a user function; run under torch.no_grad() "
            "or use PyTorch's flex_attention for gradients"
        )
    if isinstance(mask, torch.Tensor) and mask.requires_grad and wants_grad:
        raise InputError(
            f"mask: qkv gives no gradient for a float mask (shape {tuple(mask.shape)}); "
            "detach it, or compute its gradient with PyTorch's own attention"
        )
    if not wants_grad:
        out, lse = _forward(arrays, options)
        out_t = _as_tensor(out, _out_dtype(out.dtype, (q, k, v)))
        return (out_t, _tensor(lse)) if return_lse else out_t
    # Lists and arrays mixed with tensors become tensors, so the Function sees only tensors.
    tensors = tuple(
        x if isinstance(x, torch.Tensor) else _tensor(np.asarray(as_array(a, name)))
        for x, a, name in zip((q, k, v), arrays, "qkv", strict=True)
    )
    sink_t = (
        sinks if isinstance(sinks, torch.Tensor) or sinks is None else _tensor(options["sinks"])
    )
    out_t, lse_t = _function().apply(*tensors, sink_t, options)
    return (out_t, lse_t) if return_lse else out_t


def _arrays(*tensors: Any) -> tuple[Any, ...]:
    return tuple(_to_numpy(t, name) for t, name in zip(tensors, "qkv", strict=True))


def _forward(arrays: tuple[Any, ...], options: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    out, lse = core.attention(*arrays, return_lse=True, **options)
    return out, np.asarray(lse)


@cache
def _function() -> type:
    """The :class:`torch.autograd.Function`, built on first use so torch stays optional."""
    torch = _torch()

    class QkvAttention(torch.autograd.Function):
        """Forward: :func:`qkv.attention`; backward: :func:`qkv.attention_vjp`."""

        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any, sinks: Any, options: Any) -> Any:
            out, lse = _forward(_arrays(q, k, v), options)
            ctx.save_for_backward(q, k, v)  # torch checks they are not modified in place
            ctx.sinks = sinks
            ctx.options = options
            lse_t = _tensor(lse)
            ctx.mark_non_differentiable(lse_t)
            return _as_tensor(out, _out_dtype(out.dtype, (q, k, v))), lse_t

        @staticmethod
        def backward(ctx: Any, grad_out: Any, grad_lse: Any) -> Any:
            saved = ctx.saved_tensors
            opts = {
                key: x for key, x in ctx.options.items() if key not in ("check_finite", "kernel")
            }
            grads = attention_vjp(*_arrays(*saved), _to_numpy(grad_out, "grad_out"), **opts)
            d_sinks = None
            if ctx.sinks is not None and ctx.needs_input_grad[3]:
                d_sinks = _as_tensor(np.asarray(grads[3]), ctx.sinks.dtype)
            return (
                *(
                    _as_tensor(g, t.dtype) if needed else None
                    for g, t, needed in zip(grads[:3], saved, ctx.needs_input_grad[:3], strict=True)
                ),
                d_sinks,
                None,
            )

    return QkvAttention
