"""Autograd for qkv on PyTorch tensors: qkv's own gradients behind ``loss.backward()``.

The public functions (:mod:`qkv.front`) read tensors by the tensor policy
(:mod:`qkv.tensors`) and send here the calls whose tensors require grad (with gradients
enabled). Each runs as a :class:`torch.autograd.Function` whose forward is the checked call on
the NumPy engine and whose backward is qkv's VJP on the *same* checked plan (nothing is checked
again)::

    out = qkv.attention(q, k, v, causal=True)   # q, k, v: CPU tensors -> out: a tensor
    out.sum().backward()                        # gradients from qkv.engine.grad.vjp

- :func:`qkv.attention`: gradients for ``q``, ``k``, ``v`` and ``sinks`` (gpt-oss's learned
  sinks), as :func:`qkv.attention_vjp` gives them: from the forward's saved ``out`` and ``lse``
  by the tiled (FlashAttention-2) backward, which never holds the ``L × S`` weights (the dense
  one only when the returned lse itself feeds the loss);
- :func:`qkv.attention_weights` and :func:`qkv.scores`: gradients for ``q`` and ``k``;
- :func:`qkv.softmax` and :func:`qkv.merge`: gradients for their inputs.

What qkv cannot differentiate is refused by name when gradients are wanted (a ``score_mod``, a
float mask or ALiBi slopes that require grad), never silently detached. ``bfloat16`` tensors
are computed in float32 and their gradients come back as ``bfloat16``.

Alignment differs from PyTorch in one place: ``causal=True`` is bottom-right aligned (PyTorch's
``causal_lower_right``); ``scaled_dot_product_attention(is_causal=True)`` is top-left aligned.
They agree when ``L == S``.

Importing this module does not import torch; torch is imported on the first call that needs it.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING, Any

import numpy as np

from .engine import grad, merge
from .engine import run as core
from .engine.kernels import dense, dispatch
from .tensors import as_dtype, give, give_pair, read, want_of

if TYPE_CHECKING:  # pragma: no cover
    from .call import Call

__all__ = ["merge_parts", "run", "softmax"]


def run(call: Call) -> Any:
    """Run a checked call whose tensors require grad: tensors out, in the autograd graph."""
    g = call.given
    if call.fn == "attention":
        out, lse = _attention().apply(g["q"], g["k"], g["v"], g.get("sinks"), call)
        return (out, lse) if call.return_lse else out
    if call.fn == "attention_weights":
        return _weights().apply(g["q"], g["k"], g.get("sinks"), call)
    return _scores().apply(g["q"], g["k"], call)


def _backward_result(ctx: Any, grads: tuple[np.ndarray | None, ...]) -> tuple[Any, ...]:
    """What the backward of a checked call's function returns: each gradient as a tensor of its
    input's dtype where the input (``ctx.likes``) needs one; ``None`` for the sinks when the
    VJP gave no sinks gradient, and for the checked call itself (the last input)."""
    likes = ctx.likes
    padded = (*grads, *(None,) * (len(likes) - len(grads)))
    needed = ctx.needs_input_grad[: len(likes)]
    return (
        *(
            as_dtype(a, like) if need and a is not None else None
            for a, like, need in zip(padded, likes, needed, strict=True)
        ),
        None,
    )


@cache
def _attention() -> Any:  # a torch.autograd.Function subclass (torch is optional)
    import torch

    class QkvAttention(torch.autograd.Function):
        """Forward: the checked call on the NumPy engine; backward: :func:`qkv.engine.grad.vjp`."""

        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any, sinks: Any, call: Any) -> Any:
            plan = call.plan
            acc_out, acc_lse = dispatch.attend(plan, call.kernel)  # the compute dtype
            out = acc_out.astype(plan.out_dtype, copy=False)
            lse = acc_lse
            if plan.squeeze:
                acc_out, acc_lse = acc_out[..., 0, :], acc_lse[..., 0]
                out, lse = out[..., 0, :], lse[..., 0]
            # torch checks that tensors saved here are not modified in place before backward
            ctx.save_for_backward(*(t for t in (q, k, v) if isinstance(t, torch.Tensor)))
            ctx.call, ctx.likes = call, (q, k, v, sinks)
            # the backward is the tiled one (FlashAttention-2): it recomputes the weights tile
            # by tile from the forward's out and lse, never holding the L × S matrix
            ctx.forward = (acc_out, acc_lse)
            ctx.set_materialize_grads(False)  # an unused lse gets None, not a tensor of zeros
            lse_t = give(np.asarray(lse), call.want, exact=True)
            return give(out, call.want), lse_t

        @staticmethod
        def backward(ctx: Any, grad_out: Any, grad_lse: Any) -> Any:
            plan = ctx.call.plan  # K/V read in place where a kernel can, widened elsewhere
            acc_out, acc_lse = ctx.forward
            g = np.zeros_like(acc_out) if grad_out is None else read(grad_out, "grad_out")
            if grad_lse is None:
                grads = grad.vjp(plan, g, out=acc_out, lse=acc_lse)
            else:  # the lse is used downstream (a merge): the dense path takes its gradient
                gl = read(grad_lse, "grad_lse")
                grads = grad.vjp(plan, g, grad_lse=gl[..., None] if plan.squeeze else gl)
            return _backward_result(ctx, grads)

    return QkvAttention


@cache
def _weights() -> Any:  # a torch.autograd.Function subclass (torch is optional)
    import torch

    class QkvWeights(torch.autograd.Function):
        """Forward: the checked call's weights; backward: :func:`qkv.engine.grad.weights_vjp`."""

        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, sinks: Any, call: Any) -> Any:
            plan = call.plan
            w = core.weights(plan)
            ctx.save_for_backward(*(t for t in (q, k) if isinstance(t, torch.Tensor)))
            ctx.call, ctx.w, ctx.likes = call, w, (q, k, sinks)
            out = w.astype(plan.out_dtype, copy=False)
            return give(out[..., 0, :] if plan.squeeze else out, call.want)

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            return _backward_result(ctx, grad.weights_vjp(ctx.call.plan, ctx.w, read(g, "grad")))

    return QkvWeights


