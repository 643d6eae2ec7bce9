"""Packed variable-length benchmark: 64 causal prompts of 16..1024 tokens, H32 kv8 d128, float32.

    python bench/varlen.py [--batch 64] [--lo 16] [--hi 1024] [--heads 32] [--kv-heads 8]

Measures in one process ``qkv.attention_varlen`` on the packed batch (the native packed walk
of kernels/native.py where it is built, and again with ``QKV_NATIVE=0``, the NumPy walk over
sequences × kv heads × tiles; with ``--buckets`` also its older form that pads similar lengths
into batched calls, as the NumPy path still does for very short sequences), a Python loop of
``qkv.attention`` over the sequences, PyTorch's CPU scaled_dot_product_attention looped over
the sequences (its fastest form here: flash kernel, no padding) and PyTorch on the batch padded
to the longest prompt with a mask (``--no-padded`` skips it: its memory grows with batch ·
longest²). Prints the time ratio against the PyTorch loop, effective GFLOP/s (causal counts
half of ``4·L·S·d`` per head) as a fraction of this machine's float32 GEMM rate, peak extra
memory and threads.
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
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lo", type=int, default=16)
    ap.add_argument("--hi", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-padded", action="store_true")
    ap.add_argument("--buckets", action="store_true", help="also time the padded buckets")
    args = ap.parse_args()
    b, h, hkv, d = args.batch, args.heads, args.kv_heads, args.d

    gemm = machine.gemm_gflops()
    rng = np.random.default_rng(0)
    lens = rng.integers(args.lo, args.hi + 1, size=b)
    lens[0], lens[-1] = args.lo, args.hi
    cu = np.concatenate([[0], np.cumsum(lens)])
    total = int(cu[-1])
    q = rng.standard_normal((total, h, d), dtype=np.float32)
    k, v = (rng.standard_normal((total, hkv, d), dtype=np.float32) for _ in range(2))
    flops = float(h * 4 * d * np.sum(lens.astype(np.float64) ** 2) / 2)
    seqs = [(int(cu[i]), int(cu[i + 1])) for i in range(b)]

    def heads_first(x: np.ndarray, a: int, z: int) -> np.ndarray:
        return x[a:z].transpose(1, 0, 2)

    def qkv_loop() -> np.ndarray:
        out = np.empty((total, h, d), dtype=np.float32)
        for a, z in seqs:
            o = qkv.attention(
                heads_first(q, a, z), heads_first(k, a, z), heads_first(v, a, z), causal=True
            )
            out[a:z] = o.transpose(1, 0, 2)
        return out

    def native_off() -> np.ndarray:
        os.environ["QKV_NATIVE"] = "0"  # read on every call
        try:
            return qkv.attention_varlen(q, k, v, cu, cu, causal=True)
        finally:
            os.environ.pop("QKV_NATIVE")

    from qkv.engine.kernels import native

    os.environ.pop("QKV_NATIVE", None)
    info = native.info()
    print(f"native kernels: {info['reason']}; vector clone {info['isa']}")
    name = "qkv attention_varlen" + (" (native)" if info["active"] else "")
    contenders = {name: lambda: qkv.attention_varlen(q, k, v, cu, cu, causal=True)}
    if info["active"]:
        contenders["qkv attention_varlen QKV_NATIVE=0"] = native_off
    contenders["qkv loop of attention"] = qkv_loop
    if args.buckets:

        def buckets() -> np.ndarray:
            walk, qkv.engine.varlen.WALK_FLOPS = qkv.engine.varlen.WALK_FLOPS, float("inf")
            os.environ["QKV_NATIVE"] = "0"  # the buckets are the NumPy path's
            try:
                return qkv.attention_varlen(q, k, v, cu, cu, causal=True)
            finally:
                qkv.engine.varlen.WALK_FLOPS = walk
                os.environ.pop("QKV_NATIVE")

        contenders["qkv attention_varlen, buckets"] = buckets
    try:
        import torch

        sdpa = torch.nn.functional.scaled_dot_product_attention
        tq, tk, tv = (torch.from_numpy(x).permute(1, 0, 2) for x in (q, k, v))

        def torch_loop() -> np.ndarray:
            out = torch.empty((total, h, d))
            with torch.no_grad():
                for a, z in seqs:
                    o = sdpa(
                        tq[None, :, a:z],
                        tk[None, :, a:z],
                        tv[None, :, a:z],
                        is_causal=True,
                        enable_gqa=True,
                    )  # L == S: top-left == bottom-right
                    out[a:z] = o[0].permute(1, 0, 2)
            return out.numpy()

        contenders["torch sdpa"] = torch_loop
        if not args.no_padded:
            n = int(lens.max())
            pad = [np.zeros((b, x.shape[1], n, d), dtype=np.float32) for x in (q, k, v)]
            for i, (a, z) in enumerate(seqs):  # right padding: causal stays top-left aligned
                for p, x in zip(pad, (q, k, v), strict=True):
                    p[i, :, : z - a] = heads_first(x, a, z)
            keep = np.tril(np.ones((n, n), dtype=bool))[None] & (
                np.arange(n)[None, None, :] < lens[:, None, None]
            )
            pq, pk, pv = (torch.from_numpy(p) for p in pad)
            pmask = torch.from_numpy(keep[:, None])

            def torch_padded() -> np.ndarray:
                with torch.no_grad():
                    o = sdpa(pq, pk, pv, attn_mask=pmask, enable_gqa=True)
                return np.concatenate(
                    [o[i, :, : z - a].permute(1, 0, 2).numpy() for i, (a, z) in enumerate(seqs)]
                )

            contenders["torch sdpa padded + mask"] = torch_padded
    except ImportError:
        print("PyTorch not installed: no peer to compare against")

    ref = np.asarray(contenders[name]())
    times = _common.race(contenders, repeat=args.repeat)
    peaks, diffs = {}, {}
    for name, fn in contenders.items():
        diffs[name] = float(np.max(np.abs(np.asarray(fn()) - ref)))
        peaks[name] = _common.peak_extra_bytes(fn)
    print(
        f"varlen causal float32 {b} prompts of {args.lo}..{args.hi} tokens (total {total}), "
        f"H{h} kv{hkv} d{d}; GEMM {gemm:.0f} GFLOP/s"
    )
    print(f"threads: {_common.threads_info()}")
    print(_common.flop_table(times, peaks, diffs, flops, gemm, lambda t: f"{t * 1e3:,.1f} ms"))


if __name__ == "__main__":
    main()
