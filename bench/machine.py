"""The machine's own limits, measured in this process: float32 GEMM rate and memory read rate.

Run alone (``python bench/machine.py``) or imported by the other benchmarks, which report their
results as fractions of these numbers.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import _common  # noqa: F401  (puts ../src on the path)
import numpy as np

from qkv.kernels._threads import cpu_count, single_threaded_blas


def gemm_gflops(n: int = 2048, repeat: int = 5) -> float:
    """Best float32 ``n x n @ n x n`` rate, BLAS with its default threads (GFLOP/s)."""
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((n, n), dtype=np.float32)
    t = _common.best_time(lambda: a @ b, repeat=repeat, pause=0.05)
    return 2 * n**3 / t / 1e9


def read_gbps(nbytes: int = 512 << 20, repeat: int = 5) -> float:
    """Best rate of reading a large float32 array once, all cores, one thread each (GB/s)."""
    x = np.ones(nbytes // 4, dtype=np.float32)
    threads = cpu_count()
    parts = np.array_split(x, threads)

    def run() -> None:
        with single_threaded_blas(), ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda p: float(p @ p), parts))  # sdot streams its input once

    return x.nbytes / _common.best_time(run, repeat=repeat, pause=0.05) / 1e9


def main() -> None:
    print(f"float32 GEMM (2048^3):  {gemm_gflops():7.1f} GFLOP/s")
    print(f"memory read (512 MiB): {read_gbps():7.1f} GB/s")
    print(f"threads: {_common.threads_info()}")


if __name__ == "__main__":
    main()
