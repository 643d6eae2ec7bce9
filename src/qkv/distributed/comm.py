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

:meth:`Communicator.timed_allgather` sends every rank's row to every other rank
point to point and waits for each at most until the deadline, so that a rank that never
entered the call is named (:class:`RankTimeout`) instead of leaving the others waiting for
the engine's own, long, timeout.

:func:`get_comm` turns a user's ``comm=`` argument into one of these. Neither torch nor mpi4py
is imported unless the caller's ``comm`` (or an initialised default group) comes from it.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from typing import Any

import numpy as np

from ..errors import InputTypeError

__all__ = ["Communicator", "LocalComm", "MPIComm", "RankTimeout", "TorchComm", "get_comm"]

TAG_GATHER = 13  # the timed all-gather's messages (the ring uses 11 and 12)


class RankTimeout(TimeoutError):
    """Some ranks sent nothing before the deadline: ``missing`` lists them (ranks of the
    communicator).

    The group is then broken, as after the engine's own timeouts: gloo closes its connections
    to the missing ranks, and messages of the abandoned call may stay pending under MPI.
    """

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing


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

    def timed_allgather(self, x: np.ndarray, timeout: float | None) -> np.ndarray:
        """:meth:`allgather` point to point, raising :class:`RankTimeout` that names the ranks
        whose ``x`` did not arrive within ``timeout`` seconds (``None``: wait for ever). Every
        rank of the call must use this one, not :meth:`allgather`.

        A communicator that has no way to time out (one written for tests or another engine)
        gathers without a limit."""
        return self.allgather(x)


class LocalComm(Communicator):
    """A single rank: the ring has one step and no exchange."""

    def exchange(self, send: np.ndarray, recv: np.ndarray, tag: int) -> Request:
        raise RuntimeError("a single rank has no neighbour to exchange with")

    def allgather(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x)[None].copy()

    def timed_allgather(self, x: np.ndarray, timeout: float | None) -> np.ndarray:
        return self.allgather(x)


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

    def _global(self, r: int) -> int:
        return r if self.group is None else self.dist.get_global_rank(self.group, r)

    def timed_allgather(self, x: np.ndarray, timeout: float | None) -> np.ndarray:
        dist, from_np = self.dist, self.torch.from_numpy
        x = np.ascontiguousarray(x)
        out = np.empty((self.size,) + x.shape, dtype=x.dtype)
        out[self.rank] = x
        sends, recvs = [], {}
        try:
            for r in range(self.size):
                if r != self.rank:
                    sends.append(dist.isend(from_np(x), self._global(r), self.group, TAG_GATHER))
                    recvs[r] = dist.irecv(from_np(out[r]), self._global(r), self.group, TAG_GATHER)
        except RuntimeError as exc:  # gloo after a timeout: its context is closed
            raise RuntimeError(
                f"this rank's process group can no longer send ({exc}); an earlier call timed "
                "out waiting for a rank, which breaks the group: create a new one"
            ) from None
        if timeout is None:
            for req in recvs.values():
                req.wait()
        else:
            deadline, missing = time.monotonic() + timeout, []
            for r, req in recvs.items():
                left = max(deadline - time.monotonic(), 0.001)
                try:
                    req.wait(timedelta(seconds=left))
                except RuntimeError:  # gloo: timed out (it then closes the pair), or closed
                    missing.append(r)
            if missing:
                raise RankTimeout(f"no message from them within {timeout:g} s", missing)
        for req in sends:
            req.wait()
        return out


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

    def timed_allgather(self, x: np.ndarray, timeout: float | None) -> np.ndarray:
        x = np.ascontiguousarray(x)
        out = np.empty((self.size,) + x.shape, dtype=x.dtype)
        out[self.rank] = x
        peers = [r for r in range(self.size) if r != self.rank]
        recvs = {r: self.comm.Irecv(out[r], source=r, tag=TAG_GATHER) for r in peers}
        sends = [self.comm.Isend(x, dest=r, tag=TAG_GATHER) for r in peers]
        if timeout is None:
            self.MPI.Request.Waitall([*recvs.values(), *sends])
            return out
        deadline, pause = time.monotonic() + timeout, 1e-5
        waiting = dict(recvs)
        while waiting and time.monotonic() < deadline:
            waiting = {r: q for r, q in waiting.items() if not q.Test()}
            if waiting:
                time.sleep(pause)
                pause = min(2 * pause, 0.01)
        if waiting:
            for q in waiting.values():
                q.Cancel()
            missing = sorted(waiting)
            raise RankTimeout(f"no message from them within {timeout:g} s", missing)
        self.MPI.Request.Waitall(sends)
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
