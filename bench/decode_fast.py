"""The decode step's opt-in fast road for int8 K/V (``precision="fast"``) against the exact
road on int8, bfloat16 and float32 K/V, and PyTorch's scaled_dot_product_attention on float32,
in one process.

    python bench/decode_fast.py                    # B8 and B1, H32 kv8 S4096 d128, 1 and 2 threads
    python bench/decode_fast.py --batch 8 --threads 2 --rounds 9

Each contender is a planned step (``qkv.plan_decode``, one query row per sequence) run as a
model runs it: one call per layer over a few layers, each layer with K/V of its own (at least
96 MiB together), so that every call reads its K/V from memory. The contenders take turns
within each round (alternating runs, as the load drifts), and each round's time of a
contender is divided by the exact bfloat16 step's time of the same round; the table gives
the median of those ratios, the median time per call, the K/V bytes read per second (codes and
scales) against this machine's read rate, and nanoseconds per key row (one kv head's key and
value of one position) against the time the step's products take at this machine's float32
GEMM rate (``bench/machine.py``: its FMA limit, ``2 · group · (d + dv)`` FLOP per key row).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import _common
import machine
import numpy as np

import qkv

LAYER_BYTES = 96 << 20  # K/V of all layers together at least this: each call reads memory


def contenders(
    B: int, H: int, kvh: int, S: int, d: int, threads: int
) -> dict[str, tuple[Callable[[], Any], int]]:
    """``name: (one call, K/V bytes it reads)``, each cycling over its layers."""
    import torch

    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, H, 1, d)).astype(np.float32)
    k = rng.standard_normal((B, kvh, S, d)).astype(np.float32)
    v = rng.standard_normal((B, kvh, S, d)).astype(np.float32)
    kc, ks = qkv.quantize_kv(k, "int8")
    vc, vs = qkv.quantize_kv(v, "int8")
    kb, _ = qkv.quantize_kv(k, "bfloat16")
    vb, _ = qkv.quantize_kv(v, "bfloat16")
    forms: dict[str, tuple[tuple[np.ndarray, ...], dict[str, Any]]] = {
        "int8 fast": ((kc, vc, ks, vs), dict(kv_format="int8", precision="fast")),
        "int8 exact": ((kc, vc, ks, vs), dict(kv_format="int8")),
        "bfloat16 exact": ((kb, vb), dict(kv_format="bfloat16")),
        "float32": ((k, v), {}),
    }
    out: dict[str, tuple[Callable[[], Any], int]] = {}
    for name, (arrays, options) in forms.items():
        size = sum(a.nbytes for a in arrays)
        more = -(-LAYER_BYTES // size) - 1
        layers = [arrays] + [tuple(a.copy() for a in arrays) for _ in range(more)]
        scales = dict(k_scale=arrays[2], v_scale=arrays[3]) if len(arrays) == 4 else {}
        plan = qkv.plan_decode(q, arrays[0], arrays[1], threads=threads, **scales, **options)
        assert plan.route.startswith("native decode"), plan.refused
        if "fast" in name:
            assert plan.route == "native decode, fast int8", plan.route

        def call(plan=plan, layers=layers, at=[0]) -> None:  # noqa: B006 (the layer counter)
            ls = layers[at[0] % len(layers)]
            at[0] += 1
            if len(ls) == 4:
                plan.run(q, ls[0], ls[1], k_scale=ls[2], v_scale=ls[3])
            else:
                plan.run(q, ls[0], ls[1])

        out[name] = (call, size)
    tq = torch.from_numpy(q)
    size = k.nbytes + v.nbytes
    tl = [(torch.from_numpy(k), torch.from_numpy(v))]
    tl += [(a.clone(), b.clone()) for a, b in [tl[0]] * (-(-LAYER_BYTES // size) - 1)]

    def sdpa(at=[0]) -> None:  # noqa: B006
        tk, tv = tl[at[0] % len(tl)]
        at[0] += 1
        torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)

    out["torch sdpa float32"] = (sdpa, size)
    return out


def measure(
    calls: dict[str, tuple[Callable[[], Any], int]], rounds: int, per: int
) -> dict[str, list[float]]:
    """Seconds per call of each contender in each round (``per`` calls a round, in turn)."""
    for fn, _ in calls.values():
        for _ in range(per):
            fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(rounds):
        names = list(calls) if r % 2 == 0 else list(reversed(calls))  # alternate the order
        for name in names:
            fn = calls[name][0]
            t0 = time.perf_counter()
            for _ in range(per):
                fn()
            times[name].append((time.perf_counter() - t0) / per)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="*", default=[8, 1])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--s", type=int, default=4096)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=16, help="calls per contender per round")
    args = ap.parse_args()
    import torch

    from qkv.engine.kernels import native_lib

    read = machine.read_gbps()
    gemm = machine.gemm_gflops()
    lib = native_lib.library()[0]
    clone = {v: k for k, v in native_lib.ISAS.items()}.get(
        min(lib.qkv_best_isa(), native_lib.isa_cap() or 99) if lib else 0, "none"
    )
    print(f"read rate {read:.1f} GB/s, float32 GEMM {gemm:.1f} GFLOP/s, decode clone {clone}")
    H, kvh, S, d = args.heads, args.kv_heads, args.s, args.d
    for B in args.batch:
        for n in args.threads:
            torch.set_num_threads(n)
            _common.same_threads(n)
            calls = contenders(B, H, kvh, S, d, n)
            times = measure(calls, args.rounds, args.calls)
            base = times["bfloat16 exact"]
            rows = B * kvh * S  # key rows (one kv head's key and value at one position)
            flops = 2 * (H // kvh) * 2 * d  # per key row: q·k and w·v for each query row
            print(f"\nB{B} H{H} kv{kvh} S{S} d{d}, {n} thread(s), {args.rounds} rounds")
            print(
                f"{'contender':20} {'ms/call':>8} {'/ bf16':>7} {'GB/s':>6} {'of read':>7} "
                f"{'ns/row':>7} {'FMA ns/row':>10}"
            )
            for name, ts in times.items():
                t = statistics.median(ts)
                ratio = statistics.median(a / b for a, b in zip(ts, base, strict=True))
                gbs = calls[name][1] / t / 1e9
                fma = flops / (gemm * n / _cores()) if gemm else float("nan")
                print(
                    f"{name:20} {t * 1e3:8.3f} {ratio:7.3f} {gbs:6.1f} {gbs / read:7.0%} "
                    f"{t / rows * 1e9:7.3f} {fma:10.3f}"
                )


def _cores() -> int:
    from qkv.engine.kernels.threads import cpu_count

    return cpu_count()


if __name__ == "__main__":
    main()
