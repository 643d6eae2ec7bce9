"""Grouped heads sharing their K/V tiles in the native prefill: a short, unmasked problem's
query heads of one kv head run as one block of rows.

With ``g`` query heads per kv head and no causal rule, window or mask, every query row sees
every key, so the rows of the ``g`` heads can be stacked into one ``(g · L, d)`` block against
their kv head's keys: each key tile is then multiplied by ``g · L`` rows in one product instead
of ``g`` products of ``L`` rows (the per-product cost dominates short rows). Measured on 2 cores
against the heads run one by one: B8 H8 kv2 L = S = 16 d64 0.38 against 0.46 ms, B8 H12 kv3
L = S = 37 d32 0.92 against 1.10 ms (one thread each). Longer rows gain nothing
(:data:`MAX_ROWS`). Must equal :func:`qkv.reference.attention`, as the native prefill it calls.

Under a causal rule the rows of one position see the same keys, so the stack takes them
position by position (row ``r`` of a kv head's block: head ``r % group`` at position ``r //
group``): its rows' keys then grow with the row, as the kernel's pieces need. It does so for a
few rows against a cache (draft tokens, a short chunk:
:func:`qkv.engine.kernels.router.causal_rows_on_prefill`) and for causal prompts of
:data:`~qkv.engine.kernels.router.STACK_PROMPT_MIN_L` rows per head and more
(:func:`~qkv.engine.kernels.router.causal_prompt_stacks`: 3-17% faster there); a shorter square
causal prompt keeps its heads apart (stacked, B1 H8 kv2 L = S = 16..128 ran 1-14% slower, and
L = S = 120 d64 3-5% slower once each thread kept its tiles from call to call: with tiles made
afresh per call, its 480 stacked rows a block had cost it a page fault per 4 KiB of them, 2.9
times as long).
"""

from __future__ import annotations

import numpy as np

from ...validate import Plan
from . import native, router
from .native_lib import Kept

__all__ = [
    "MAX_ROWS",
    "attend",
    "attend_own",
    "attend_own_finite",
    "attend_stored_own",
    "keep_own",
    "keep_stored",
    "stacks",
]

#: Stacked rows (``group · L``) up to which the heads of a kv head run as one block.
MAX_ROWS = 512


def stacks(plan: Plan) -> bool:
    """Whether ``plan``'s query heads are stacked per kv head (see the module's text): with no
    causal rule (K/V in the compute dtype), or causal rows against a cache that the router
    gives the prefill (:func:`router.causal_rows_on_prefill`, K/V stored in 16 bits too), or a
    long causal prompt, a sliding window's too (:func:`router.causal_prompt_stacks`)."""
    if not (plan.group > 1 and plan.mask is None and plan.bias is None and len(plan.batch) >= 1):
        return False
    if router.causal_prompt_stacks(plan):
        return True
    if plan.window is not None or plan.group * plan.L > MAX_ROWS:
        return False
    return router.causal_rows_on_prefill(plan) if plan.causal else plan.stored is None


def attend(
    plan: Plan, counts: np.ndarray | None = None, products: str = "blas"
) -> tuple[np.ndarray, np.ndarray]:
    """The native prefill (:func:`qkv.engine.kernels.native.attend`, with its key ``counts``
    and tile ``products``) on ``plan``, its grouped heads stacked per kv head where
    :func:`stacks` says so."""
    return native.attend(plan, counts=counts, products=products, stack=stacks(plan))


def attend_own(plan: Plan, counts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """:func:`attend` on the library's own tile products (the router's "native prefill, own
    tiles")."""
    return attend(plan, counts, products="own")


def attend_own_finite(plan: Plan) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`attend_own`'s result when every output is finite, else None (the dispatcher's
    overflow rules then run): the short road a small call takes."""
    out, lse = attend(plan, products="own")
    return (out, lse) if np.isfinite(out).all() else None


def attend_stored_own(
    plan: Plan, counts: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`qkv.engine.kernels.native.attend_stored_own` (K/V stored in 16 bits), its heads
    stacked where :func:`stacks` says."""
    return native.attend_stored_own(plan, counts=counts, stack=stacks(plan))


def keep_stored(plan: Plan, q_like: np.ndarray | None = None) -> Kept | None:
    """:func:`attend_stored_own` kept for operands laid out as ``plan``'s
    (:func:`qkv.engine.kernels.native.keep`, ``q_like`` as there), its heads stacked where
    :func:`stacks` says."""
    return native.keep(plan, stack=stacks(plan), q_like=q_like)


def keep_own(plan: Plan) -> Kept | None:
    """:func:`attend_own_finite` kept for operands laid out as ``plan``'s
    (:func:`qkv.engine.kernels.native.keep`), its heads stacked where :func:`stacks` says."""
    return native.keep(plan, stack=stacks(plan))
