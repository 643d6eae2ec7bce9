""":func:`qkv.attention` for tensors on a GPU: check, reshape, run the Triton kernels.

:mod:`qkv.front` sends here every call whose ``q``, ``k``, ``v`` or ``mask`` lies
on a device other than the CPU. Arguments are checked by :func:`qkv.validate.make_plan` on
zero-stride NumPy stand-ins of the tensors' shapes (no data is copied to the host), so the
errors and the semantics are those of every other path: bottom-right causal, windows, grouped
heads without repeating K/V, bool masks (``True`` = may attend) and float biases broadcast to
the scores, rows with no visible key → output 0 and lse ``-inf``, float16/bfloat16 computed
with float32 accumulation. The batch dimensions are flattened to ``(Z, H)`` views; autograd
sums gradients over broadcast dimensions as usual.

What the kernels do not cover falls back to qkv's CPU path (the tensors are copied to the
host and the result back, gradients included) with a :class:`GpuFallbackWarning` saying why:

- dtypes other than float16, bfloat16 and float32, or inputs of mixed dtypes;
- ``d`` or ``dv`` above 256;

Refused with :class:`qkv.InputError`, as on the CPU path: a float mask that requires grad;
and here also tensors on devices other than CUDA, or on several devices.

Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton is first imported) runs the
same kernels on CPU tensors; :func:`attention` accepts CPU tensors only then, which is how
the kernels are tested on machines without a GPU.
"""

from __future__ import annotations

import warnings
from functools import cache
from typing import Any

import numpy as np
import torch

from .. import torch_bridge
from ..errors import InputError
from ..validate import make_plan
from . import launch

