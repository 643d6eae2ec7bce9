"""Native bfloat16 attention: the fused prefill, its backward and the packed varlen walk with
every tile product on ``vdpbf16ps`` (``native_src/forward_bf16.cpp``, ``backward_bf16.cpp``).

Must equal :func:`qkv.reference.attention` applied to the same bfloat16 numbers, up to one
more rounding: the weights (and in the backward their gradients) are rounded to bfloat16 for
the products that take them, as FlashAttention and PyTorch's own bfloat16 kernels do.
Scores, the running max and sum, the accumulators and ``lse`` are float32; ``out`` is
rounded to bfloat16 once, the gradients are float32.

When it runs (the router's conditions, :mod:`qkv.engine.kernels.router`): a problem whose
queries, keys and values are all bfloat16 (K and V read in place from
:attr:`~qkv.validate.Plan.stored`, or the packed arrays as given), causal or windowed or
neither, with grouped heads and sinks, a boolean mask or a float bias (not in the packed
walk), no score variant, an even head size, on a CPU with AVX-512 and
AVX512_BF16. ``QKV_NATIVE_ISA`` naming a clone
(``avx512`` and narrower) forces the widening road instead: K and V widened to float32 for
the float32 kernels, as on a CPU without the instruction. Threads: work items are (head, 64
query rows), or (kv head, 64 keys) in the backward, on as many threads as
:func:`~qkv.engine.kernels.threads.workers` gives (no BLAS is involved).

Examples
--------
>>> import numpy as np, ml_dtypes
>>> from qkv.validate import make_plan
>>> x = np.arange(8.0).reshape(4, 2).astype(ml_dtypes.bfloat16)
>>> plan = make_plan(x, x, x, causal=True, keep_stored=True)
>>> if available():
...     out, lse = attend(plan)
... else:  # no AVX512_BF16 here: the float32 kernels give the same numbers
...     from qkv.engine.kernels import tiled
...     out, lse = tiled.attend(plan.materialized())
>>> out[0].tolist()
[0.0, 1.0]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...validate import Plan
from .native_lib import (
    BF16_ISA,
    BackwardArgs,
    PrefillArgs,
    address,
    backward_operands,
    bf16_products,
    invoke,
    mask_operand,
    prefill_operands,
)
from .threads import workers

__all__ = [
    "ISA",
    "attend",
    "available",
    "backward",
]

ISA = BF16_ISA  # the clone code above AVX-512: AVX-512 with AVX512_BF16


def available() -> bool:
    """Whether the library is built and on, this CPU has AVX512_BF16 and no narrower clone
    is forced (``QKV_NATIVE_ISA``): :func:`~qkv.engine.kernels.native_lib.bf16_products`."""
    return bf16_products()[0]


def attend(plan: Plan, *, threads: int | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """Output ``(*batch, L, dv)`` in bfloat16 and lse ``(*batch, L)`` in float32, for a plan
    that the router sends here; ``None`` when some output is not finite (infinite or NaN
    inputs: the caller's general path applies its rules to those).

    Parameters
    ----------
    plan : Plan
        A checked bfloat16 problem with its K/V stored (``make_plan(..., keep_stored=True)``).
    threads : int, optional
        Worker threads (default: :func:`~qkv.engine.kernels.threads.workers`).
    """
    assert plan.stored is not None and plan.v is not None  # the router asks for them
    batch, L, dv = plan.batch, plan.L, plan.dv
    out = np.empty(batch + (L, dv), dtype=plan.stored[1].dtype)
    lse = np.empty(batch + (L,), dtype=np.float32)
    nb = int(np.prod(batch, dtype=np.int64))
    if nb == 0:
        return out, lse
    fields, arrays = prefill_operands(plan.q, *plan.stored_kv(), plan.group)
    masking, masks = mask_operand(plan.mask, plan.bias, batch + (L, plan.S))
    args = PrefillArgs(
        nb=nb, L=L, S=plan.S, d=plan.d, dv=dv, out=address(out), lse=address(lse),
        **fields, **masking, **_rule(plan, threads),
    )  # fmt: skip
    status = invoke("qkv_prefill_bf16", args, "bfloat16 prefill", allowed=(3,))
    del arrays, masks  # what the call read
    return None if status == 3 else (out, lse)


def backward(
    plan: Plan,
    d_out: np.ndarray,
    forward: tuple[np.ndarray, np.ndarray],
    *,
    threads: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The FlashAttention-2 backward with bfloat16 tile products: ``(dq, dk, dv)`` in float32,
    in the plan's shapes of q, k and v, for a plan the router sends here.

    ``d_out`` is ``(*batch, L, dv)`` and ``forward`` the forward's ``(out, lse)``: ``out``
    bfloat16 (the kernel then takes ``rowsum(dO ∘ O)`` from it) or float32, ``lse`` float32.
    ``d_out`` is rounded to bfloat16 (a bfloat16 model's gradients are), and the weights and
    their gradients are rounded for the last three products, as in PyTorch's bfloat16
    backward.
    """
    assert plan.stored is not None and plan.v is not None  # the router asks for them
    f32, bf16 = np.dtype(np.float32), plan.stored[0].dtype
    dq = np.zeros(plan.q.shape, dtype=f32)
    dk = np.zeros(plan.k.shape, dtype=f32)
    dvv = np.zeros(plan.v.shape, dtype=f32)
    if int(np.prod(plan.batch, dtype=np.int64)) == 0:
        return dq, dk, dvv
    q = plan.q.astype(bf16)  # exact: q holds bfloat16 values
    out = forward[0]
    fields, arrays = backward_operands(
        q, *plan.stored_kv(), (d_out, *forward), bf16, f32, delta_from_out=out.dtype == bf16
    )
    masking, masks = mask_operand(plan.mask, plan.bias, plan.batch + (plan.L, plan.S))
    args = BackwardArgs(
        group=plan.group, L=plan.L, S=plan.S, d=plan.d, dv=plan.dv, **fields, **masking,
        dq=address(dq), dk=address(dk), dvo=address(dvv), **_rule(plan, threads),
    )  # fmt: skip
    invoke("qkv_backward_bf16", args, "bfloat16 backward")
    del arrays, masks  # what the call read
    return dq, dk, dvv


def _rule(plan: Plan, threads: int | None) -> dict[str, Any]:
    """The fields both structs take from the plan and the call: scale, visibility, threads and
    the clone (the bfloat16 one)."""
    left, right = plan.window if plan.window is not None else (None, None)
    return {
        "scale": plan.scale,
        "causal": int(plan.causal),
        "left": -1 if left is None else left,
        "right": -1 if right is None else right,
        "threads": workers(threads),
        "isa": ISA,
    }
