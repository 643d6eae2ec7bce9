"""Small-call benchmark: what one call of qkv costs beyond its arithmetic.

    python bench/overhead.py [--calls 2000] [--rounds 7] [--threads 2]
    python bench/overhead.py --masks     # masked prefill calls: a boolean mask, a float bias

A 32-layer model decoding one token calls attention 32 times per token on tiny problems, so
the fixed cost of a call (argument checks, reading tensors, choosing a kernel, giving the result
back) matters as much as the kernel. For each shape (default: B1 H8 L1 S16 d64 and B1 H12 L1
S128 d64, float32) this measures, in one process with interleaved rounds:

- ``qkv.attention`` on NumPy arrays and on CPU tensors (no autograd), and on CPU tensors with
  grouped kv heads (GQA, 4 query heads per kv head);
- PyTorch's ``scaled_dot_product_attention`` on the same tensors (the peer);

and prints the per-call time of each (best round of ``--calls`` calls) and its ratio to
PyTorch's. The result is checked against PyTorch's before timing.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import _common
import numpy as np

import qkv


def per_call(fn: Callable[[], Any], calls: int) -> float:
    """Seconds per call over ``calls`` back-to-back calls."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--masks", action="store_true",
        help="masked calls instead: a boolean mask that is no padding, and a float bias",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.masks:
        return masked(args)

    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    shapes = [(1, 8, 1, 16, 64), (1, 12, 1, 128, 64)]
    print(f"qkv {qkv.__version__}, torch {torch.__version__}, float32, {args.threads} threads, "
          f"best of {args.rounds} rounds of {args.calls} calls; OPENBLAS_CORETYPE="
          f"{os.environ.get('OPENBLAS_CORETYPE', '(unset)')}")  # fmt: skip
    rows = []
    for B, H, L, S, d in shapes:
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((B, H, n, d), dtype=np.float32) for n in (L, S, S))
        qt, kt, vt = (torch.from_numpy(x) for x in (q, k, v))
        kg, vg = kt[:, : H // 4].contiguous(), vt[:, : H // 4].contiguous()
        want = F.scaled_dot_product_attention(qt, kt, vt).numpy()
        np.testing.assert_allclose(qkv.attention(q, k, v), want, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(qkv.attention(qt, kt, vt).numpy(), want, rtol=1e-4, atol=1e-5)
        contenders = {
            "torch sdpa": lambda qt=qt, kt=kt, vt=vt: F.scaled_dot_product_attention(qt, kt, vt),
            "qkv numpy": lambda q=q, k=k, v=v: qkv.attention(q, k, v),
            "qkv tensor": lambda qt=qt, kt=kt, vt=vt: qkv.attention(qt, kt, vt),
            "qkv tensor gqa": lambda qt=qt, kg=kg, vg=vg: qkv.attention(qt, kg, vg),
            "torch sdpa gqa": lambda qt=qt, kg=kg, vg=vg: F.scaled_dot_product_attention(
                qt, kg, vg, enable_gqa=True
            ),
        }
        best = dict.fromkeys(contenders, float("inf"))
        for fn in contenders.values():
            per_call(fn, args.calls // 10)  # warm-up
        for _ in range(args.rounds):
            for name, fn in contenders.items():
                best[name] = min(best[name], per_call(fn, args.calls))
        shape = f"B{B} H{H} L{L} S{S} d{d}"
        for name, t in best.items():
            peer = best["torch sdpa gqa" if name.endswith("gqa") else "torch sdpa"]
            rows.append(
                {"shape": shape, "call": name, "µs per call": f"{t * 1e6:.1f}",
                 "× torch": f"{t / peer:.2f}"}
            )  # fmt: skip
    print(_common.threads_info())
    print(_common.table(rows, ["shape", "call", "µs per call", "× torch"]))


def masked(args: argparse.Namespace) -> None:
    """``--masks``: prefill calls with a boolean mask (B, 1, L, S) that is no padding (each
    row's first key hidden) and with a float bias (1, H, L, S), against PyTorch's SDPA given the
    same ``attn_mask``; qkv on NumPy arrays and on tensors."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    print(f"qkv {qkv.__version__}, torch {torch.__version__}, float32, {args.threads} threads, "
          f"best of {args.rounds} rounds; masked calls")  # fmt: skip
    rows = []
    for B, H, L, d in [(1, 8, 16, 64), (1, 8, 128, 64), (8, 12, 53, 32), (1, 8, 512, 64)]:
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((B, H, L, d), dtype=np.float32) for _ in range(3))
        keep = rng.random((B, 1, L, L)) > 0.2
        keep[..., 0], keep[..., -1] = False, True  # (no row's visible keys a prefix)
        bias = rng.standard_normal((1, H, L, L), dtype=np.float32)
        calls = max(3, args.calls // max(1, B * H * L * L // 20000))
        for kind, m in (("bool mask", keep), ("float bias", bias)):
            qt, kt, vt, mt = (torch.from_numpy(x) for x in (q, k, v, m))
            want = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mt).numpy()
            np.testing.assert_allclose(qkv.attention(q, k, v, mask=m), want, rtol=1e-4, atol=1e-5)
            contenders = {
                "torch sdpa": lambda qt=qt, kt=kt, vt=vt, mt=mt: F.scaled_dot_product_attention(
                    qt, kt, vt, attn_mask=mt
                ),
                "qkv numpy": lambda q=q, k=k, v=v, m=m: qkv.attention(q, k, v, mask=m),
                "qkv tensor": lambda qt=qt, kt=kt, vt=vt, mt=mt: qkv.attention(qt, kt, vt, mask=mt),
            }
            best = dict.fromkeys(contenders, float("inf"))
            for fn in contenders.values():
                per_call(fn, max(1, calls // 10))  # warm-up
            for _ in range(args.rounds):
                for name, fn in contenders.items():
                    best[name] = min(best[name], per_call(fn, calls))
            for name, t in best.items():
                rows.append(
                    {"shape": f"B{B} H{H} L=S={L} d{d}", "mask": kind, "call": name,
                     "µs per call": f"{t * 1e6:.1f}", "× torch": f"{t / best['torch sdpa']:.2f}"}
                )  # fmt: skip
    print(_common.threads_info())
    print(_common.table(rows, ["shape", "mask", "call", "µs per call", "× torch"]))


if __name__ == "__main__":
    main()
