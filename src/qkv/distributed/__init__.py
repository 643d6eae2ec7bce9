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
from .comm import RankTimeout
from .decode import decode as _decode
from .layout import LAYOUTS, positions, shard, shard_varlen, unshard, unshard_varlen
from .ring import RingStats, ring_attention_varlen_vjp, ring_attention_vjp

# The public functions send tensors to the torch side (._torch, imported on first use) and
# everything else to the NumPy ring; neither of those imports this router.


@near_keywords()
@wraps(_ring.ring_attention)
def ring_attention(q: Any, k: Any, v: Any, **options: Any) -> Any:
    run: Callable[..., Any] = _ring.ring_attention
    if is_tensor(q, k, v, options.get("sinks"), options.get("alibi_slopes")):
        from ._torch import ring_attention as run
    return run(q, k, v, **options)


@near_keywords()
@wraps(_ring.ring_attention_varlen)
def ring_attention_varlen(q: Any, k: Any, v: Any, cu_seqlens: Any, **options: Any) -> Any:
    run = _ring.ring_attention_varlen
    if is_tensor(q, k, v):
        from ._torch import ring_attention_varlen as run
    return run(q, k, v, cu_seqlens, **options)


@near_keywords()
@wraps(_decode)
def decode(q: Any, k: Any, v: Any, **options: Any) -> Any:
    run: Callable[..., Any] = _decode
    if is_tensor(q, k, v):
        from ._torch import decode as run
    return run(q, k, v, **options)


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
