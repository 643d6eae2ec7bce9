"""CPU tensors in, tensors out for :mod:`qkv.distributed`, with autograd.

``out = ring_attention(q, k, v, ...)`` on tensors that require grad runs through a
:class:`torch.autograd.Function` whose backward is :func:`ring_attention_vjp` on the same shards
(saved at the forward, so the backward can never see other K/V), with the forward's ``out`` and
``lse`` kept in the accumulation dtype. Gradients come back in each input's own dtype.
"""

from __future__ import annotations

import inspect
from functools import cache
from typing import Any

import numpy as np

from ..options import NAMES
from ..tensors import as_dtype, give, give_pair, read, want_of
from .agree import DEFAULT_TIMEOUT
from .decode import decode as np_decode
from .ring import (
    RingStats,
    ring_attention_varlen_vjp,
    ring_attention_vjp,
    ring_forward,
    varlen_forward,
)
from .ring import (
    ring_attention as ring_signature,
)

__all__ = ["decode", "ring_attention", "ring_attention_varlen"]

#: The options of :func:`qkv.attention` the ring takes (read from its signature).
_RING_OPTIONS = frozenset(inspect.signature(ring_signature).parameters) & frozenset(NAMES)


def _arrays(q: Any, k: Any, v: Any) -> tuple[Any, Any, Any]:
    return read(q, "q"), read(k, "k"), read(v, "v")


def ring_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    comm: Any = None,
    layout: str = "zigzag",
    return_lse: bool = False,
    stats: RingStats | None = None,
    timeout: Any = DEFAULT_TIMEOUT,
    **options: Any,
) -> Any:
    """:func:`~qkv.distributed.ring_attention` on tensors, with autograd; ``options`` are its
    ``scale``, ``causal``, ``window`` and variants."""
    import torch

    for name in options:
        if name not in _RING_OPTIONS:  # as the NumPy ring's own signature refuses it
            raise TypeError(f"ring_attention() got an unexpected keyword argument {name!r}")
    sinks, alibi = options.pop("sinks", None), options.get("alibi_slopes")
    if alibi is not None:
        options["alibi_slopes"] = read(alibi, "alibi_slopes")
    opts = {"comm": comm, "layout": layout, "stats": stats, "timeout": timeout, **options}
    tensors = tuple(x if isinstance(x, torch.Tensor) else torch.as_tensor(x) for x in (q, k, v))
    sink_t = (
        None if sinks is None else torch.as_tensor(sinks) if not torch.is_tensor(sinks) else sinks
    )
    grads_wanted = [*tensors, *(() if sink_t is None else (sink_t,))]
    if torch.is_grad_enabled() and any(t.requires_grad for t in grads_wanted):
        out, lse = _function().apply(*tensors, sink_t, opts)
    else:
        arrays = _arrays(*tensors)
        sk = None if sink_t is None else read(sink_t, "sinks")
        o, m = ring_forward(*arrays, sinks=sk, **opts)
        o = o.astype(np.result_type(*arrays), copy=False)  # rounded once, at the end
        out, lse = give_pair(o, m, want_of(*tensors))
    return (out, lse) if return_lse else out


@cache
def _function() -> Any:  # a torch.autograd.Function subclass (torch is optional)
    import torch

    class RingAttention(torch.autograd.Function):
        """Forward: the ring; backward: :func:`ring_attention_vjp` (the ring again)."""

        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any, sinks: Any, opts: Any) -> Any:
            arrays = _arrays(q, k, v)
            sk = None if sinks is None else read(sinks, "sinks")
            out, lse = ring_forward(*arrays, sinks=sk, **opts)
            ctx.save_for_backward(q, k, v, *(() if sinks is None else (sinks,)))
            ctx.opts, ctx.acc = opts, (out, lse)  # unrounded, for the backward
            want = want_of(q, k, v)
            out_t = give(out.astype(np.result_type(*arrays)), want)  # a copy: ctx keeps out
            lse_t = give(lse.copy(), want, exact=True)
            ctx.mark_non_differentiable(lse_t)
            return out_t, lse_t

        @staticmethod
        def backward(ctx: Any, grad_out: Any, grad_lse: Any) -> Any:
            saved = ctx.saved_tensors
            out, lse = ctx.acc
            opts = {key: val for key, val in ctx.opts.items() if key != "stats"}
            sinks = saved[3] if len(saved) > 3 else None
            sk = None if sinks is None else read(sinks, "sinks")
            grads = ring_attention_vjp(
                *_arrays(*saved[:3]), read(grad_out, "grad_out"), out, lse, sinks=sk, **opts
            )
            # every rank must join the ring, so all are computed even if one is unneeded
            back = [as_dtype(g, t) for g, t in zip(grads, saved, strict=False)]
            return (*back[:3], back[3] if sinks is not None else None, None)

    return RingAttention


def ring_attention_varlen(q: Any, k: Any, v: Any, cu_seqlens: Any, **opts: Any) -> Any:
    """:func:`~qkv.distributed.ring_attention_varlen` on tensors, with autograd."""
    import torch

    return_lse = opts.pop("return_lse", False)
    tensors = tuple(x if isinstance(x, torch.Tensor) else torch.as_tensor(x) for x in (q, k, v))
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        out, lse = _varlen_function().apply(*tensors, cu_seqlens, opts)
    else:
        arrays = _arrays(*tensors)
        o, m = varlen_forward(*arrays, cu_seqlens, **opts)
        want = want_of(*tensors)
        out, lse = give_pair(o.astype(np.result_type(*arrays)), m, want)
    return (out, lse) if return_lse else out


@cache
def _varlen_function() -> Any:  # a torch.autograd.Function subclass (torch is optional)
    import torch

    class RingAttentionVarlen(torch.autograd.Function):
        """Forward: the packed ring; backward: :func:`ring_attention_varlen_vjp`."""

        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any, cu: Any, opts: Any) -> Any:
            arrays = _arrays(q, k, v)
            out, lse = varlen_forward(*arrays, cu, **opts)
            ctx.save_for_backward(q, k, v)
            ctx.cu, ctx.opts, ctx.acc = cu, opts, (out, lse)
            want = want_of(q, k, v)
            out_t = give(out.astype(np.result_type(*arrays)), want)
            lse_t = give(lse.copy(), want, exact=True)
            ctx.mark_non_differentiable(lse_t)
            return out_t, lse_t

        @staticmethod
        def backward(ctx: Any, grad_out: Any, grad_lse: Any) -> Any:
            saved = ctx.saved_tensors
            out, lse = ctx.acc
            opts = {key: val for key, val in ctx.opts.items() if key != "stats"}
            grads = ring_attention_varlen_vjp(
                *_arrays(*saved), read(grad_out, "grad_out"), out, lse, ctx.cu, **opts
            )
            return (*(as_dtype(g, t) for g, t in zip(grads, saved, strict=True)), None, None)

    return RingAttentionVarlen


def decode(q: Any, k: Any, v: Any, *, comm: Any, scale: Any, return_lse: bool, timeout: Any) -> Any:
    import torch

    tensors = tuple(x if isinstance(x, torch.Tensor) else torch.as_tensor(x) for x in (q, k, v))
    arrays = _arrays(*tensors)
    out, lse = np_decode(*arrays, comm=comm, scale=scale, return_lse=True, timeout=timeout)
    want = want_of(*tensors)
    return give_pair(out, np.asarray(lse), want) if return_lse else give(out, want)
