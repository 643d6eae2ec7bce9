"""Backward benchmark: gradients of causal attention, float32, batch 1, 8 heads, N = 4096, d = 64.

    python bench/backward.py [--n 4096] [--heads 8] [--kv-heads 8] [--d 64] [--repeat 3]

Measures in one process the backward pass alone: qkv.attention_vjp given the forward pass's
output and log-sum-exp (the FlashAttention-2 backward: the native kernel of kernels/native.py
where it is built, and again with QKV_NATIVE=0, the NumPy one of kernels/tiled_backward.py),
against PyTorch's autograd through its CPU scaled_dot_product_attention (the graph is kept, so
only its backward is timed), and loss.backward() through qkv.attention on tensors (the PyTorch
bridge, which runs the same tiled backward from the forward's saved out and lse). Prints the
time ratio against PyTorch, effective GFLOP/s (five products of 2·N²·d per head, halved by
causal) as a fraction of this machine's float32 GEMM rate, peak extra memory and threads.
"""

from __future__ import annotations

import argparse
import os

import _common
import machine
import numpy as np

import qkv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=None, help="kv heads (default: heads)")
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    n, h, d = args.n, args.heads, args.d
    hkv = h if args.kv_heads is None else args.kv_heads

    from qkv.engine.kernels import native

    gemm = machine.gemm_gflops()
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, h, n, d), dtype=np.float32)
    k, v = (rng.standard_normal((1, hkv, n, d), dtype=np.float32) for _ in range(2))
    d_out = rng.standard_normal((1, h, n, d), dtype=np.float32)
    out, lse = qkv.attention(q, k, v, causal=True, return_lse=True)
    flops = h * 5 * 2 * n * n * d / 2

    def vjp():
        return qkv.attention_vjp(q, k, v, d_out, causal=True, out=out, lse=lse)

    def vjp_numpy():
        os.environ["QKV_NATIVE"] = "0"  # read on every call
        try:
            return vjp()
        finally:
            os.environ.pop("QKV_NATIVE")

    info = native.info()
    print(f"native kernels: {info['reason']}; vector clone {info['isa']}")
    os.environ.pop("QKV_NATIVE", None)
    contenders = {"qkv (native)" if info["active"] else "qkv": vjp}
    if info["active"]:
        contenders["qkv QKV_NATIVE=0"] = vjp_numpy
    try:
        import torch

        tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
        tdo = torch.from_numpy(d_out)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        tout = sdpa(tq, tk, tv, is_causal=True, enable_gqa=hkv != h)  # L == S: either alignment

        def run_torch():
            for x in (tq, tk, tv):
                x.grad = None
            tout.backward(tdo, retain_graph=True)
            return tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()

        contenders["torch sdpa"] = run_torch

        # loss.backward() through qkv.attention on tensors: the bridge saves the forward's out
        # and lse and runs the same tiled backward (its graph is kept, so only it is timed)
        aq, ak, av = (torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v))
        aout = qkv.attention(aq, ak, av, causal=True)

        def run_autograd():
            for x in (aq, ak, av):
                x.grad = None
            aout.backward(tdo, retain_graph=True)
            return aq.grad.numpy(), ak.grad.numpy(), av.grad.numpy()

        contenders["qkv autograd"] = run_autograd
    except ImportError:
        print("PyTorch not installed: no peer to compare against")

    ref = next(iter(contenders.values()))()
    times = _common.race(contenders, repeat=args.repeat)
    peaks, diffs = {}, {}
    for name, fn in contenders.items():
        got = fn()
        diffs[name] = max(
            float(np.max(np.abs(np.asarray(a) - b))) for a, b in zip(got, ref, strict=True)
        )
        peaks[name] = _common.peak_extra_bytes(fn)
    print(f"backward causal float32 B1 H{h} kv{hkv} N{n} d{d}; GEMM {gemm:.0f} GFLOP/s")
    print(f"threads: {_common.threads_info()}")
    print(_common.flop_table(times, peaks, diffs, flops, gemm, lambda t: f"{t * 1e3:,.1f} ms"))


if __name__ == "__main__":
    main()
