"""Shared helpers for the benchmark scripts: timing, peak memory, threads, table output.

Timings are the best of a few runs after a warm-up (the machines are shared and noisy; the
best run is the least disturbed). Peak memory is the rise during one call, the larger of the
peak resident set's rise (Linux ``/proc/self/clear_refs``) and ``tracemalloc``'s peak.
"""

from __future__ import annotations

import os
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Run from a source checkout without installing: put ../src first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def best_time(fn: Callable[[], Any], repeat: int = 3, warmup: int = 1, pause: float = 0.2) -> float:
    """Best wall time of ``repeat`` calls after ``warmup`` calls (seconds)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeat):
        time.sleep(pause)  # let other runtimes' spinning worker threads go idle
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def race(
    contenders: dict[str, Callable[[], Any]], repeat: int = 3, pause: float = 0.2
) -> dict[str, float]:
    """Best wall time of each contender over ``repeat`` rounds, one call each per round.

    Interleaving the rounds lets every contender meet the same (drifting) background load.
    """
    for fn in contenders.values():  # warm-up
        fn()
    best = dict.fromkeys(contenders, float("inf"))
    for _ in range(repeat):
        for name, fn in contenders.items():
            time.sleep(pause)
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def peak_extra_bytes(fn: Callable[[], Any]) -> int:
    """Rise of peak memory during one ``fn()`` call (bytes), output included.

    The larger of two views: the peak resident set's rise (sees every allocator, but misses
    memory the allocator reuses from earlier frees) and ``tracemalloc``'s peak (sees NumPy's
    allocations exactly, not PyTorch's).
    """
    best = 0
    rss = _status_kib("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        fn()
        hwm = _status_kib("VmHWM")
        if rss is not None and hwm is not None:
            best = max(0, (hwm - rss) * 1024)
    except OSError:
        pass
    tracemalloc.start()
    try:
        fn()
        best = max(best, tracemalloc.get_traced_memory()[1])
    finally:
        tracemalloc.stop()
    return best


_held: list[Any] = []  # the BLAS limit same_threads sets, kept alive for the process


def same_threads(n: int) -> None:
    """Give qkv the ``n`` threads PyTorch gets (the caller sets ``torch.set_num_threads(n)``):
    its worker threads, native threads and decode teams (they follow ``OMP_NUM_THREADS``, read on
    every call), Numba's team and BLAS. Without it qkv would use every core the process may run
    on while PyTorch used ``n``: not a like-for-like race."""
    os.environ["OMP_NUM_THREADS"] = str(n)
    try:
        import numba

        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    except ImportError:
        pass
    try:
        from threadpoolctl import threadpool_limits

        _held.append(threadpool_limits(n, user_api="blas"))
    except ImportError:
        pass


def threads_info() -> str:
    """Threads each contender may use."""
    from qkv.engine.kernels.threads import default_threads

    parts = [f"qkv {default_threads()}"]
    try:
        import torch

        parts.append(f"torch {torch.get_num_threads()}")
    except ImportError:
        pass
    try:
        from threadpoolctl import threadpool_info

        blas = [f"{i['internal_api']} {i['num_threads']}" for i in threadpool_info()]
        parts.append("BLAS " + ", ".join(blas))
    except ImportError:
        parts.append("BLAS ? (threadpoolctl not installed)")
    parts.append(f"cores {os.cpu_count()}")
    return "; ".join(parts)


def mib(n: float) -> str:
    m = n / 2**20
    return f"{m:,.1f} MiB" if m < 10 else f"{m:,.0f} MiB"


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A Markdown table of ``rows`` (dicts) with the given ``columns``."""
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    head = "| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)) + " |"
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [
        "| " + " | ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)) + " |"
        for row in cells
    ]
    return "\n".join([head, rule, *body])


def flop_table(
    times: dict[str, float],
    peaks: dict[str, int],
    diffs: dict[str, float],
    flops: float,
    gemm: float,
    time_text: Callable[[float], str],
) -> str:
    """The table of a GEMM-bound workload: time, ratio to PyTorch, GFLOP/s, fraction of GEMM."""
    peer = times.get("torch sdpa")
    rows = [
        {
            "contender": name,
            "time": time_text(t),
            "time / torch": f"{t / peer:.2f}x" if peer else "-",
            "GFLOP/s": f"{flops / t / 1e9:.1f}",
            "of GEMM": f"{flops / t / 1e9 / gemm:.0%}",
            "peak extra": mib(peaks[name]),
            "max |diff| vs qkv": f"{diffs[name]:.1e}",
        }
        for name, t in times.items()
    ]
    cols = ["contender", "time", "time / torch", "GFLOP/s", "of GEMM", "peak extra"]
    return table(rows, cols + ["max |diff| vs qkv"])


def progress(total: float, desc: str):
    """A tqdm bar when tqdm is installed, else a minimal stand-in that prints percentages."""
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="GFLOP", file=sys.stderr)
    except ImportError:
        return _Plain(total, desc)


class _Plain:
    def __init__(self, total: float, desc: str) -> None:
        self.total, self.done, self.desc = total, 0.0, desc

    def update(self, n: float) -> None:
        self.done += n
        print(f"{self.desc}: {100 * self.done / self.total:5.1f}%", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass

    def __enter__(self) -> _Plain:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
