"""Prefill in a model's layout: q, k, v as transposed views of ``(batch, L, heads, d)`` memory
(what a projection's output gives, and what FlashAttention's callers pass), the output wanted in
that layout, contiguous.

    python bench/layouts.py                  # float32 and bfloat16, 2 threads
    python bench/layouts.py --dtype bfloat16 --rounds 15

For each shape, in one process with interleaved rounds, the per-call time (median of the
rounds, each the best of a few calls) of:

- ``sdpa + copy``: PyTorch's ``scaled_dot_product_attention`` on the ``(batch, heads, L, d)``
  views, its output laid out as ``(batch, L, heads, dv)`` with ``.transpose(1, 2)
  .contiguous()`` (what a transformers model does with it; PyTorch's CPU kernel writes that
  layout already, so the copy is free);
- ``qkv bhld + copy``: ``qkv.attention`` on the same views, the same copy after;
- ``qkv blhd``: ``qkv.attention(..., layout="blhd")`` on the ``(batch, L, heads, d)``
  arrays, whose output comes back contiguous in that layout (the native prefill writes it
  there);
- ``qkv bhld, contiguous q``: ``qkv.attention`` on contiguous ``(batch, heads, L, d)`` copies
  and no copy after: the layout qkv computes in, for reference;

and each one's ratio to ``sdpa + copy``. All on CPU tensors; every result is checked against
PyTorch's first.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import _common

import qkv

SHAPES = [  # (B, H, kv heads, L = S, d, causal)
    (32, 12, 12, 53, 32, False),
    (8, 12, 12, 53, 32, False),
    (8, 8, 2, 120, 64, True),
    (1, 8, 2, 512, 64, True),
    (1, 8, 8, 512, 64, False),
]


def contenders(shape: tuple, dtype: str) -> dict[str, Callable[[], Any]]:
    """The four calls on one shape, checked against PyTorch's output."""
    import torch
    import torch.nn.functional as F

    B, H, kv, L, d, causal = shape
    g = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    x = torch.randn(B, L, H + 2 * kv, d, generator=g).to(dt)  # (a fused projection's output)
    qb, kb, vb = x[:, :, :H], x[:, :, H : H + kv], x[:, :, H + kv :]
    q, k, v = (t.transpose(1, 2) for t in (qb, kb, vb))
    qc, kc, vc = (t.contiguous() for t in (q, k, v))
    gqa = kv != H

    def sdpa() -> Any:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous()

    fns = {
        "sdpa + copy": sdpa,
        "qkv bhld + copy": lambda: (
            qkv.attention(q, k, v, causal=causal).transpose(1, 2).contiguous()
        ),  # fmt: skip
        "qkv blhd": lambda: qkv.attention(qb, kb, vb, causal=causal, layout="blhd"),
        "qkv bhld, contiguous q": lambda: qkv.attention(qc, kc, vc, causal=causal),
    }
    want = sdpa().float()
    tol = 1e-4 if dtype == "float32" else 3e-2
    for name, fn in fns.items():
        got = fn().float()
        if name != "qkv bhld, contiguous q":
            assert got.is_contiguous() and got.shape == want.shape, name
            got_blhd = got
        else:
            got_blhd = got.transpose(1, 2)
        assert torch.allclose(got_blhd, want, rtol=tol, atol=tol), (name, shape, dtype)
    return fns


def measure(fns: dict[str, Callable[[], Any]], rounds: int, calls: int) -> dict[str, float]:
    """Median over ``rounds`` of each contender's best of ``calls`` calls (seconds)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        names = list(fns) if r % 2 == 0 else list(reversed(fns))
        for name in names:
            best = float("inf")
            for _ in range(calls):
                t0 = time.perf_counter()
                fns[name]()
                best = min(best, time.perf_counter() - t0)
            times[name].append(best)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtype", default="float32,bfloat16", help="comma-separated")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    _common.same_threads(args.threads)
    rows = []
    for dtype in args.dtype.split(","):
        for shape in SHAPES:
            B, H, kv, L, d, causal = shape
            t = measure(contenders(shape, dtype), args.rounds, args.calls)
            peer = t["sdpa + copy"]
            for name, s in t.items():
                rows.append(
                    {
                        "dtype": dtype,
                        "shape": f"B{B} H{H} kv{kv} L=S={L} d{d}" + (" causal" if causal else ""),
                        "call": name,
                        "µs per call": f"{1e6 * s:.0f}",
                        "× sdpa + copy": f"{s / peer:.2f}",
                    }
                )
    print(f"qkv {qkv.__version__}, torch {torch.__version__}, median of {args.rounds} rounds")
    print(_common.threads_info())
    print(_common.table(rows, ["dtype", "shape", "call", "µs per call", "× sdpa + copy"]))


if __name__ == "__main__":
    main()
