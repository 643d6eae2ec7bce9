""":func:`qkv.attention` for tensors on a GPU: check, reshape, run the Triton kernels.

:mod:`qkv.front` sends here every checked call (:class:`qkv.call.Call`) whose tensors lie
on a device other than the CPU. The call was checked once, by :func:`qkv.validate.make_plan` on
zero-stride NumPy stand-ins of the tensors' shapes (no data is copied to the host), so the
errors and the semantics are those of every other path: bottom-right causal, windows, grouped
heads without repeating K/V, bool masks (``True`` = may attend) and float biases broadcast to
the scores, rows with no visible key → output 0 and lse ``-inf``, float16/bfloat16 computed
with float32 accumulation. The batch dimensions are flattened to ``(Z, H)`` views; autograd
sums gradients over broadcast dimensions as usual.

What the kernels do not cover falls back to qkv's CPU path (the tensors are copied to the
host and the result back, gradients included) with a :class:`GpuFallbackWarning` saying why:

- :func:`qkv.attention_weights` and :func:`qkv.scores` (the kernels compute the output);
- the variants (``softcap``, ``sinks``, ``alibi_slopes``, ``score_mod``, ``mask_mod``);
- dtypes other than float16, bfloat16 and float32, or inputs of mixed dtypes;
- ``d`` or ``dv`` above 256;

Refused with :class:`qkv.InputError`, as on the CPU path: a float mask that requires grad;
and here also tensors on devices other than CUDA, or on several devices.

Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton is first imported) runs the
same kernels on CPU tensors; :func:`run` accepts CPU tensors only then, which is how
the kernels are tested on machines without a GPU.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from functools import cache
from typing import Any, cast

import numpy as np
import torch

from .. import torch_bridge
from ..call import Call, build
from ..engine import run as core
from ..errors import InputError
from ..tensors import give, give_pair, one_device
from ..validate import VARIANTS
from . import launch

__all__ = ["GpuFallbackWarning", "attention", "run"]

#: The plan's field for each variant keyword (the others have the keyword's name).
_PLAN_FIELD = {"alibi_slopes": "alibi"}

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_GPU_KERNELS = {"auto": "auto", "dense": "prefill", "tiled": "prefill", "decode": "decode"}


class GpuFallbackWarning(UserWarning):
    """A GPU call that the Triton kernels do not cover ran on qkv's CPU path instead."""


def _device(call: Call) -> torch.device:
    return one_device(call.given)


def _check_interpreted(dev: torch.device) -> None:
    if dev.type == "cpu":
        from . import _kernels

        if not _kernels.INTERPRETED:
            raise InputError(
                "q: CPU tensors reach the Triton kernels only under Triton's interpreter "
                "(TRITON_INTERPRET=1 before Triton is first imported); use qkv.attention instead"
            )


def _fallback_reason(call: Call) -> str | None:
    plan = call.plan
    if call.fn != "attention":
        return f"{call.fn} (the kernels compute attention's output)"
    used = [name for name in VARIANTS if getattr(plan, _PLAN_FIELD.get(name, name)) is not None]
    if used:
        return f"{', '.join(used)} (the kernels take none of the variants)"
    q, k, v = (call.given[n] for n in "qkv")
    dtypes = {q.dtype, k.dtype, v.dtype}
    if len(dtypes) > 1 or q.dtype not in _FLOATS:
        names = ", ".join(sorted(str(t).removeprefix("torch.") for t in dtypes))
        return f"dtypes {names} (the kernels take one of float16, bfloat16, float32)"
    if q.shape[-1] > launch.MAX_HEAD_DIM or v.shape[-1] > launch.MAX_HEAD_DIM:
        return f"head size d={q.shape[-1]}, dv={v.shape[-1]} above {launch.MAX_HEAD_DIM}"
    return None


def _fallback(reason: str, call: Call) -> Any:
    """qkv's CPU path on host copies; the results (and their gradients) go back to the device.

    The host copies are a new call, checked again (the device call was checked on the
    tensors' shapes; this one reads their values).
    """
    dev = next(t.device for t in call.given.values() if isinstance(t, torch.Tensor))
    warnings.warn(
        f"qkv.{call.fn} on {dev}: {reason}; computed on the CPU instead",
        GpuFallbackWarning,
        stacklevel=4,
    )
    host = {n: x.cpu() if isinstance(x, torch.Tensor) else x for n, x in call.given.items()}
    options = call.options.replace(
        mask=host["mask"], sinks=host.get("sinks"), alibi_slopes=host.get("alibi_slopes")
    )
    cpu = build(
        call.fn, host["q"], host["k"], host["v"], options, return_lse=call.return_lse,
        check_finite=call.check_finite, kernel=call.kernel,
    )  # fmt: skip
    if cpu.route == "autograd":
        res = torch_bridge.run(cpu)
    elif cpu.return_lse:
        out, lse = core.run(cpu.fn, cpu.plan, cpu.kernel, cpu.return_lse)
        res = give_pair(out, lse, cpu.want)
    else:
        res = give(core.run(cpu.fn, cpu.plan, cpu.kernel, cpu.return_lse), cpu.want)
    if isinstance(res, tuple):
        return tuple(r.to(dev) for r in res)
    return res.to(dev)


