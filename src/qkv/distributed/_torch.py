"""CPU tensors in, tensors out for :mod:`qkv.distributed`, with autograd.

``out = ring_attention(q, k, v, ...)`` on tensors that require grad runs through a
:class:`torch.autograd.Function` whose backward is :func:`ring_attention_vjp` on the same shards
(saved at the forward, so the backward can never see other K/V), with the forward's ``out`` and
``lse`` kept in the accumulation dtype. Gradients come back in each input's own dtype. The
packed ring (``ring_attention_varlen``) runs through the same function with its own forward and
backward.
"""

from __future__ import annotations

import inspect
from functools import cache
from typing import Any

import numpy as np

from ..tensors import as_dtype, give, give_pair, read, want_of
from .decode import decode as np_decode
from .ring import (
    ring_attention as ring_signature,
)
from .ring import (
    ring_attention_varlen_vjp,
    ring_attention_vjp,
    ring_forward,
    varlen_forward,
)

__all__ = ["decode", "ring_attention", "ring_attention_varlen"]

#: The keywords of the NumPy ring's signature (the torch side takes the same ones).
_RING_KEYWORDS = frozenset(inspect.signature(ring_signature).parameters) - {"q", "k", "v"}


def _arrays(q: Any, k: Any, v: Any) -> tuple[Any, Any, Any]:
    return read(q, "q"), read(k, "k"), read(v, "v")


def _tensors(*xs: Any) -> tuple[Any, ...]:
    import torch

    return tuple(x if isinstance(x, torch.Tensor) else torch.as_tensor(x) for x in xs)


def ring_attention(q: Any, k: Any, v: Any, **opts: Any) -> Any:
    """:func:`~qkv.distributed.ring_attention` on tensors, with autograd; ``opts`` are its
    keywords."""
    for name in opts:
        if name not in _RING_KEYWORDS:  # as the NumPy ring's own signature refuses it
            raise TypeError(f"ring_attention() got an unexpected keyword argument {name!r}")
    return_lse, sinks = opts.pop("return_lse", False), opts.pop("sinks", None)
    if opts.get("alibi_slopes") is not None:
        opts["alibi_slopes"] = read(opts["alibi_slopes"], "alibi_slopes")
    sink_t = None if sinks is None else _tensors(sinks)[0]
    plan = (ring_forward, ring_attention_vjp, (), opts)
    out, lse = _run(_tensors(q, k, v), sink_t, plan)
    return (out, lse) if return_lse else out


def ring_attention_varlen(q: Any, k: Any, v: Any, cu_seqlens: Any, **opts: Any) -> Any:
    """:func:`~qkv.distributed.ring_attention_varlen` on tensors, with autograd."""
    return_lse = opts.pop("return_lse", False)
    plan = (varlen_forward, ring_attention_varlen_vjp, (cu_seqlens,), opts)
    out, lse = _run(_tensors(q, k, v), None, plan)
    return (out, lse) if return_lse else out


def _run(tensors: tuple[Any, ...], sinks: Any, plan: tuple) -> tuple[Any, Any]:
    """``(out, lse)`` of a ring ``plan`` (``(forward, vjp, positional extras, keywords)``):
    through the autograd function when a gradient is wanted, else straight on the arrays."""
    import torch

    wanted = [*tensors, *(() if sinks is None else (sinks,))]
    if torch.is_grad_enabled() and any(t.requires_grad for t in wanted):
        return _function().apply(*tensors, sinks, plan)
    forward, _, extra, opts = plan
    arrays = _arrays(*tensors)
    kw = {} if sinks is None else {"sinks": read(sinks, "sinks")}
    o, m = forward(*arrays, *extra, **kw, **opts)
    o = o.astype(np.result_type(*arrays), copy=False)  # rounded once, at the end
    return give_pair(o, m, want_of(*tensors))


@cache
def _function() -> Any:  # a torch.autograd.Function subclass (torch is optional)
    import torch

    class RingAttention(torch.autograd.Function):
        """Forward: the ring; backward: its VJP (the ring again), on the saved shards."""

        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any, sinks: Any, plan: Any) -> Any:
            forward, _, extra, opts = plan
            arrays = _arrays(q, k, v)
            kw = {} if sinks is None else {"sinks": read(sinks, "sinks")}
            out, lse = forward(*arrays, *extra, **kw, **opts)
            ctx.save_for_backward(q, k, v, *(() if sinks is None else (sinks,)))
            ctx.plan, ctx.acc = plan, (out, lse)  # unrounded, for the backward
            want = want_of(q, k, v)
            out_t = give(out.astype(np.result_type(*arrays)), want)  # a copy: ctx keeps out
            lse_t = give(lse.copy(), want, exact=True)
            ctx.mark_non_differentiable(lse_t)
            return out_t, lse_t

        @staticmethod
        def backward(ctx: Any, grad_out: Any, grad_lse: Any) -> Any:
            saved = ctx.saved_tensors
            out, lse = ctx.acc
            _, vjp, extra, opts = ctx.plan
            opts = {key: val for key, val in opts.items() if key != "stats"}
            sinks = saved[3] if len(saved) > 3 else None
            kw = {} if sinks is None else {"sinks": read(sinks, "sinks")}
            g = read(grad_out, "grad_out")
            grads = vjp(*_arrays(*saved[:3]), g, out, lse, *extra, **kw, **opts)
            # every rank must join the ring, so all are computed even if one is unneeded
            back = [as_dtype(g, t) for g, t in zip(grads, saved, strict=False)]
            return (*back[:3], back[3] if sinks is not None else None, None)

    return RingAttention


def decode(q: Any, k: Any, v: Any, **opts: Any) -> Any:
    """:func:`~qkv.distributed.decode` on tensors (no autograd); ``opts`` are its keywords."""
    return_lse = opts.pop("return_lse", False)
    tensors = _tensors(q, k, v)
    out, lse = np_decode(*_arrays(*tensors), return_lse=True, **opts)
    want = want_of(*tensors)
    return give_pair(out, np.asarray(lse), want) if return_lse else give(out, want)
