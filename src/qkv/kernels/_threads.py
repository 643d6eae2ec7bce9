"""Run independent work items on a few threads.

NumPy releases the GIL inside BLAS calls and large ufuncs, so plain Python threads keep every
core busy. While the workers run, BLAS is held to one thread each with ``threadpoolctl`` (two
levels of threads on the same cores only get in each other's way: measured, causal prefill
ran at about 60% of the speed). Without ``threadpoolctl``, work that is mostly BLAS runs on
one Python thread and leaves the cores to BLAS's own threads, unless the environment already
holds BLAS to one thread (``OPENBLAS_NUM_THREADS=1`` and the like).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

__all__ = ["cpu_count", "default_threads", "limit_threads", "parallel_map", "single_threaded_blas"]

T = TypeVar("T")


@functools.cache
def cpu_count() -> int:
    """Cores this process may run on (read once)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


_limit: list[int] = []  # innermost limit_threads() cap, if any


def default_threads() -> int:
    """Worker threads for a call that names none: the cores this process may use, capped by
    :func:`limit_threads` or else by ``OMP_NUM_THREADS`` (how launchers such as ``torchrun``
    give each of several ranks on one host its share)."""
    n = cpu_count()
    if _limit:
        return max(1, min(n, _limit[-1]))
    try:
        omp = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return n
    return max(1, min(n, omp)) if omp > 0 else n


@contextmanager
def limit_threads(n: int) -> Iterator[None]:
    """Use at most ``n`` worker threads inside the block (for calls that name none), and at
    most ``n`` BLAS threads (with ``threadpoolctl``)."""
    _limit.append(max(1, int(n)))
    try:
        with _blas_threads(_limit[-1]):
            yield
    finally:
        _limit.pop()


_pools: dict[int, Any] = {}
_pools_lock = threading.Lock()


def _pool(n: int) -> Any:
    """A long-lived pool of ``n`` workers (starting threads per call costs milliseconds)."""
    from concurrent.futures import ThreadPoolExecutor

    with _pools_lock:
        pool = _pools.get(n)
        if pool is None:
            pool = _pools[n] = ThreadPoolExecutor(max_workers=n, thread_name_prefix="qkv")
        return pool


_controller: list[Any] = []  # the threadpoolctl controller, found once (scanning is slow)


@contextmanager
def _blas_threads(n: int) -> Iterator[None]:
    """Hold BLAS to ``n`` threads inside the block (a no-op without ``threadpoolctl``)."""
    if not _controller:
        try:
            from threadpoolctl import ThreadpoolController

            _controller.append(ThreadpoolController())
        except ImportError:
            _controller.append(None)
    if _controller[0] is None:
        yield
        return
    with _controller[0].limit(limits=n, user_api="blas"):
        yield


def single_threaded_blas() -> Any:
    """Hold BLAS to one thread inside the block (a no-op without ``threadpoolctl``)."""
    return _blas_threads(1)


def _blas_limitable() -> bool:
    """Whether BLAS runs one thread inside our workers (threadpoolctl, or the environment)."""
    with single_threaded_blas():
        pass
    if _controller[0] is not None:
        return True
    names = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS")
    return any(os.environ.get(name) == "1" for name in names)


def parallel_map(
    fn: Callable[[Any], T],
    items: Sequence[Any],
    threads: int | None,
    *,
    blas_heavy: bool = True,
) -> list[T]:
    """``[fn(x) for x in items]`` on up to ``threads`` threads (default: :func:`default_threads`).

    ``blas_heavy`` work falls back to one thread when BLAS cannot be held to one thread.
    """
    n = default_threads() if threads is None else max(1, int(threads))
    n = min(n, len(items))
    if blas_heavy and n > 1 and not _blas_limitable():
        n = 1
    with single_threaded_blas():  # many small GEMMs: BLAS's own threads only add overhead
        if n <= 1:
            return [fn(x) for x in items]
        return list(_pool(n).map(fn, items))
