"""Run independent work items on a few threads.

NumPy releases the GIL inside BLAS calls and large ufuncs, so plain Python threads keep every
core busy. While the workers run, BLAS is held to one thread each when ``threadpoolctl`` is
installed (two levels of threads on the same cores only get in each other's way); without it
the BLAS library keeps its own setting.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

__all__ = ["cpu_count", "parallel_map", "single_threaded_blas"]

T = TypeVar("T")


@functools.cache
def cpu_count() -> int:
    """Cores this process may run on (read once)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _pool(n: int) -> ThreadPoolExecutor:
    """A long-lived pool of ``n`` workers (starting threads per call costs milliseconds)."""
    with _pools_lock:
        pool = _pools.get(n)
        if pool is None:
            pool = _pools[n] = ThreadPoolExecutor(max_workers=n, thread_name_prefix="qkv")
        return pool


_controller: list[Any] = []  # the threadpoolctl controller, found once (scanning is slow)


@contextmanager
def single_threaded_blas() -> Iterator[None]:
    """Hold BLAS to one thread inside the block (a no-op without ``threadpoolctl``)."""
    if not _controller:
        try:
            from threadpoolctl import ThreadpoolController

            _controller.append(ThreadpoolController())
        except ImportError:
            _controller.append(None)
    if _controller[0] is None:
        yield
        return
    with _controller[0].limit(limits=1, user_api="blas"):
        yield


def parallel_map(fn: Callable[[Any], T], items: Sequence[Any], threads: int | None) -> list[T]:
    """``[fn(x) for x in items]`` on up to ``threads`` threads (default: every core)."""
    n = cpu_count() if threads is None else max(1, int(threads))
    n = min(n, len(items))
    with single_threaded_blas():  # many small GEMMs: BLAS's own threads only add overhead
        if n <= 1:
            return [fn(x) for x in items]
        return list(_pool(n).map(fn, items))
