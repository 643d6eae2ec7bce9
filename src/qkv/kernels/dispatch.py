"""Pick the kernel for a checked plan by its shape, or run the one the caller forces.

- ``"dense"``: the whole score matrix at once; fastest while ``L · S`` is small, and for a
  few queries against a K/V small enough to sit in the caches.
- ``"decode"``: few queries (``L <= DECODE_MAX_L``) against a large K/V (at least
  ``DECODE_MIN_BYTES``); memory-bound, streams K and V once, splits the keys over the cores
  when batch × heads are too few.
- ``"tiled"``: online-softmax prefill over tiles; ``O(tile · S)`` extra memory.

The thresholds were measured on a 2-core machine (see ``bench/``); they only pick the faster
path, never change a result.

``"auto"`` (the default) chooses among them; the others force one, for tests and benchmarks.
Every kernel returns ``(out, lse)`` in the plan's compute dtype and equals the reference.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from ..errors import InputError, InputTypeError
from ..validate import Plan
from . import decode, dense, mods, tiled

__all__ = [
    "DECODE_MAX_L",
    "DECODE_MIN_BYTES",
    "DENSE_MAX_SCORES",
    "KERNELS",
    "attend",
    "check_kernel",
    "choose",
]

KERNELS = ("auto", "dense", "tiled", "decode")
DENSE_MAX_SCORES = 1 << 14  # L · S per head below which materialising the scores is fastest
DECODE_MAX_L = 8  # queries per head up to which the scores are small enough to keep whole
DECODE_MIN_BYTES = 16 << 20  # K/V bytes from which streaming them (decode) beats BLAS (dense)


def check_kernel(kernel: Any) -> str:
    """Validate a ``kernel=`` argument (one of :data:`KERNELS`)."""
    if not isinstance(kernel, str):
        raise InputTypeError(f"kernel: expected one of {KERNELS}, got {type(kernel).__name__}")
    if kernel not in KERNELS:
        raise InputError(f"kernel: expected one of {KERNELS}, got {kernel!r}")
    return kernel


def choose(plan: Plan) -> str:
    """The kernel ``"auto"`` runs for ``plan``.

    Examples
    --------
    >>> import numpy as np
    >>> from qkv.validate import make_plan
    >>> choose(make_plan(np.ones((4, 8)), np.ones((4, 8)), np.ones((4, 8))))
    'dense'
    >>> choose(make_plan(np.ones((1, 8)), np.ones((5000, 8)), np.ones((5000, 8))))
    'dense'
    >>> choose(make_plan(np.ones((1, 8)), np.ones((200_000, 8)), np.ones((200_000, 8))))
    'decode'
    >>> choose(make_plan(np.ones((500, 8)), np.ones((500, 8)), np.ones((500, 8))))
    'tiled'
    """
    if plan.L <= DECODE_MAX_L:
        kv_bytes = plan.k.size * (plan.d + plan.dv) // plan.d * plan.acc_dtype.itemsize
        return "decode" if kv_bytes >= DECODE_MIN_BYTES else "dense"
    if plan.L * plan.S <= DENSE_MAX_SCORES:
        return "dense"
    return "tiled"


def attend(plan: Plan, kernel: str = "auto") -> tuple[np.ndarray, np.ndarray]:
    """Run ``kernel`` (or the one :func:`choose` picks) on ``plan``: ``(out, lse)``.

    Sinks are added once, to the kernel's finished result (:func:`mods.with_sinks`).
    """
    name = choose(plan) if kernel == "auto" else check_kernel(kernel)
    run = {"dense": dense.attend, "decode": decode.attend, "tiled": tiled.attend}[name]
    out, lse = run(plan)
    if not np.isfinite(out).all() and plan.v.size and np.isfinite(plan.v).all():
        out, lse = _rescaled(run, plan, out, lse)
    return mods.with_sinks(plan, out, lse)


def _rescaled(run: Any, plan: Plan, out: np.ndarray, lse: np.ndarray) -> tuple[np.ndarray, ...]:
    """Rerun with ``v`` divided by a power of two when the kernel's accumulator overflowed.

    Tiled and decode sum ``exp(s - m) · v`` before dividing by the softmax denominator, so
    ``S · max|v|`` beyond the dtype's maximum overflows although the answer (a weighted mean of
    the values) fits. Scaling by ``2**-e`` is exact, and the check costs nothing on the usual
    path: it only runs when the output is not finite while ``v`` is.
    """
    vmax = float(np.max(np.abs(plan.v)))
    room = float(np.finfo(plan.acc_dtype).max) / 2**20
    e = max(0, math.ceil(math.log2(vmax * max(plan.S, 1) / room))) if vmax > 0 else 0
    if e == 0:
        return out, lse  # not an accumulator overflow: NaN or inf came from q or k
    f = plan.acc_dtype.type(2.0**e)
    out2, lse2 = run(replace(plan, v=plan.v / f))
    return out2 * f, lse2
