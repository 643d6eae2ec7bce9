"""Decoding from a KV cache whose keys are spread across ranks: attend locally, all-gather the
``(out, lse)`` pairs, merge."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..engine.kernels import dispatch
from ..engine.kernels.blocks import merge_arrays
from ..engine.kernels.threads import limit_threads
from ..errors import InputError, InputTypeError
from ..validate import as_array, make_plan
from .agree import DEFAULT_TIMEOUT, agree, check_timeout, dtype_code, shape_field, threads_for
from .comm import get_comm

__all__ = ["decode"]


def decode(
    q: Any,
    k: Any,
    v: Any,
    *,
    comm: Any = None,
    scale: Any = None,
    return_lse: bool = False,
    timeout: Any = DEFAULT_TIMEOUT,
) -> Any:
    """Attention of the same queries over a KV cache whose keys are spread across ranks.

    Each rank attends its own keys, then every rank's ``(out, lse)`` are all-gathered and
    merged (:func:`qkv.merge`). Every rank returns the whole result, equal to
    :func:`qkv.attention` over all ranks' keys together. Ranks may hold different numbers of
    keys (also none).

    Parameters
    ----------
    q : array_like, shape ``(..., L, d)`` or ``(d,)``
        The same queries on every rank.
    k, v : array_like, shapes ``(..., S_rank, d)`` and ``(..., S_rank, dv)``
        This rank's part of the cache.
    comm, scale, return_lse, timeout
        As in :func:`ring_attention`.

    Examples
    --------
    >>> import numpy as np, qkv
    >>> from qkv.distributed import decode
    >>> rng = np.random.default_rng(0)
    >>> q, (k, v) = rng.standard_normal((4, 8)), rng.standard_normal((2, 50, 8))
    >>> bool(np.allclose(decode(q, k, v), qkv.attention(q, k, v)))
    True
    """
    c = get_comm(comm)
    err: Exception | None = None
    plan = None
    seconds: float | None = DEFAULT_TIMEOUT
    shapes: list[tuple[int, ...] | None] = [None, None, None]
    dtypes: list[np.ndarray | None] = [None, None, None]
    try:
        seconds = check_timeout(timeout)
        arrays = [as_array(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"))]
        dtypes = list(arrays)
        got = [a.shape for a in arrays]
        got[1] = got[1][:-2] + (-1,) + got[1][-1:] if len(got[1]) >= 2 else got[1]
        got[2] = got[2][:-2] + (-1,) + got[2][-1:] if len(got[2]) >= 2 else got[2]
        shapes = list(got)
        plan = make_plan(arrays[0], arrays[1], arrays[2], scale=scale)
    except (InputError, InputTypeError) as exc:
        err = exc
    fields = [("scale", [int(np.float64(plan.scale if plan else 0.0).view(np.int64))])]
    for name, a, shape in zip("qkv", dtypes, shapes, strict=True):
        fields += [(f"{name} dtype", dtype_code(a)), (f"{name} shape", shape_field(shape))]
    rows = agree(c, "decode", fields, err, seconds)
    assert plan is not None
    failed: InputError | None = None
    try:
        with limit_threads(threads_for(c, rows)):
            o, m = dispatch.attend(plan)
    except InputError as exc:  # scores beyond float64: still join the all-gather, then raise
        failed = exc
        o = np.zeros(plan.batch + (plan.L, plan.dv), dtype=plan.acc_dtype)
        m = np.zeros(plan.batch + (plan.L,), dtype=plan.acc_dtype)
    packed = np.concatenate([o.reshape(-1), m.reshape(-1), [float(failed is not None)]])
    every = c.allgather(packed.astype(plan.acc_dtype, copy=False))
    if failed is not None:
        raise failed
    bad = [r for r in range(c.size) if every[r, -1]]
    if bad:
        raise InputError(
            f"decode: rank(s) {bad} of {c.size} could not attend their keys; see the error there"
        )
    every = every[:, :-1]
    parts = [(r[: o.size].reshape(o.shape), r[o.size :].reshape(m.shape)) for r in every]
    out, lse = merge_arrays(parts)
    out = out.astype(plan.out_dtype, copy=False)
    if plan.squeeze:
        out, lse = out[..., 0, :], lse[..., 0]
    return (out, lse) if return_lse else out
