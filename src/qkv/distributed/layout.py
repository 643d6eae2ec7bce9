"""How a sequence is cut between ranks: :func:`shard`, :func:`unshard`, :func:`positions`.

Two layouts, both cutting the sequence into equal chunks:

- ``"zigzag"``: ``2W`` chunks; rank ``r`` holds chunks ``r`` and ``2W − 1 − r`` (in that order).
  Under causal masking every rank then does the same work at every ring step.
- ``"contiguous"``: ``W`` chunks; rank ``r`` holds chunk ``r``. Simple, but under causal masking
  rank ``W − 1`` does ``2W − 1`` times the work of rank ``0``.

A rank's chunks are always in ascending global order, so the keys a query chunk may see under
causal masking are a prefix of any rank's chunks (see :func:`visible_prefix`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..checks import check_int
from ..errors import InputError
from ..keywords import near_keywords
from ..tensors import is_tensor
from ..validate import from_foreign

__all__ = [
    "LAYOUTS",
    "check_layout",
    "chunk_ids",
    "doc_chunks",
    "positions",
    "shard",
    "shard_varlen",
    "unshard",
    "unshard_varlen",
]

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout: Any) -> str:
    """Validate a ``layout=`` argument (one of :data:`LAYOUTS`)."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise InputError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    return layout


def _check_world(rank: Any, world: Any) -> tuple[int, int]:
    rank, world = check_int(rank, "rank"), check_int(world, "world")
    if world < 1 or not 0 <= rank < world:
        raise InputError(f"rank, world: expected 0 <= rank < world, got rank {rank}, world {world}")
    return rank, world


def chunk_ids(rank: int, world: int, layout: str) -> tuple[int, ...]:
    """The global chunk numbers rank ``rank`` holds, ascending.

    Examples
    --------
    >>> chunk_ids(1, 4, "zigzag"), chunk_ids(1, 4, "contiguous")
    ((1, 6), (1,))
    """
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (rank,)


def n_chunks(world: int, layout: str) -> int:
    """How many chunks the whole sequence is cut into."""
    return 2 * world if layout == "zigzag" else world


def visible_prefix(q_chunk: int, k_chunks: Sequence[int], causal: bool) -> tuple[int, bool]:
    """How many of ``k_chunks`` (ascending) query chunk ``q_chunk`` may see, and whether the
    last of them is its own chunk (the diagonal, which needs a causal mask within the block).

    Examples
    --------
    >>> visible_prefix(6, (1, 6), True), visible_prefix(1, (2, 5), True)
    ((2, True), (0, False))
    """
    if not causal:
        return len(k_chunks), False
    n = sum(1 for c in k_chunks if c <= q_chunk)
    return n, n > 0 and k_chunks[n - 1] == q_chunk


def _split_size(n: int, world: int, layout: str, shape: tuple[int, ...]) -> int:
    parts = n_chunks(world, layout)
    if n % parts:
        raise InputError(
            f"x: a sequence of {n} tokens (shape {shape}) cannot be cut into {parts} equal "
            f"chunks for layout {layout!r} with world size {world}"
        )
    return n // parts


def _concat(parts: list[Any], axis: int) -> Any:
    if parts and is_tensor(parts[0]):
        import torch

        return torch.cat(parts, dim=axis)
    return np.concatenate(parts, axis=axis)


def _take(x: Any, axis: int, lo: int, hi: int) -> Any:
    index = [slice(None)] * len(x.shape)
    index[axis] = slice(lo, hi)
    return x[tuple(index)]


def _axis(x: Any, axis: Any, name: str) -> int:
    axis = check_int(axis, "axis")
    nd = len(x.shape)
    if not -nd <= axis < nd:
        raise InputError(f"axis: {axis} is out of range for {name} with shape {tuple(x.shape)}")
    return axis % nd


