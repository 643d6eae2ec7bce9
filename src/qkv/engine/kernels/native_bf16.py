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
:func:`~qkv.engine.kernels.threads.workers` gives (no BLAS is involved); the prefill's and the
packed walk's on PyTorch's OpenMP team where PyTorch runs one
(:func:`~qkv.engine.kernels.threads.prefill_team`).

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

import math
from typing import Any

import numpy as np

from ...validate import Plan
from .env import setting
from .native_lib import (
    BF16_ISA,
    ISA_ENV,
    BackwardArgs,
    Kept,
    PrefillArgs,
    address,
    backward_operands,
    bf16_isa,
    bf16_products,
    call_at,
    checked,
    invoke,
    kept_for_q,
    library,
    mask_operand,
    output_rows,
    prefill_operands,
    rows_view,
)
from .threads import prefill_team, workers

__all__ = [
    "ISA",
    "attend",
    "available",
    "backward",
    "keep",
]

ISA = BF16_ISA  # the clone code above AVX-512: AVX-512 with AVX512_BF16


def available() -> bool:
    """Whether the library is built and on, this CPU has AVX512_BF16 and no narrower clone
    is forced (``QKV_NATIVE_ISA``): :func:`~qkv.engine.kernels.native_lib.bf16_products`."""
    return bf16_products()[0]


def attend(
    plan: Plan, *, threads: int | None = None, counts: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray] | None:
    """Output ``(*batch, L, dv)`` in bfloat16 and lse ``(*batch, L)`` in float32, for a plan
    that the router sends here; ``None`` when some output is not finite (infinite or NaN
    inputs: the caller's general path applies its rules to those).

    Parameters
    ----------
    plan : Plan
        A checked bfloat16 problem with its K/V stored (``make_plan(..., keep_stored=True)``).
    threads : int, optional
        Worker threads (default: :func:`~qkv.engine.kernels.threads.workers`).
    counts : ndarray, optional
        Keys per index of the first batch axis (a padding mask read as key counts,
        :mod:`~qkv.engine.kernels.key_counts`): row ``b`` attends keys ``[0, counts[b])``,
        the causal rule and windows still aligned to all ``S`` keys.
    """
    assert plan.stored is not None and plan.v is not None  # the router asks for them
    batch, L, dv = plan.batch, plan.L, plan.dv
    rows, out_fields, out_at = output_rows(batch, L, dv, plan.rows_first)
    swap = out_at is not None  # (out allocated rows first: its (*batch, L, dv) view given)
    out = np.empty(rows, plan.stored[1].dtype)
    lse = np.empty(batch + (L,), dtype=np.float32)
    nb = int(np.prod(batch, dtype=np.int64))
    if nb == 0:
        return rows_view(out, swap), lse
    fields, arrays = prefill_operands(plan.q, *plan.stored_kv(), plan.group)
    masking, masks = mask_operand(plan.mask, plan.bias, batch + (L, plan.S))
    per_head = None if counts is None else _per_head(counts, nb)
    args = PrefillArgs(
        nb=nb, L=L, S=plan.S, d=plan.d, dv=dv, out=address(out), lse=address(lse),
        counts=0 if per_head is None else address(per_head),
        **fields, **masking, **_rule(plan, threads, team=True), **out_fields,
    )  # fmt: skip
    status = invoke("qkv_prefill_bf16", args, "bfloat16 prefill", allowed=(3,))
    del arrays, masks, per_head, out_at  # what the call read
    return None if status == 3 else (rows_view(out, swap), lse)