@cache
def _scores() -> Any:  # a torch.autograd.Function subclass (torch is optional)
    import torch

    class QkvScores(torch.autograd.Function):
        """Forward: the scaled scores of the checked call; backward: :func:`grad.scores_vjp`."""

        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, call: Any) -> Any:
            plan = call.plan
            ctx.save_for_backward(*(t for t in (q, k) if isinstance(t, torch.Tensor)))
            ctx.call, ctx.likes = call, (q, k)
            s = dense.raw_scores(plan).astype(plan.out_dtype, copy=False)
            return give(s[..., 0, :] if plan.squeeze else s, call.want)

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            return _backward_result(ctx, grad.scores_vjp(ctx.call.plan, read(g, "grad")))

    return QkvScores


def softmax(x: Any, axis: int) -> Any:
    """:func:`qkv.softmax` of a tensor that requires grad (``dx = y ∘ (g − Σ g ∘ y)``)."""
    return _softmax().apply(x, axis)


@cache
def _softmax() -> Any:  # a torch.autograd.Function subclass (torch is optional)
    import torch

    class QkvSoftmax(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, axis: int) -> Any:
            y = core.softmax(read(x, "x"), axis=axis)
            ctx.y, ctx.axis, ctx.like = y, axis, x
            return give(y, want_of(x))

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            y = ctx.y.astype(np.result_type(ctx.y, np.float32))
            ga = read(g, "grad").astype(y.dtype)
            dx = y * (ga - np.sum(ga * y, axis=ctx.axis, keepdims=True))
            return as_dtype(dx, ctx.like), None

    return QkvSoftmax


def merge_parts(parts: Any, sinks: Any, want: Any) -> Any:
    """:func:`qkv.merge` when a part requires grad: tensors out, in the autograd graph."""
    arrays, s = merge.check(parts, sinks)
    flat = [x for part in parts for x in part]
    return _merge().apply(arrays, s, want, *flat)


@cache
def _merge() -> Any:  # a torch.autograd.Function subclass (torch is optional)
    import torch

    class QkvMerge(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, arrays: Any, s: Any, want: Any, *flat: Any) -> Any:
            out, lse = merge.merge_arrays(arrays)
            if s is not None:
                out, lse = merge.add_sink(out, lse, s)
            ctx.arrays, ctx.s, ctx.likes = arrays, s, flat
            return give_pair(out, np.asarray(lse), want)

        @staticmethod
        def backward(ctx: Any, g_out: Any, g_lse: Any) -> Any:
            go = None if g_out is None else read(g_out, "grad")
            gl = None if g_lse is None else read(g_lse, "grad")
            grads = merge.merge_vjp(ctx.arrays, ctx.s, go, gl)
            flat = [x for pair in grads for x in pair]
            needed = ctx.needs_input_grad[3:]
            return (
                None,
                None,
                None,
                *(
                    as_dtype(gx, like) if need and isinstance(like, torch.Tensor) else None
                    for gx, like, need in zip(flat, ctx.likes, needed, strict=True)
                ),
            )

    return QkvMerge
