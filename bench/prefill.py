"""Prefill benchmark: causal attention, float32, batch 1, 8 heads, N = 4096, d = 64.

    python bench/prefill.py [--n 4096] [--heads 8] [--kv-heads 8] [--d 64] [--repeat 3]

Measures in one process qkv.attention (kernel "auto": the native fused kernel of
kernels/native.py where it is built, and again with QKV_NATIVE=0, which runs the packed walk of
kernels/packed.py; and the general tiled kernel, forced), PyTorch's CPU
scaled_dot_product_attention and naive NumPy (materialised scores); prints the time ratio
against PyTorch, effective GFLOP/s (causal counts half of 4·N²·d per head) as a fraction of
this machine's float32 GEMM rate, peak extra memory and threads.
"""

from __future__ import annotations

import argparse
import os

import _common
import machine
import numpy as np

import qkv


def naive(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """The textbook formula: full score matrix, mask, softmax, weighted sum."""
    n = q.shape[-2]
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    s = np.where(np.tri(n, dtype=bool), s, -np.inf)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return (w / w.sum(axis=-1, keepdims=True)) @ v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=None, help="kv heads (default: heads)")
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-naive", action="store_true")
    args = ap.parse_args()
    n, h, d = args.n, args.heads, args.d
    hkv = h if args.kv_heads is None else args.kv_heads

    gemm = machine.gemm_gflops()
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, h, n, d), dtype=np.float32)
    k, v = (rng.standard_normal((1, hkv, n, d), dtype=np.float32) for _ in range(2))
    flops = h * 4 * n * n * d / 2

    def native_off():
        os.environ["QKV_NATIVE"] = "0"  # read on every call
        try:
            return qkv.attention(q, k, v, causal=True)
        finally:
            os.environ.pop("QKV_NATIVE")

    from qkv.engine.kernels import native

    active = native.info()["active"]
    print(f"native kernels: {native.info()['reason']}; vector clone {native.info()['isa']}")
    os.environ.pop("QKV_NATIVE", None)
    contenders = {
        # auto: the native kernel where built, else the packed walk
        "qkv" if not active else "qkv (native)": lambda: qkv.attention(q, k, v, causal=True),
        "qkv kernel=tiled": lambda: qkv.attention(q, k, v, causal=True, kernel="tiled"),
    }
    if active:
        contenders["qkv QKV_NATIVE=0 (packed)"] = native_off
    try:
        import torch

        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def run_torch():
            with torch.no_grad():
                # L == S: top-left == bottom-right
                return sdpa(tq, tk, tv, is_causal=True, enable_gqa=hkv != h)

        contenders["torch sdpa"] = run_torch
    except ImportError:
        print("PyTorch not installed: no peer to compare against")
    if not args.no_naive and hkv == h:
        contenders["naive numpy"] = lambda: naive(q, k, v)

    ref = np.asarray(next(iter(contenders.values()))())
    times = _common.race(contenders, repeat=args.repeat)
    peaks, diffs = {}, {}
    for name, fn in contenders.items():
        diffs[name] = float(np.max(np.abs(np.asarray(fn()) - ref)))
        peaks[name] = _common.peak_extra_bytes(fn)
    print(f"prefill causal float32 B1 H{h} kv{hkv} N{n} d{d}; GEMM {gemm:.0f} GFLOP/s")
    print(f"threads: {_common.threads_info()}")
    print(_common.flop_table(times, peaks, diffs, flops, gemm, lambda t: f"{t * 1e3:,.1f} ms"))


if __name__ == "__main__":
    main()
