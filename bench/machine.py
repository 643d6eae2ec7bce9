"""The machine's own limits, measured in this process: float32 GEMM rate, memory read rate
and, with the native library built, the float32 FMA peak of its widest vector clone (the
library's own micro-benchmark: register-resident FMA chains, no memory read, one call per
core), which does not depend on the BLAS build or its run-time core choice
(``OPENBLAS_CORETYPE``).

Run alone (``python bench/machine.py``) or imported by the other benchmarks, which report their
results as fractions of these numbers.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import _common  # noqa: F401  (puts ../src on the path)
import numpy as np

from qkv.engine.kernels import native_lib
from qkv.engine.kernels.threads import cpu_count, single_threaded_blas


def gemm_gflops(n: int = 2048, repeat: int = 5) -> float:
    """Best float32 ``n x n @ n x n`` rate, BLAS with its default threads (GFLOP/s)."""
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((n, n), dtype=np.float32)
    t = _common.best_time(lambda: a @ b, repeat=repeat, pause=0.05)
    return 2 * n**3 / t / 1e9


def read_gbps(nbytes: int = 1 << 30, repeat: int = 3) -> float:
    """Best rate of reading a large float32 array once (GB/s).

    The best over 1 up to every core (one thread each on its part of the array) and two
    streaming reductions (BLAS ``sdot`` and NumPy ``sum``): which one saturates the
    memory differs between machines, and the best is the honest denominator.
    """
    x = np.ones(nbytes // 4, dtype=np.float32)
    readers = (lambda p: float(p @ p), lambda p: float(p.sum()))
    best = 0.0
    with single_threaded_blas(), ThreadPoolExecutor(cpu_count()) as pool:
        for threads in range(1, cpu_count() + 1):
            parts = np.array_split(x, threads)
            for read in readers:

                def run(parts=parts, read=read) -> None:
                    list(pool.map(read, parts))

                t = _common.best_time(run, repeat=repeat, pause=0.05)
                best = max(best, x.nbytes / t / 1e9)
    return best


def fma_gflops(threads: int | None = None, seconds: float = 0.2) -> float | None:
    """Best float32 FMA rate of the native library's widest clone on ``threads`` cores (all by
    default), GFLOP/s: ``qkv_fma_peak`` run once per core at a time for about ``seconds``, best
    of three; None without the library."""
    lib = native_lib.library()[0]
    if lib is None:
        return None
    n = threads or cpu_count()
    rounds = 100_000
    while True:  # rounds that take about `seconds` on one core
        t = time.perf_counter()
        lib.qkv_fma_peak(0, rounds)
        if time.perf_counter() - t > seconds / 4:
            break
        rounds *= 4
    best = 0.0
    with ThreadPoolExecutor(n) as pool:  # (ctypes lets go of the GIL during each call)
        for _ in range(3):
            t = time.perf_counter()
            flops = sum(pool.map(lambda _: lib.qkv_fma_peak(0, rounds), range(n)))
            best = max(best, flops / (time.perf_counter() - t) / 1e9)
    return best


def main() -> None:
    print(f"float32 GEMM (2048^3):  {gemm_gflops():7.1f} GFLOP/s")
    print(f"memory read (1 GiB):   {read_gbps():7.1f} GB/s")
    peak, one = fma_gflops(), fma_gflops(1)
    if peak is not None and one is not None:
        clone = "the native library's widest clone"
        print(f"float32 FMA peak:      {peak:7.1f} GFLOP/s ({one:.1f} on one core; {clone})")
    print(f"threads: {_common.threads_info()}")


if __name__ == "__main__":
    main()