@near_keywords()
def shard(x: Any, rank: int, world: int, *, layout: str = "zigzag", axis: int = -2) -> Any:
    """This rank's part of a whole sequence ``x`` (NumPy array or torch tensor).

    Parameters
    ----------
    x : array_like or torch.Tensor
        The whole sequence; tokens along ``axis``.
    rank, world : int
        This rank and the number of ranks.
    layout : {"zigzag", "contiguous"}, optional
        See the module's description.
    axis : int, optional
        The token axis (default ``-2``, as for ``q``, ``k`` and ``v``).

    Returns
    -------
    ndarray or torch.Tensor
        ``n / W`` tokens: chunks ``r`` and ``2W − 1 − r`` (zigzag) or chunk ``r`` (contiguous).

    Raises
    ------
    InputError
        The sequence length is not a multiple of the number of chunks.

    Examples
    --------
    >>> import numpy as np
    >>> shard(np.arange(8), 0, 2, axis=0).tolist(), shard(np.arange(8), 1, 2, axis=0).tolist()
    ([0, 1, 6, 7], [2, 3, 4, 5])
    """
    layout = check_layout(layout)
    rank, world = _check_world(rank, world)
    if not is_tensor(x):
        x = np.asarray(x)
    ax = _axis(x, axis, "x")
    h = _split_size(x.shape[ax], world, layout, tuple(x.shape))
    return _concat([_take(x, ax, c * h, (c + 1) * h) for c in chunk_ids(rank, world, layout)], ax)


@near_keywords()
def unshard(parts: Sequence[Any], *, layout: str = "zigzag", axis: int = -2) -> Any:
    """The whole sequence from every rank's part (``parts[r]`` from rank ``r``); inverts
    :func:`shard`.

    Examples
    --------
    >>> import numpy as np
    >>> parts = [shard(np.arange(12), r, 3, axis=0) for r in range(3)]
    >>> unshard(parts, axis=0).tolist() == list(range(12))
    True
    """
    layout = check_layout(layout)
    if isinstance(parts, (str, bytes)) or not isinstance(parts, Sequence) or not parts:
        raise InputError("parts: expected a non-empty sequence with one part per rank")
    world = len(parts)
    parts = [p if is_tensor(p) else np.asarray(p) for p in parts]
    ax = _axis(parts[0], axis, "parts[0]")
    shape0 = tuple(parts[0].shape)
    for r, p in enumerate(parts):
        if tuple(p.shape) != shape0:
            raise InputError(f"parts[{r}]: shape {tuple(p.shape)} differs from parts[0]'s {shape0}")
    per = len(chunk_ids(0, world, layout))
    if shape0[ax] % per:
        raise InputError(
            f"parts: {shape0[ax]} tokens per rank (shape {shape0}) cannot hold {per} equal "
            f"chunks for layout {layout!r}"
        )
    h = shape0[ax] // per
    chunks: list[Any] = [None] * n_chunks(world, layout)
    for r, p in enumerate(parts):
        for i, c in enumerate(chunk_ids(r, world, layout)):
            chunks[c] = _take(p, ax, i * h, (i + 1) * h)
    return _concat(chunks, ax)


@near_keywords()
def positions(n: int, rank: int, world: int, *, layout: str = "zigzag") -> np.ndarray:
    """The global token positions rank ``rank`` holds, in its order (what rotary embeddings and
    any position-dependent code must use once tokens are re-ordered).

    Examples
    --------
    >>> positions(8, 1, 2).tolist(), positions(8, 1, 2, layout="contiguous").tolist()
    ([2, 3, 4, 5], [4, 5, 6, 7])
    """
    n = check_int(n, "n", minimum=0)
    return shard(np.arange(n, dtype=np.int64), rank, world, layout=layout, axis=0)


# ---------------------------------------------------------------- packed documents