def _per_head(counts: np.ndarray, nb: int) -> np.ndarray:
    """Each head's key count (the struct's ``counts``) from those of the first batch axis."""
    return np.ascontiguousarray(np.repeat(counts, nb // counts.size), dtype=np.int64)


def keep(
    plan: Plan, counted: bool = False, masked: bool = False, q_like: np.ndarray | None = None
) -> Kept | None:
    """A plain call's bfloat16 prefill kept for operands laid out as ``plan``'s (no mask or
    bias; q, K, V and the output bfloat16; q contiguous, or as ``q_like``): a function of
    ``(q, k, v)`` giving ``(out, None)`` (the log-sum-exp is not written: its callers read
    the output) with
    :func:`attend`'s bits, ``q`` read as the bfloat16 it is (the library's
    ``qkv_prefill_bf16io``) rather than widened to float32 first; None for operands of other
    strides, another clone (``QKV_NATIVE_ISA``) or thread team, or when an output is not
    finite (the caller then takes the general road). None where the kernel does not serve
    ``plan``'s operands as they are. With ``counted``, a function of ``(q, k, v, counts)``:
    ``counts`` the keys of each index of the first batch axis, as :func:`attend` takes them.
    With ``masked``, for a plan with a boolean mask or a float bias (one of them, no key
    counts), a function of ``(q, k, v, mask)``: each call's mask, of ``plan``'s layout, put in
    by the library (``qkv_prefill_mask_at``); None where the mask is not read in place.

    ``q_like``: the caller's bfloat16 q, whose layout the struct is kept for where it reads it
    in place (a transposed view, as a model or ``layout="blhd"`` gives it: the copy a
    contiguous q's struct needs took a fifth of B32 H12 L = S = 53 d32's time); else a
    contiguous q's.

    The struct is built once per shapes: a short bfloat16 call (B8 H12 L = S = 53 d64) spent
    as long widening q, allocating the copy and building the struct as in the kernel.
    """
    m = plan.mask if plan.mask is not None else plan.bias
    if (m is not None) != masked or (plan.mask is not None and plan.bias is not None):
        return None
    if plan.stored is None or (masked and (counted or plan.key_counts is not None)):
        return None
    if not available() or math.prod(plan.batch) == 0:
        return None
    k, v = plan.stored_kv()
    if np.dtype(plan.out_dtype) != k.dtype:
        return None
    return kept_for_q(lambda q: _keep(plan, counted, masked, q), q_like, plan.q.shape, k.dtype)


def _keep(plan: Plan, counted: bool, masked: bool, q: np.ndarray | None = None) -> Kept | None:
    """:func:`keep` for a q laid out as ``q`` (default: contiguous)."""
    m = plan.mask if plan.mask is not None else plan.bias
    k, v = plan.stored_kv()
    if q is None:
        q = np.empty(plan.q.shape, k.dtype)
    fields, arrays = prefill_operands(q, k, v, plan.group)
    if any(address(a) != address(b) for a, b in zip(arrays, (q, k, v), strict=False)):
        return None  # (an operand BLAS-style rows would copy: not kept)
    held: tuple[Any, ...] = arrays[3:]  # the offsets the struct points into
    masking: dict[str, Any] = {}
    if masked:
        masking, masks = mask_operand(plan.mask, plan.bias, plan.batch + (plan.L, plan.S))
        if masks[0] is None or m is None or address(masks[0]) != address(m):
            return None  # (a copy of the mask: not read in place)
        held = (*held, masks[1])
    rule = _rule(plan, None, team=True)
    nb = math.prod(plan.batch)
    out_shape, out_fields, out_at = output_rows(plan.batch, plan.L, plan.dv, plan.rows_first)
    held = (*held, out_at)
    swap = out_at is not None  # (out allocated rows first: its (*batch, L, dv) view given)
    args = PrefillArgs(nb=nb, L=plan.L, S=plan.S, d=plan.d, dv=plan.dv, **fields, **masking,
                       **rule, **out_fields)  # fmt: skip
    dtype = k.dtype
    # (lse NULL: not written, its callers read the output)
    at, kept = call_at(library()[0].qkv_prefill_bf16io, args, masked=masked)
    team = (rule["threads"], rule["parallel"])

    def run(q: int, k: int, v: int, extra: Any) -> Any:
        if (not masked and (extra is not None) != counted) or prefill_team(None, True) != team:
            return None
        out = np.empty(out_shape, dtype)
        if masked:
            status = at(q, k, v, address(out), address(extra))
        elif extra is None:
            status = at(q, k, v, address(out), None)
        else:
            per_head = _per_head(extra, nb)
            status = at(q, k, v, address(out), address(per_head))
        assert held is not None  # (kept alive with the struct)
        if status and checked(status, kept, "bfloat16 prefill", (3,)):
            return None
        return rows_view(out, swap), None

    return Kept(run, (q, k, v), setting(ISA_ENV), io=True)


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


def _rule(plan: Plan, threads: int | None, team: bool = False) -> dict[str, Any]:
    """The fields both structs take from the plan and the call: scale, visibility, threads and
    the clone (the bfloat16 one); with ``team`` (the prefill's struct) also the OpenMP team
    its work items run on (:func:`~qkv.engine.kernels.threads.prefill_team`: right after
    PyTorch's operations a short call on a pool of its own took 40% longer, B32 H8 L = S =
    53 d64 2.0 against 1.4 ms on 2 threads)."""
    left, right = plan.window if plan.window is not None else (None, None)
    rule = {
        "scale": plan.scale,
        "causal": int(plan.causal),
        "left": -1 if left is None else left,
        "right": -1 if right is None else right,
        "threads": workers(threads),
        "isa": bf16_isa(),
    }
    if team:
        rule["threads"], rule["parallel"] = prefill_team(threads, True)
    return rule
