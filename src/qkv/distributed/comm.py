"""The small interface the ring needs from a distributed engine, and its two backends.

A :class:`Communicator` can post "send this buffer to the next rank and receive the previous
rank's into that buffer" (both non-blocking, waited on together) and all-gather a small array.
Buffers are contiguous NumPy arrays; the ring sends raw bytes, so any dtype travels unchanged.

- :class:`TorchComm`: a ``torch.distributed`` process group (gloo on the CPU). The pair of
  operations goes through ``batch_isend_irecv``, so ranks that post in different orders cannot
  deadlock; each stream of messages has its own tag.
- :class:`MPIComm`: an ``mpi4py`` communicator; ``Isend``/``Irecv`` straight from the NumPy
  buffers, waited on with ``Waitall``.
- :class:`LocalComm`: one rank, nothing to send.

:func:`get_comm` turns a user's ``comm=`` argument into one of these. Neither torch nor mpi4py
is imported unless the caller's ``comm`` (or an initialised default group) comes from it.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ..errors import InputTypeError

__all__ = ["Communicator", "LocalComm", "MPIComm", "TorchComm", "get_comm"]


class Request:
    """A posted exchange; :meth:`wait` blocks until both its send and its receive are done."""

    def wait(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError


class Communicator:
    """``rank`` and ``size``, a ring exchange and a small all-gather."""

    rank: int = 0
    size: int = 1
    backend: str = "local"

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.size

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.size

    def exchange(self, send: np.ndarray, recv: np.ndarray, tag: int) -> Request:
        """Post: ``send`` to the next rank, the previous rank's message into ``recv``."""
        raise NotImplementedError  # pragma: no cover - interface

    def allgather(self, x: np.ndarray) -> np.ndarray:
        """Every rank's ``x`` stacked, shape ``(size, *x.shape)``, on every rank."""
        raise NotImplementedError  # pragma: no cover - interface


class LocalComm(Communicator):
    """A single rank: the ring has one step and no exchange."""

    def exchange(self, send: np.ndarray, recv: np.ndarray, tag: int) -> Request:
        raise RuntimeError("a single rank has no neighbour to exchange with")

    def allgather(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x)[None].copy()


class _Requests(Request):
    def __init__(self, reqs: list[Any], wait_all: Any = None) -> None:
        self.reqs, self.wait_all = reqs, wait_all

    def wait(self) -> None:
        if self.wait_all is not None:
            self.wait_all(self.reqs)
        else:
            for r in self.reqs:
                r.wait()


class TorchComm(Communicator):
    """A ``torch.distributed`` process group (``None``: the default group)."""

    backend = "torch"

    def __init__(self, group: Any = None) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.group = torch, dist, group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        peers = (self.next, self.prev)
        if group is None:
            self._next, self._prev = peers
        else:
            self._next, self._prev = (dist.get_global_rank(group, p) for p in peers)

    def exchange(self, send: np.ndarray, recv: np.ndarray, tag: int) -> Request:
        dist, from_np = self.dist, self.torch.from_numpy
        ops = [
            dist.P2POp(dist.isend, from_np(send), self._next, self.group, tag),
            dist.P2POp(dist.irecv, from_np(recv), self._prev, self.group, tag),
        ]
        return _Requests(dist.batch_isend_irecv(ops))

    def allgather(self, x: np.ndarray) -> np.ndarray:
        t = self.torch.from_numpy(np.ascontiguousarray(x))
        out = [self.torch.empty_like(t) for _ in range(self.size)]
        self.dist.all_gather(out, t, group=self.group)
        return np.stack([o.numpy() for o in out])


class MPIComm(Communicator):
    """An ``mpi4py`` communicator."""

    backend = "mpi"

    def __init__(self, comm: Any) -> None:
        from mpi4py import MPI

        self.MPI, self.comm = MPI, comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def exchange(self, send: np.ndarray, recv: np.ndarray, tag: int) -> Request:
        reqs = [
            self.comm.Irecv(recv, source=self.prev, tag=tag),
            self.comm.Isend(send, dest=self.next, tag=tag),
        ]
        return _Requests(reqs, self.MPI.Request.Waitall)

    def allgather(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x)
        out = np.empty((self.size,) + x.shape, dtype=x.dtype)
        self.comm.Allgather(x, out)
        return out


def get_comm(comm: Any = None) -> Communicator:
    """The :class:`Communicator` for a user's ``comm=`` argument.

    ``None`` means: the default ``torch.distributed`` group if one is initialised, else
    ``MPI.COMM_WORLD`` if ``mpi4py.MPI`` has been imported, else a single rank.

    Examples
    --------
    >>> get_comm().size
    1
    """
    if isinstance(comm, Communicator):
        return comm
    dist = sys.modules.get("torch.distributed")
    mpi = sys.modules.get("mpi4py.MPI")
    if comm is None:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return TorchComm(None)
        if mpi is not None:
            return MPIComm(mpi.COMM_WORLD)
        return LocalComm()
    if mpi is not None and isinstance(comm, mpi.Comm):
        return MPIComm(comm)
    if dist is not None and isinstance(comm, dist.ProcessGroup):
        return TorchComm(comm)
    raise InputTypeError(
        "comm: expected a torch.distributed ProcessGroup, an mpi4py communicator or None, "
        f"got {type(comm).__name__}"
    )
