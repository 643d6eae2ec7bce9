"""CPU tensors in, tensors out for :mod:`qkv.distributed`, with autograd.

``out = ring_attention(q, k, v, ...)`` on tensors that require grad runs through a
:class:`torch.autograd.Function` whose backward is :func:`ring_attention_vjp` on the same shards
(saved at the forward, so the backward can never see other K/V), with the forward's ``out`` and
``lse`` kept in the accumulation dtype. Gradients come back in each input's own dtype.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np

from ..tensors import as_dtype, give, read, want_of
from .decode import decode as np_decode
from .ring import RingStats, ring_attention_vjp, ring_forward

__all__ = ["decode", "ring_attention"]


def _arrays(q: Any, k: Any, v: Any) -> tuple[Any, Any, Any]:
    return read(q, "q"), read(k, "k"), read(v, "v")


def ring_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    comm: Any,
    causal: bool,
    scale: Any,
    layout: str,
    return_lse: bool,
    stats: RingStats | None,
) -> Any:
    import torch

    opts = {"comm": comm, "causal": causal, "scale": scale, "layout": layout, "stats": stats}
    tensors = tuple(x if isinstance(x, torch.Tensor) else torch.as_tensor(x) for x in (q, k, v))
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        out, lse = _function().apply(*tensors, opts)
    else:
        arrays = _arrays(*tensors)
        o, m = ring_forward(*arrays, **opts)
        o = o.astype(np.result_type(*arrays), copy=False)  # rounded once, at the end
        out, lse = give(o, want_of(*tensors)), give(m, want_of(*tensors), exact=True)
    return (out, lse) if return_lse else out


@cache
def _function() -> Any:  # a torch.autograd.Function subclass (torch is optional)
    import torch

    class RingAttention(torch.autograd.Function):
        """Forward: the ring; backward: :func:`ring_attention_vjp` (the ring again)."""

        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any, opts: Any) -> Any:
            arrays = _arrays(q, k, v)
            out, lse = ring_forward(*arrays, **opts)
            ctx.save_for_backward(q, k, v)
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
            opts = {key: ctx.opts[key] for key in ("comm", "causal", "scale", "layout")}
            grads = ring_attention_vjp(
                *_arrays(*saved), read(grad_out, "grad_out"), out, lse, **opts
            )
            # every rank must join the ring, so all three are computed even if one is unneeded
            return (*(as_dtype(g, t) for g, t in zip(grads, saved, strict=True)), None)

    return RingAttention


def decode(q: Any, k: Any, v: Any, *, comm: Any, scale: Any, return_lse: bool) -> Any:
    import torch

    tensors = tuple(x if isinstance(x, torch.Tensor) else torch.as_tensor(x) for x in (q, k, v))
    arrays = _arrays(*tensors)
    out, lse = np_decode(*arrays, comm=comm, scale=scale, return_lse=True)
    want = want_of(*tensors)
    return (
        (give(out, want), give(np.asarray(lse), want, exact=True))
        if return_lse
        else give(out, want)
    )
