"""Run independent work items on a few threads.

NumPy releases the GIL inside BLAS calls and large ufuncs, so plain Python threads keep every
core busy. While the workers run, BLAS is held to one thread each with ``threadpoolctl`` (two
levels of threads on the same cores only get in each other's way: measured, causal prefill
ran at about 60% of the speed). Without ``threadpoolctl``, work that is mostly BLAS runs on
one Python thread and leaves the cores to BLAS's own threads, unless the environment already
holds BLAS to one thread (``OPENBLAS_NUM_THREADS=1`` and the like).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from .env import setting

__all__ = [
    "compiled_team",
    "openmp_parallel",
    "prefill_team",
    "blas_limitable",
    "cpu_count",
    "default_threads",
    "limit_threads",
    "parallel_map",
    "rescan_blas",
    "single_threaded_blas",
    "team_preferred",
    "thread_rule",
    "workers",
]

T = TypeVar("T")


@functools.cache
def cpu_count() -> int:
    """Cores this process may run on (read once)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


_limit: list[int] = []  # worker caps set by limit_threads, innermost last


def _omp_threads() -> int | None:
    """``OMP_NUM_THREADS`` when it names a positive count, else None."""
    raw = setting("OMP_NUM_THREADS")
    if not raw:  # (unset, the common case: int("") would raise, which costs microseconds)
        return None
    try:
        omp = int(raw)
    except ValueError:
        return None
    return omp if omp > 0 else None


def default_threads() -> int:
    """Worker threads for a call that names none: the cores this process may use, capped by
    :func:`limit_threads` or else by ``OMP_NUM_THREADS`` (how launchers such as ``torchrun``
    give each of several ranks on one host its share)."""
    n = cpu_count()
    if _limit:
        return max(1, min(n, _limit[-1]))
    omp = _omp_threads()
    return n if omp is None else min(n, omp)


def thread_rule() -> str:
    """How :func:`default_threads` gets its number now, in words (for ``qkv info``)."""
    cores = cpu_count()
    if _limit:
        return f"min({cores} usable cores, limit_threads({_limit[-1]}))"
    omp = _omp_threads()
    if omp is not None:
        return f"min({cores} usable cores, OMP_NUM_THREADS={omp})"
    return f"the {cores} cores this process may use (OMP_NUM_THREADS not set)"