def doc_chunks(cu_seqlens: Any, world: int, layout: str, name: str = "cu_seqlens") -> np.ndarray:
    """Checked ``cu_seqlens`` of a packed batch cut for ``layout``: each document's chunk size
    (every document is cut into the layout's chunks on its own, so its length must be a
    multiple of ``2W`` (zigzag) or ``W`` (contiguous); empty documents are fine).

    Examples
    --------
    >>> doc_chunks([0, 8, 8, 12], 2, "zigzag").tolist()
    [2, 0, 1]
    """
    from ..engine.varlen import check_offsets

    layout = check_layout(layout)
    raw = from_foreign(cu_seqlens, name)
    try:
        total = int(np.asarray(raw).reshape(-1)[-1])
    except (ValueError, TypeError, IndexError, OverflowError):
        total = 0  # check_offsets says what is wrong with it
    cu = check_offsets(raw, name, total, "its last entry")
    parts = n_chunks(world, layout)
    lengths = np.diff(cu)
    bad = np.flatnonzero(lengths % parts)
    if bad.size:
        b = int(bad[0])
        raise InputError(
            f"{name}: document {b} has {int(lengths[b])} tokens, which cannot be cut into {parts} "
            f"equal chunks for layout {layout!r} with world size {world} (every document's "
            f"length must be a multiple of {parts}; pad the documents or use another layout)"
        )
    return lengths // parts


@near_keywords()
def shard_varlen(
    x: Any, cu_seqlens: Any, rank: int, world: int, *, layout: str = "zigzag", axis: int = 0
) -> Any:
    """This rank's part of a packed batch ``x``: every document sharded with :func:`shard`
    on its own, the parts concatenated in document order (tokens along ``axis``, default 0
    as in :func:`qkv.attention_varlen`). Every rank's part has ``cu_seqlens / W`` offsets.

    Examples
    --------
    >>> import numpy as np
    >>> shard_varlen(np.arange(12), [0, 8, 8, 12], 1, 2).tolist()
    [2, 3, 4, 5, 9, 10]
    """
    rank, world = _check_world(rank, world)
    size = doc_chunks(cu_seqlens, world, layout)
    if not is_tensor(x):
        x = np.asarray(x)
    ax = _axis(x, axis, "x")
    cu = np.concatenate([[0], np.cumsum(size * n_chunks(world, layout))])
    if x.shape[ax] != cu[-1]:
        raise InputError(
            f"x: {x.shape[ax]} tokens (shape {tuple(x.shape)}) but cu_seqlens ends at {cu[-1]}"
        )
    parts = [
        _take(x, ax, int(a) + c * int(h), int(a) + (c + 1) * int(h))
        for a, h in zip(cu[:-1], size, strict=True)
        for c in chunk_ids(rank, world, layout)
    ]
    return _concat(parts, ax) if parts else _take(x, ax, 0, 0)


@near_keywords()
def unshard_varlen(
    parts: Sequence[Any], cu_seqlens: Any, *, layout: str = "zigzag", axis: int = 0
) -> Any:
    """The packed batch from every rank's part (``parts[r]`` from rank ``r``); inverts
    :func:`shard_varlen`.

    Examples
    --------
    >>> import numpy as np
    >>> cu = [0, 8, 8, 12]
    >>> parts = [shard_varlen(np.arange(12), cu, r, 2) for r in range(2)]
    >>> unshard_varlen(parts, cu).tolist() == list(range(12))
    True
    """
    if isinstance(parts, (str, bytes)) or not isinstance(parts, Sequence) or not parts:
        raise InputError("parts: expected a non-empty sequence with one part per rank")
    world = len(parts)
    size = doc_chunks(cu_seqlens, world, layout)
    parts = [p if is_tensor(p) else np.asarray(p) for p in parts]
    ax = _axis(parts[0], axis, "parts[0]")
    per = len(chunk_ids(0, world, layout))
    local = np.concatenate([[0], np.cumsum(size * per)])
    for r, p in enumerate(parts):
        if p.shape[ax] != local[-1]:
            raise InputError(
                f"parts[{r}]: {p.shape[ax]} tokens (shape {tuple(p.shape)}), expected "
                f"{local[-1]} (cu_seqlens / {world})"
            )
    out: list[Any] = []
    for b, h in enumerate(size):
        chunks: list[Any] = [None] * n_chunks(world, layout)
        for r, p in enumerate(parts):
            for i, c in enumerate(chunk_ids(r, world, layout)):
                lo = int(local[b]) + i * int(h)
                chunks[c] = _take(p, ax, lo, lo + int(h))
        out.extend(chunks)
    return _concat(out, ax) if out else _take(parts[0], ax, 0, 0)
