"""Long-context benchmark: causal, float32, one head, N = 65536, d = 64, in O(N) memory.

    python bench/long_context.py [--n 65536] [--d 64] [--chunk 4096] [--no-torch]

The N x N score matrix alone would need 16 GiB; qkv's tiled kernel keeps O(tile · N). qkv runs
as chunked prefill through the public API — the queries of rows [r0, r1) against keys [0, r1),
bottom-right causal, which is exactly those rows of the full result — so a progress bar can
follow it. PyTorch's CPU scaled_dot_product_attention runs once over the whole sequence. Naive
NumPy is not run (it would need the 16 GiB matrix). Prints time ratio, effective GFLOP/s as a
fraction of the GEMM rate, and peak extra memory.
"""

from __future__ import annotations

import argparse
import sys

import _common
import machine
import numpy as np

import qkv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=4096, help="query rows per progress step")
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args()
    n, d, chunk = args.n, args.d, args.chunk

    gemm = machine.gemm_gflops()
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, n, d), dtype=np.float32) for _ in range(3))
    flops = 4 * n * n * d / 2

    def run_qkv() -> np.ndarray:
        out = np.empty((1, 1, n, d), dtype=np.float32)
        with _common.progress(flops / 1e9, "qkv") as bar:
            for r0 in range(0, n, chunk):
                r1 = min(r0 + chunk, n)
                out[..., r0:r1, :] = qkv.attention(
                    q[..., r0:r1, :], k[..., :r1, :], v[..., :r1, :], causal=True
                )
                bar.update(2 * (r1 - r0) * (r0 + r1) * d / 1e9)  # rows x mean keys x 4d
        return out

    times, outs, peaks = {}, {}, {}
    contenders = {"qkv": run_qkv}
    if not args.no_torch:
        try:
            import torch

            tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))

            def run_torch() -> np.ndarray:
                print("torch sdpa: one call, no progress to show ...", file=sys.stderr)
                with torch.no_grad():
                    f = torch.nn.functional.scaled_dot_product_attention
                    return f(tq, tk, tv, is_causal=True).numpy()

            contenders["torch sdpa"] = run_torch
        except ImportError:
            print("PyTorch not installed: no peer to compare against")
    for name, fn in contenders.items():
        result = {}

        def once(fn=fn, result=result) -> None:
            import time

            t0 = time.perf_counter()
            result["out"] = fn()
            result["t"] = time.perf_counter() - t0

        peak = _common.peak_extra_bytes(once)  # two runs (RSS view, tracemalloc view) ...
        once()  # ... and a timed one without tracing
        times[name], outs[name], peaks[name] = result["t"], result["out"], peak
    diffs = {name: float(np.max(np.abs(out - outs["qkv"]))) for name, out in outs.items()}
    print(f"long context causal float32 B1 H1 N{n} d{d}; GEMM {gemm:.0f} GFLOP/s")
    print(f"threads: {_common.threads_info()}")
    print(_common.flop_table(times, peaks, diffs, flops, gemm, lambda t: f"{t:,.2f} s"))


if __name__ == "__main__":
    main()
