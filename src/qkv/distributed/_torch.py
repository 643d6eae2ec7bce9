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

from ..torch_bridge import _as_tensor, _out_dtype, _tensor, _to_numpy
from .decode import decode as np_decode
from .ring import RingStats, ring_attention_vjp, ring_forward

__all__ = ["decode", "ring_attention"]


def _arrays(q: Any, k: Any, v: Any) -> tuple[Any, Any, Any]:
    return _to_numpy(q, "q"), _to_numpy(k, "k"), _to_numpy(v, "v")


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
    timeout: Any,
) -> Any:
    import torch

    opts = {
        "comm": comm,
        "causal": causal,
        "scale": scale,
        "layout": layout,
        "stats": stats,
        "timeout": timeout,
    }
    tensors = tuple(x if isinstance(x, torch.Tensor) else torch.as_tensor(x) for x in (q, k, v))
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        out, lse = _function().apply(*tensors, opts)
    else:
        o, m = ring_forward(*_arrays(*tensors), **opts)
        out = _as_tensor(o, _out_dtype(np.result_type(*_arrays(*tensors)), tensors))
        lse = _tensor(m)
    return (out, lse) if return_lse else out


@cache
def _function() -> type:
    import torch

    class RingAttention(torch.autograd.Function):
        """Forward: the ring; backward: :func:`ring_attention_vjp` (the ring again)."""

        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any, opts: Any) -> Any:
            arrays = _arrays(q, k, v)
            out, lse = ring_forward(*arrays, **opts)
            ctx.save_for_backward(q, k, v)
            ctx.opts, ctx.acc = opts, (out, lse)  # unrounded, for the backward
            lse_t = _tensor(lse.copy())
            ctx.mark_non_differentiable(lse_t)
            return _as_tensor(out, _out_dtype(np.result_type(*arrays), (q, k, v))), lse_t

        @staticmethod
        def backward(ctx: Any, grad_out: Any, grad_lse: Any) -> Any:
            saved = ctx.saved_tensors
            out, lse = ctx.acc
            keys = ("comm", "causal", "scale", "layout", "timeout")
            opts = {key: ctx.opts[key] for key in keys}
            grads = ring_attention_vjp(
                *_arrays(*saved), _to_numpy(grad_out, "grad_out"), out, lse, **opts
            )
            # every rank must join the ring, so all three are computed even if one is unneeded
            return (*(_as_tensor(g, t.dtype) for g, t in zip(grads, saved, strict=True)), None)

    return RingAttention


def decode(q: Any, k: Any, v: Any, *, comm: Any, scale: Any, return_lse: bool, timeout: Any) -> Any:
    import torch

    tensors = tuple(x if isinstance(x, torch.Tensor) else torch.as_tensor(x) for x in (q, k, v))
    arrays = _arrays(*tensors)
    out, lse = np_decode(*arrays, comm=comm, scale=scale, return_lse=True, timeout=timeout)
    out_t = _as_tensor(out, _out_dtype(out.dtype, tensors))
    return (out_t, _tensor(np.asarray(lse))) if return_lse else out_t
