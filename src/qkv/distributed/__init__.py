"""Exact attention across processes and machines: ring (context-parallel) attention.

Every rank holds a slice of the sequence's queries, keys and values (:func:`shard`); K/V blocks
travel around a ring of ranks and each rank folds the blocks it sees into its running
``(out, lse)`` with the merge of :func:`qkv.merge`. Results equal :func:`qkv.attention` and
:func:`qkv.attention_vjp` over the whole sequence, forward and backward. Backends:
``torch.distributed`` (gloo on the CPU) and MPI through ``mpi4py``; neither is imported until
a communicator from it is used. See ``docs/distributed.md``.

Examples
--------
>>> import numpy as np
>>> from qkv.distributed import positions, shard, unshard
>>> positions(8, 0, 2).tolist()         # rank 0 of 2 holds chunks 0 and 3 of 4 (zigzag)
[0, 1, 6, 7]
>>> x = np.arange(16.0).reshape(8, 2)
>>> bool((unshard([shard(x, r, 2) for r in range(2)]) == x).all())
True
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from ..keywords import near_keywords
from ..tensors import is_tensor
from . import ring as _ring
from .agree import DEFAULT_TIMEOUT
from .comm import RankTimeout
from .decode import decode as _decode
from .layout import LAYOUTS, positions, shard, shard_varlen, unshard, unshard_varlen
from .ring import RingStats, ring_attention_varlen_vjp, ring_attention_vjp

# The public functions send tensors to the torch side (._torch, imported on first use) and
# everything else to the NumPy ring; neither of those imports this router.


@near_keywords()
@wraps(_ring.ring_attention)
def ring_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    comm: Any = None,
    causal: bool = False,
    scale: Any = None,
    layout: str = "zigzag",
    window: Any = None,
    softcap: Any = None,
    sinks: Any = None,
    alibi_slopes: Any = None,
    mask_mod: Any = None,
    return_lse: bool = False,
    stats: RingStats | None = None,
    timeout: Any = DEFAULT_TIMEOUT,
) -> Any:
    run: Callable[..., Any] = _ring.ring_attention
    if is_tensor(q, k, v, sinks, alibi_slopes):
        from ._torch import ring_attention as run
    return run(
        q, k, v, comm=comm, causal=causal, scale=scale, layout=layout, window=window,
        softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes, mask_mod=mask_mod,
        return_lse=return_lse, stats=stats, timeout=timeout,
    )  # fmt: skip


@near_keywords()
@wraps(_ring.ring_attention_varlen)
def ring_attention_varlen(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens: Any,
    *,
    comm: Any = None,
    causal: bool = False,
    scale: Any = None,
    window: Any = None,
    layout: str = "zigzag",
    return_lse: bool = False,
    stats: RingStats | None = None,
) -> Any:
    run = _ring.ring_attention_varlen
    if is_tensor(q, k, v):
        from ._torch import ring_attention_varlen as run
    return run(
        q, k, v, cu_seqlens, comm=comm, causal=causal, scale=scale, window=window,
        layout=layout, return_lse=return_lse, stats=stats,
    )  # fmt: skip


@near_keywords()
@wraps(_decode)
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
    run: Callable[..., Any] = _decode
    if is_tensor(q, k, v):
        from ._torch import decode as run
    return run(q, k, v, comm=comm, scale=scale, return_lse=return_lse, timeout=timeout)


__all__ = [
    "LAYOUTS",
    "RankTimeout",
    "RingStats",
    "decode",
    "positions",
    "ring_attention",
    "ring_attention_varlen",
    "ring_attention_varlen_vjp",
    "ring_attention_vjp",
    "shard",
    "shard_varlen",
    "unshard",
    "unshard_varlen",
]