def _flatten(x: torch.Tensor, batch: tuple[int, ...], rows: int, cols: int) -> torch.Tensor:
    """``x`` broadcast to ``batch + (rows, cols)`` and viewed as ``(Z, H, rows, cols)``."""
    x = x.expand(*batch, rows, cols)
    h = batch[-1] if batch else 1
    return x.reshape(-1, h, rows, cols)


@cache
def _function() -> Any:  # a torch.autograd.Function subclass (torch is optional)
    class TritonAttention(torch.autograd.Function):
        """Forward: the prefill/decode kernels; backward: the FlashAttention-2 kernels."""

        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any, opts: Any, kernel: str) -> Any:
            out, lse = launch.forward(q, k, v, opts, kernel)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.opts = opts  # with the detached mask or bias, which get no gradient
            ctx.mark_non_differentiable(lse)
            return out, lse

        @staticmethod
        def backward(ctx: Any, grad_out: Any, grad_lse: Any) -> Any:
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv = launch.backward(q, k, v, out, lse, grad_out, ctx.opts)
            return dq, dk, dv, None, None

    return TritonAttention


def run(call: Call) -> Any:
    """A checked call on device tensors, by the Triton kernels (differentiable).

    ``kernel``: ``"auto"`` picks decode (split-K) for few query rows per kv head, else
    prefill; ``"decode"`` forces split-K; ``"dense"``/``"tiled"`` force prefill. All give the
    same numbers up to rounding. The lse is float32 and carries no gradient.
    """
    dev = _device(call)
    reason = _fallback_reason(call)
    if reason is not None:
        return _fallback(reason, call)
    _check_interpreted(dev)
    plan = call.plan
    q, k, v, mask = (call.given[n] for n in ("q", "k", "v", "mask"))
    if mask is not None and not isinstance(mask, torch.Tensor):  # an array or list
        mask = torch.as_tensor(np.asarray(mask), device=dev)
    if call.check_finite:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not bool(torch.isfinite(t).all()):
                raise InputError(f"{name}: contains NaN or infinity (shape {tuple(t.shape)})")
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    batch, L, S, d, dv = plan.batch, plan.L, plan.S, plan.d, plan.dv
    hkv = batch[-1] // plan.group if batch else 1
    kv_batch = batch[:-1] + (hkv,) if batch else batch
    q4 = _flatten(q.unsqueeze(0) if plan.squeeze else q, batch, L, d)
    k4 = _flatten(k, kv_batch, S, d)
    v4 = _flatten(v, kv_batch, S, dv)
    mask4 = bias4 = None
    if isinstance(mask, torch.Tensor):
        # a tensor mask was read into plan.mask (boolean) or plan.bias (additive)
        shape = (plan.mask if plan.mask is not None else cast(np.ndarray, plan.bias)).shape
        m4 = _flatten(mask.detach().reshape(shape), batch, L, S)
        if mask.dtype == torch.bool:
            mask4 = m4
        else:
            bias4 = m4 if m4.is_floating_point() else m4.float()
    left, right = plan.window if plan.window is not None else (None, None)
    opts = launch.Options(plan.scale, plan.causal, left, right, plan.group, mask4, bias4)
    kernel = _GPU_KERNELS[call.kernel]
    if kernel in ("auto", "decode") and plan.group * L > launch.DECODE_MAX_ROWS:
        kernel = "prefill"
    if wants_grad:
        out4, lse3 = _function().apply(q4, k4, v4, opts, kernel)
    else:
        with torch.no_grad():
            out4, lse3 = launch.forward(q4, k4, v4, opts, kernel)
    out = out4.reshape(*batch, L, dv)
    lse = lse3.reshape(*batch, L)
    if plan.squeeze:
        out, lse = out[..., 0, :], lse[..., 0]
    return (out, lse) if call.return_lse else out


def attention(q: Any, k: Any, v: Any, **options: Any) -> Any:
    """:func:`qkv.attention` forced onto the Triton kernels: for tensors on a GPU (what
    :func:`qkv.attention` does by itself) and, under Triton's interpreter, CPU tensors (how the
    kernels are tested without a GPU)."""
    return run(replace(build("attention", q, k, v, **options), route="device"))
