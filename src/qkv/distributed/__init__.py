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

from .decode import decode
from .layout import LAYOUTS, positions, shard, unshard
from .ring import RingStats, ring_attention, ring_attention_vjp

__all__ = [
    "LAYOUTS",
    "RingStats",
    "decode",
    "positions",
    "ring_attention",
    "ring_attention_vjp",
    "shard",
    "unshard",
]
