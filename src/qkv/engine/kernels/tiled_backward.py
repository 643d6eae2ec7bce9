"""Tiled attention backward (the FlashAttention-2 backward): O(block²) extra memory.

Must equal :func:`qkv.engine.grad.reference_attention_vjp`. The ``L × S`` weight matrix is never
built: each ``(query block, key block)`` tile of weights is recomputed from the scores and the
rows' saved log-sum-exp, ``P = exp(Z − lse)``, and used at once::

    for each key block j:                       # dk_j, dv_j accumulate in place
        for each query block i:
            P   = exp(q_i k_jᵀ · scale − lse_i)    # masked entries and empty rows give 0
            dv_j += Pᵀ dO_i
            dP  = dO_i v_jᵀ
            dZ  = P ∘ (dP − δ_i) · scale         # δ = rowsum(dO ∘ O), computed once
            dq_i += dZ k_j
            dk_j += dZᵀ q_i

Variants: the tile's scores go through :func:`qkv.engine.kernels.mods.apply` as in the forward pass;
with ``softcap`` the chain rule adds the factor ``1 − tanh²(s / c)`` to ``dZ``. Sinks need
nothing here: ``lse`` and ``O`` already include them (``dZ`` is the same formula), and their own
gradient is taken from ``δ`` by :func:`qkv.attention_vjp`.

Tiles that causal or a window rule out entirely are skipped. Grouped query heads are served by
viewing ``(Hq, rows)`` as ``(Hkv, group · rows)``, so k and v are never repeated. When the
forward pass's output and lse are not supplied, the tiled forward kernel
(:mod:`qkv.engine.kernels.tiled`) recomputes them. Where the router picks it, the same loop
runs in C++ instead (:func:`qkv.engine.kernels.native.backward`).
"""

from __future__ import annotations

import numpy as np

from ...masks import allowed, query_positions
from ...validate import Plan
from . import mods
from .blocks import grouped_matmul, grouped_matmul_t

__all__ = ["backward"]


def _tile(m: np.ndarray, rows: range, cols: range) -> np.ndarray:
    """The ``rows × cols`` tile of a mask or bias that may broadcast along either axis."""
    r = slice(None) if m.shape[-2] == 1 else slice(rows.start, rows.stop)
    c = slice(None) if m.shape[-1] == 1 else slice(cols.start, cols.stop)
    return m[..., r, c]


def _logits(plan: Plan, rows: range, cols: range) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Scaled, modified, biased, masked scores of one tile (``None`` when the tile is entirely
    masked) and, with ``softcap``, the derivative ``1 − tanh²`` of the cap."""
    ok = allowed(plan.L, plan.S, causal=plan.causal, window=plan.window, rows=rows, cols=cols)
    if ok is not None and not ok.any():
        return None, None
    qi = plan.q[..., rows.start : rows.stop, :]
    kj = plan.k[..., cols.start : cols.stop, :]
    s = grouped_matmul(qi, np.swapaxes(kj, -1, -2), plan.group)
    s *= plan.acc_dtype.type(plan.scale)
    dcap = None
    if plan.softcap is not None:
        dcap = mods.cap_slope(s, plan.softcap)
    if plan.modded:
        qi = query_positions(plan.L, plan.S, rows)[:, None]
        s = mods.apply(plan, s, ..., qi, np.arange(cols.start, cols.stop)[None, :])
    if plan.bias is not None:
        s += _tile(plan.bias, rows, cols)
    if plan.mask is not None:
        m = _tile(plan.mask, rows, cols)
        ok = m if ok is None else ok & m
    if ok is not None:
        s = np.where(ok, s, plan.acc_dtype.type(-np.inf))
    return s, dcap


def backward(
    plan: Plan, d_out: np.ndarray, out: np.ndarray, lse: np.ndarray, block: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dq, dk, dv)`` in the plan's broadcast shapes, from ``dO``, ``O`` and ``lse``.

    ``d_out`` and ``out`` are ``(*batch, L, dv)``, ``lse`` is ``(*batch, L)``; all in the
    accumulation dtype. :func:`qkv.engine.kernels.dispatch.backward` runs this or, where the
    router picks it, the native library's fused version of this loop.
    """
    plan = plan.materialized()
    d_out = d_out.astype(plan.acc_dtype, copy=False)
    acc, g = plan.acc_dtype, plan.group
    scale = acc.type(plan.scale)
    delta = np.sum(d_out * out, axis=-1, keepdims=True)  # (*batch, L, 1)
    # an empty row has lse = -inf: exp(Z - inf) = 0 keeps it out of every gradient
    lse_safe = np.where(lse == -np.inf, np.inf, lse)[..., None].astype(acc, copy=False)
    dq = np.zeros(plan.q.shape, dtype=acc)
    dk = np.zeros(plan.k.shape, dtype=acc)
    assert plan.v is not None  # gradients need the forward's values
    dv = np.zeros(plan.v.shape, dtype=acc)
    for j0 in range(0, plan.S, block):
        cols = range(j0, min(j0 + block, plan.S))
        kj = plan.k[..., j0 : cols.stop, :]
        vj = plan.v[..., j0 : cols.stop, :]
        for i0 in range(0, plan.L, block):
            rows = range(i0, min(i0 + block, plan.L))
            s, dcap = _logits(plan, rows, cols)
            if s is None:
                continue
            r = slice(i0, rows.stop)
            p = np.exp(s - lse_safe[..., r, :])
            do_i = d_out[..., r, :]
            dv[..., j0 : cols.stop, :] += grouped_matmul_t(p, do_i, g)
            dp = grouped_matmul(do_i, np.swapaxes(vj, -1, -2), g)
            dz = p * (dp - delta[..., r, :])
            if dcap is not None:
                dz *= dcap
            dz *= scale
            dq[..., r, :] += grouped_matmul(dz, kj, g)
            dk[..., j0 : cols.stop, :] += grouped_matmul_t(dz, plan.q[..., r, :], g)
    return dq, dk, dv