__all__ = ["GpuFallbackWarning", "attention"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_GPU_KERNELS = {"auto": "auto", "dense": "prefill", "tiled": "prefill", "decode": "decode"}


class GpuFallbackWarning(UserWarning):
    """A GPU call that the Triton kernels do not cover ran on qkv's CPU path instead."""


def _shadow(x: Any) -> Any:
    """A zero-stride NumPy array with ``x``'s shape (float32, or bool for a bool tensor)."""
    if not isinstance(x, torch.Tensor):
        return x
    if x.dtype == torch.bool:
        dtype = np.bool_
    elif x.is_floating_point():
        dtype = np.float32
    else:  # integers, complex: make_plan names what it refuses
        dtype = np.complex64 if x.is_complex() else np.int64
    return np.broadcast_to(np.zeros((), dtype=dtype), tuple(x.shape))


def _device(q: Any, k: Any, v: Any, mask: Any) -> torch.device:
    named = [(n, t) for n, t in zip(("q", "k", "v", "mask"), (q, k, v, mask), strict=True)]
    tensors = [(n, t) for n, t in named if isinstance(t, torch.Tensor)]
    for n, t in tensors:
        if t.device.type not in ("cuda", "cpu"):
            raise InputError(
                f"{n}: tensors on device {t.device} are not supported (shape "
                f"{tuple(t.shape)}); qkv's GPU kernels run on CUDA devices, so move them with "
                ".cuda() or .cpu()"
            )
    devices = {t.device for _, t in tensors}
    if len(devices) > 1 or any(n != "mask" and not isinstance(t, torch.Tensor) for n, t in named):
        where = ", ".join(
            f"{n} on {t.device}" if isinstance(t, torch.Tensor) else f"{n} not a tensor"
            for n, t in named
            if t is not None
        )
        raise InputError(f"q, k, v, mask: must be tensors on one device, got {where}")
    dev = next(iter(devices))
    if dev.type == "cpu":
        from . import _kernels

        if not _kernels.INTERPRETED:
            raise InputError(
                "q: CPU tensors reach the Triton kernels only under Triton's interpreter "
                "(TRITON_INTERPRET=1 before Triton is first imported); use qkv.attention instead"
            )
    return dev


def _fallback_reason(q: Any, k: Any, v: Any, mask: Any) -> str | None:
    dtypes = {q.dtype, k.dtype, v.dtype}
    if len(dtypes) > 1 or q.dtype not in _FLOATS:
        names = ", ".join(sorted(str(t).removeprefix("torch.") for t in dtypes))
        return f"dtypes {names} (the kernels take one of float16, bfloat16, float32)"
    if q.shape[-1] > launch.MAX_HEAD_DIM or v.shape[-1] > launch.MAX_HEAD_DIM:
        return f"head size d={q.shape[-1]}, dv={v.shape[-1]} above {launch.MAX_HEAD_DIM}"
    return None


def _on_cpu(x: Any) -> Any:
    return x.cpu() if isinstance(x, torch.Tensor) else x


def _fallback(reason: str, q: Any, k: Any, v: Any, mask: Any, **kw: Any) -> Any:
    """qkv's CPU path on host copies; the result (and its gradients) go back to the device."""
    warnings.warn(
        f"qkv.attention on {q.device}: {reason}; computed on the CPU instead",
        GpuFallbackWarning,
        stacklevel=4,
    )
    res = torch_bridge.attention(_on_cpu(q), _on_cpu(k), _on_cpu(v), mask=_on_cpu(mask), **kw)
    if isinstance(res, tuple):
        return tuple(r.to(q.device) for r in res)
    return res.to(q.device)


def _flatten(x: torch.Tensor, batch: tuple[int, ...], rows: int, cols: int) -> torch.Tensor:
    """``x`` broadcast to ``batch + (rows, cols)`` and viewed as ``(Z, H, rows, cols)``."""
    x = x.expand(*batch, rows, cols)
    h = batch[-1] if batch else 1
    return x.reshape(-1, h, rows, cols)


@cache
def _function() -> type:
    class TritonAttention(torch.autograd.Function):
        """Forward: the prefill/decode kernels; backward: the FlashAttention-2 kernels."""

        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any, mask: Any, bias: Any, cfg: Any) -> Any:
            opts, kernel = cfg
            out, lse = launch.forward(q, k, v, opts, mask, bias, kernel)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.opts, ctx.mask, ctx.bias = opts, mask, bias
            ctx.mark_non_differentiable(lse)
            return out, lse

        @staticmethod
        def backward(ctx: Any, grad_out: Any, grad_lse: Any) -> Any:
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv = launch.backward(q, k, v, out, lse, grad_out, ctx.opts, ctx.mask, ctx.bias)
            return dq, dk, dv, None, None, None

    return TritonAttention


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
) -> Any:
    """:func:`qkv.attention` on device tensors by the Triton kernels (differentiable).

    ``kernel``: ``"auto"`` picks decode (split-K) for few query rows per kv head, else
    prefill; ``"decode"`` forces split-K; ``"dense"``/``"tiled"`` force prefill. All give the
    same numbers up to rounding. The lse is float32 and carries no gradient.
    """
    if kernel not in _GPU_KERNELS:
        raise InputError(f"kernel: expected one of {tuple(_GPU_KERNELS)}, got {kernel!r}")
    dev = _device(q, k, v, mask)
    if mask is not None and not isinstance(mask, torch.Tensor):  # an array or list
        mask = torch.as_tensor(np.asarray(mask), device=dev)
    kw = {
        "scale": scale,
        "causal": causal,
        "window": window,
        "return_lse": return_lse,
        "check_finite": check_finite,
    }
    reason = _fallback_reason(q, k, v, mask)
    if reason is not None:
        return _fallback(reason, q, k, v, mask, **kw)
    plan = make_plan(
        _shadow(q), _shadow(k), _shadow(v), scale=scale, causal=causal, mask=_shadow(mask),
        window=window,
    )  # fmt: skip
    if check_finite:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not bool(torch.isfinite(t).all()):
                raise InputError(f"{name}: contains NaN or infinity (shape {tuple(t.shape)})")
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if isinstance(mask, torch.Tensor) and mask.requires_grad and wants_grad:
        raise InputError(
            f"mask: qkv gives no gradient for a float mask (shape {tuple(mask.shape)}); "
            "detach it, or compute its gradient with PyTorch's own attention"
        )
    batch, L, S, d, dv = plan.batch, plan.L, plan.S, plan.d, plan.dv
    hkv = batch[-1] // plan.group if batch else 1
    kv_batch = batch[:-1] + (hkv,) if batch else batch
    q4 = _flatten(q.unsqueeze(0) if plan.squeeze else q, batch, L, d)
    k4 = _flatten(k, kv_batch, S, d)
    v4 = _flatten(v, kv_batch, S, dv)
    mask4 = bias4 = None
    if isinstance(mask, torch.Tensor):
        shape = (plan.mask if plan.mask is not None else plan.bias).shape
        m4 = _flatten(mask.detach().reshape(shape), batch, L, S)
        if mask.dtype == torch.bool:
            mask4 = m4
        else:
            bias4 = m4 if m4.is_floating_point() else m4.float()
    left, right = plan.window if plan.window is not None else (None, None)
    opts = launch.Options(plan.scale, plan.causal, left, right, plan.group)
    cfg = (opts, _GPU_KERNELS[kernel])
    if kernel == "auto" or _GPU_KERNELS[kernel] == "decode":
        if plan.group * L > launch.DECODE_MAX_ROWS:
            cfg = (opts, "prefill")
    if wants_grad:
        out4, lse3 = _function().apply(q4, k4, v4, mask4, bias4, cfg)
    else:
        with torch.no_grad():
            out4, lse3 = launch.forward(q4, k4, v4, opts, mask4, bias4, cfg[1])
    out = out4.reshape(*batch, L, dv)
    lse = lse3.reshape(*batch, L)
    if plan.squeeze:
        out, lse = out[..., 0, :], lse[..., 0]
    return (out, lse) if return_lse else out