def workers(
    threads: int | None = None,
    *,
    items: int | None = None,
    blas: bool = False,
    share: int = 1,
) -> int:
    """The worker threads a kernel runs on: every rule on their number, written once.

    Parameters
    ----------
    threads : int, optional
        As the caller asked (at least 1); default :func:`default_threads`.
    items : int, optional
        Never more threads than work items (at least 1).
    blas : bool, optional
        The work is mostly BLAS: one thread unless BLAS can be held to one thread per worker
        (:func:`blas_limitable`), as its own threads would fight ours.
    share : int, optional
        Processes on this host splitting its cores (ranks of a distributed run): at most this
        process's share of them.

    Examples
    --------
    >>> workers(3)
    3
    >>> workers(8, items=2)
    2
    >>> workers(0)
    1
    """
    n = default_threads() if threads is None else max(1, int(threads))
    if share > 1:
        n = max(1, min(n, cpu_count() // share))
    if items is not None:
        n = max(1, min(n, items))
    if blas and n > 1 and not blas_limitable():
        n = 1
    return n


@contextmanager
def limit_threads(n: int) -> Iterator[None]:
    """Use at most ``n`` worker threads inside the block (for calls that name none); with
    ``n == 1`` BLAS is held to one thread too."""
    _limit.append(max(1, int(n)))
    try:
        if _limit[-1] == 1:
            with single_threaded_blas():
                yield
        else:
            yield
    finally:
        _limit.pop()


_team = threading.local()  # .depth: how deep this thread is in compiled_team blocks


@contextmanager
def compiled_team() -> Iterator[None]:
    """Inside the block, kernels that have a compiled parallel form run it on Numba's thread
    team instead of qkv's Python worker threads (see :func:`team_preferred`).

    For calls made between PyTorch operations (the transformers backend): PyTorch's OpenMP
    threads keep spinning for a while after each operation, and a hand-over to Python worker
    threads through the GIL then waits on them; Numba's OpenMP team starts its threads in C.
    Measured on 2 cores, Llama-style decoding (16 query heads over 4 kv heads, d 64) with one
    layer's K/V of 16 MiB: 1.5 ms per attention call right after a PyTorch operation, against
    2.4 ms on qkv's worker threads and 2.8 ms for PyTorch's own SDPA.
    """
    _team.depth = getattr(_team, "depth", 0) + 1
    try:
        yield
    finally:
        _team.depth -= 1


def team_preferred() -> bool:
    """Whether this thread is inside :func:`compiled_team`."""
    return getattr(_team, "depth", 0) > 0


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

# BLAS thread limits are process-wide, not per thread: callers on several Python threads share
# one limit. The first to arrive sets it, the last to leave restores what was there before, so
# the process's BLAS settings end exactly as they began whatever the callers' threads do.
_limit_lock = threading.Lock()
_limit_users = 0
_limit_active: list[Any] = []  # the threadpoolctl limiter while anyone holds the limit
_limit_depth = threading.local()  # how many of the users are this thread (survives a fork)


def _reinit_after_fork() -> None:
    """In a forked child: forget the parent's pools (their threads did not survive the fork).

    The locks are new too: another parent thread may have held them at the moment of the fork.
    Only the forking thread lives on, so only its own holds on the BLAS limit still count.
    """
    global _pools_lock, _limit_lock, _limit_users
    _pools.clear()
    _pools_lock = threading.Lock()
    _limit_lock = threading.Lock()
    _limit_users = getattr(_limit_depth, "n", 0)
    if _limit_users == 0 and _limit_active:
        _free_blas_control()
        _limit_active.pop().restore_original_limits()
        _free_blas_control()


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=_reinit_after_fork)


def _free_blas_control() -> None:
    """Let this thread set OpenBLAS's limit (threadpoolctl >= 3.8 lets only one thread at a
    time change a process-wide OpenBLAS pool, silently ignoring the others)."""
    try:
        from threadpoolctl import OpenBLASController
    except ImportError:
        return
    clear = getattr(OpenBLASController, "clear_controlling_thread", None)
    if clear is not None:
        clear(force=True)


class _OneThread:
    """BLAS held to one thread until :meth:`restore_original_limits`: each BLAS library's own
    setter, called only where it is not at one thread already (about 5 µs, where a
    ``threadpoolctl`` limit object cost about 20 µs on every call)."""

    def __init__(self, controller: Any) -> None:
        if not hasattr(controller, "_blas_libs"):  # found once: the scan is slow
            controller._blas_libs = controller.select(user_api="blas").lib_controllers
        self.saved = []
        for lib in controller._blas_libs:
            n = lib.num_threads
            if n != 1:
                lib.set_num_threads(1)
                self.saved.append((lib, n))

    def restore_original_limits(self) -> None:
        for lib, n in self.saved:
            lib.set_num_threads(n)


@contextmanager
def single_threaded_blas() -> Iterator[None]:
    """Hold BLAS to one thread inside the block (a no-op without ``threadpoolctl``).

    Safe to enter from several threads at once: the original limits are restored when the last
    caller leaves.
    """
    global _limit_users
    if not _controller:
        with _limit_lock:
            if not _controller:
                try:
                    from threadpoolctl import ThreadpoolController

                    _controller.append(ThreadpoolController())
                except ImportError:
                    _controller.append(None)
    if _controller[0] is None:
        yield
        return
    with _limit_lock:
        if _limit_users == 0:
            _free_blas_control()
            _limit_active.append(_OneThread(_controller[0]))
        _limit_users += 1
        _limit_depth.n = getattr(_limit_depth, "n", 0) + 1
    try:
        yield
    finally:
        with _limit_lock:
            _limit_depth.n -= 1
            _limit_users -= 1
            if _limit_users == 0:
                _free_blas_control()  # the last user may be another thread than the first
                _limit_active.pop().restore_original_limits()
                _free_blas_control()  # and leave OpenBLAS to whichever thread comes next


def rescan_blas() -> None:
    """Find the loaded BLAS libraries again on the next limit (call after loading another
    one, such as SciPy's own BLAS; the scan is slow, so it is done once and kept)."""
    with _limit_lock:
        if _limit_users == 0:
            _controller.clear()


def blas_limitable() -> bool:
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
    """``[fn(x) for x in items]`` on up to ``threads`` threads (default: every core).

    The calling thread works too, beside ``threads - 1`` pool workers, each taking the next
    item until none is left: one worker fewer to wake and to wait for (measured on 2 cores:
    about 110 µs of hand-over per call with the caller only waiting, about 45 µs so).

    ``blas_heavy`` work holds BLAS to one thread while it runs (many small products: BLAS's
    own threads only add overhead) and falls back to one thread when BLAS cannot be held;
    other work (the compiled kernels, which call no BLAS) leaves BLAS's settings alone.
    """
    n = workers(threads, items=len(items), blas=blas_heavy)
    with single_threaded_blas() if blas_heavy else nullcontext():
        if n <= 1:
            return [fn(x) for x in items]
        err = np.geterr()  # NumPy's error state is per thread: the workers take the caller's
        results: list[Any] = [None] * len(items)
        taken = itertools.count()  # next() on a count is atomic under the GIL
        failed: list[BaseException] = []

        def drain() -> None:
            with np.errstate(**err):
                while not failed:
                    i = next(taken)
                    if i >= len(items):
                        return
                    try:
                        results[i] = fn(items[i])
                    except BaseException as exc:  # stop the others early, raise it below
                        failed.append(exc)
                        raise

        helpers = [_pool(n - 1).submit(drain) for _ in range(n - 1)]
        try:
            drain()
        finally:
            for h in helpers:
                h.exception()  # wait for every helper before the results are read
        if failed:
            raise failed[0]
        return results


# --- the OpenMP team a native kernel's work items run on -----------------------------------
# (the decode step and the prefill pass its GOMP_parallel: see native_src/common.h's for_tasks)

_PID = os.getpid()  # the process that imported this module: its OpenMP teams are usable


@functools.cache
def _gomp_parallel(path: str) -> int | None:
    try:
        fn = ctypes.CDLL(path).GOMP_parallel
    except (OSError, AttributeError):
        return None
    return ctypes.cast(fn, ctypes.c_void_p).value


@functools.cache
def _openmp_library(torch_dir: str | None) -> str | None:
    """The loaded OpenMP runtime to share: the one in PyTorch's package (``torch_dir``) when
    PyTorch is imported, else the only one loaded; None when it cannot be told (or not Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if ".so" in line}
    except OSError:
        return None
    names = ("libgomp", "libiomp5", "libomp")
    found = sorted(p for p in paths if os.path.basename(p).startswith(names))
    if torch_dir is not None:
        own = [p for p in found if p.startswith(torch_dir)]
        if own:
            return own[0]
    return found[0] if len(found) == 1 else None


def _torch_dir(torch: Any) -> str | None:
    """The directory of PyTorch's package (``torch`` the module, or None)."""
    if torch is None or not getattr(torch, "__file__", None):
        return None
    return str(Path(torch.__file__).parent)


_shared: list[Any] = [None, None, None]  # (pid, the torch module or None, GOMP_parallel)


def _forked() -> None:
    """In a forked child: the parent's team is not this process's (looked up again, it is
    refused: the pid is not :data:`_PID`). Asked at the fork, not on every call: a small call
    spent a fifth of a microsecond on ``os.getpid()``."""
    _shared[:] = [None, None, None]


if hasattr(os, "register_at_fork"):  # (POSIX; elsewhere no fork)
    os.register_at_fork(after_in_child=_forked)


def prefill_team(threads: int | None, own: bool) -> tuple[int, Any]:
    """``(worker threads, the OpenMP team's GOMP_parallel or None)`` of a prefill call
    (``own``: on the library's own tile products, no BLAS): the work items run on the OpenMP
    team the process runs (PyTorch's) where there is one, as the decode step's do. A pool of
    the library's own beside PyTorch's team shares the cores with that team's threads, which
    spin for milliseconds after each of PyTorch's operations."""
    if threads is None and own:  # (the kept roads' question, asked on every call: as below,
        # without workers()'s rules that do not apply to it, a third of its cost)
        n = default_threads()
        if n == 1:
            return 1, None
        team, most = openmp_parallel(n)
        return (n if team is None or most >= n else most), team
    n, team = workers(threads, blas=not own), None
    if n > 1:
        team, most = openmp_parallel(None)
        if team is not None and threads is None:
            n = min(n, most)
    return n, team


def openmp_parallel(threads: int | None = None) -> tuple[int | None, int]:
    """``(GOMP_parallel of the OpenMP runtime to share, or None; threads of its team)``.

    With PyTorch imported, its runtime and ``torch.get_num_threads()`` (capped by the
    threads qkv would use: ``threads``, a caller's :func:`workers` already worked out, or
    :func:`workers`); else the only OpenMP runtime the process has loaded, if one. Looked up
    again only when the process (a fork: :func:`_forked`) or the ``torch`` module changes.
    """
    if threads is None:
        threads = workers()
    torch = sys.modules.get("torch")
    if _shared[0] is None or _shared[1] is not torch:
        pid = os.getpid()
        path = _openmp_library(_torch_dir(torch)) if pid == _PID else None
        _shared[:] = [pid, torch, None if path is None else _gomp_parallel(path)]
    if torch is not None:
        most = torch.get_num_threads()
        if most < threads:
            threads = most if most > 1 else 1
    return _shared[2], threads
