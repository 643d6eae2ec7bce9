"""Half precision and stored K/V forms: decode, a ragged cache and prefill, against PyTorch's
scaled_dot_product_attention in the same dtype, in one process.

    python bench/lowp.py                       # every table below
    python bench/lowp.py --only decode --repeat 7
    python bench/lowp.py --threads 2

Tables (PyTorch and qkv at ``--threads``, default every core this process may use):

- decode B8 and B1, H32 over 8 kv heads, S 4096, d 128, one query each: qkv.attention on
  bfloat16 and float16 tensors (K/V read in place by the native decode step; float16 rows
  against SDPA in float16), on float32 tensors, and
  qkv.KVCache storing K/V as bfloat16, int8 and float8 e4m3fn; PyTorch's SDPA on the bfloat16
  tensors. Each row: time, ratio to SDPA, K/V bytes read per second and that rate's share of
  this machine's read rate (``bench/machine.py``'s, measured at the start), and the rate of
  the step's products (``2·B·H·S·(d + dv)`` FLOP) against the machine's float32 GEMM rate
  (measured there too): the limit of a step bound by its arithmetic, as the 8-bit forms are.
- a ragged cache (lengths 1024..8192, B8, kv 8, d 128) in float32 and bfloat16: one native
  call for every sequence; PyTorch gets the sequences padded to the longest with a key mask.
- causal prefill B1 H8 N4096 d64 and B1 H16 N2048 d128 in bfloat16, forward and backward
  (autograd): qkv (its bfloat16 tile products where the CPU has AVX512_BF16) and SDPA; each
  row's share of this machine's bfloat16 matrix-product rate. The forward in float16 too (qkv:
  the float32 kernel reading K/V as stored), against SDPA in float16.

The decode and ragged rows are timed as a model calls attention: a few decoding steps (16
calls at least), one call per layer over a few layers, each with K/V of its own (at least 96 MiB
together, three times the last cache of the machine this was written on), so that every call
reads its K/V from memory and finds the threads of the call before it still warm; the time is
per call. (Timing one call after a pause,
as the prefill rows do, charges a 1 ms decoding step with waking the cores and threads.)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import _common
import machine
import numpy as np
import torch

import qkv


def _row(
    name: str, t: float, peer: float, nbytes: int, read: float, flops: float = 0, gemm: float = 0
) -> dict:
    rate = nbytes / t / 1e9
    row = {
        "contender": name,
        "ms": f"{t * 1e3:.2f}",
        "/ sdpa": f"{t / peer:.2f}x",
        "GB/s read": f"{rate:.1f}",
        "of read rate": f"{rate / read:.0%}",
    }
    if flops:  # the float32 products' rate against the machine's float32 GEMM
        row["products, of GEMM"] = f"{flops / t / 1e9:.0f} GFLOP/s, {flops / t / 1e9 / gemm:.0%}"
    return row


def _cache(form: str, k: np.ndarray, v: np.ndarray, lengths: list[int]) -> qkv.KVCache:
    b, hkv, _, d = k.shape
    cache = qkv.KVCache(b, hkv, d, dtype=form)
    for i, n in enumerate(lengths):
        cache.append(k[i, :, :n], v[i, :, :n], seq=i)
    return cache


def _layers(nbytes: int) -> int:
    """Layers of K/V to decode over, so that together they are at least 96 MiB, three times
    this machine's last cache: each call then reads its layer's K/V from memory, as a model's
    consecutive layers do (at least two)."""
    return max(2, -(-(96 << 20) // nbytes))


STEPS_CALLS = 16  # calls per timed run at least: a few decoding steps of the model


def _steps(calls: list[Callable[[], Any]]) -> tuple[Callable[[], None], int]:
    """A timed run of whole decoding steps, one call per layer in order, at least
    :data:`STEPS_CALLS` calls; and its number of calls (the caller divides by it)."""
    steps = max(1, -(-STEPS_CALLS // len(calls)))

    def run() -> None:
        for _ in range(steps):
            for call in calls:
                call()

    return run, steps * len(calls)


def decode(b: int, repeat: int, read: float, gemm: float) -> None:
    h, hkv, s, d = 32, 8, 4096, 128
    kv = 2 * b * hkv * s * d
    layers = _layers(2 * kv)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, 1, d, generator=g)
    qb, qn = q.bfloat16(), q.numpy()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls: dict[str, list[Callable[[], Any]]] = {}
    qh = q.half()
    for _ in range(layers):
        k, v = (torch.randn(b, hkv, s, d, generator=g) for _ in range(2))
        kb, vb = k.bfloat16(), v.bfloat16()
        kh, vh = k.half(), v.half()
        forms = ("bfloat16", "int8", "float8_e4m3fn")
        caches = {f: _cache(f, k.numpy(), v.numpy(), [s] * b) for f in forms}

        def peer(q=qb, k=kb, v=vb) -> None:
            with torch.no_grad():
                sdpa(q, k, v, enable_gqa=True)

        layer = {
            "torch sdpa bfloat16": peer,
            "qkv bfloat16 tensors": lambda kb=kb, vb=vb: qkv.attention(qb, kb, vb),
            "torch sdpa float16": lambda kh=kh, vh=vh: peer(qh, kh, vh),
            "qkv float16 tensors": lambda kh=kh, vh=vh: qkv.attention(qh, kh, vh),
            "qkv float32 tensors": lambda k=k, v=v: qkv.attention(q, k, v),
            **{f"qkv KVCache {f}": (lambda c=c: c.attend(qn)) for f, c in caches.items()},
        }
        for name, call in layer.items():
            calls.setdefault(name, []).append(call)
    runs = {n: _steps(c) for n, c in calls.items()}
    best = _common.race({n: run for n, (run, _) in runs.items()}, repeat=repeat)
    best = {n: t / runs[n][1] for n, t in best.items()}
    nbytes = {
        "torch sdpa bfloat16": 2 * kv,
        "qkv bfloat16 tensors": 2 * kv,
        "torch sdpa float16": 2 * kv,
        "qkv float16 tensors": 2 * kv,
        "qkv float32 tensors": 4 * kv,
        "qkv KVCache bfloat16": 2 * kv,
        "qkv KVCache int8": kv + 2 * b * hkv * s * 4,
        "qkv KVCache float8_e4m3fn": kv + 2 * b * hkv * s * 4,
    }
    half = ("torch sdpa float16", "qkv float16 tensors")  # against SDPA in float16
    peer_of = {n: best[half[0] if n in half else "torch sdpa bfloat16"] for n in best}
    flops = 2 * b * h * s * (d + d)  # scores and values: one multiply-add per pair
    rows = [_row(n, t, peer_of[n], nbytes[n], read, flops, gemm) for n, t in best.items()]
    print(
        f"\ndecode B{b} H{h} (kv {hkv}) S{s} d{d}, one query each; per call, one call per "
        f"layer over {layers} layers; {_common.threads_info()}"
    )
    print(_common.table(rows, list(rows[0])))


def ragged(repeat: int, read: float) -> None:
    b, h, hkv, d, lo, hi = 8, 32, 8, 128, 1024, 8192
    rng = np.random.default_rng(0)
    lengths = np.linspace(lo, hi, b).astype(int)
    rng.shuffle(lengths)
    total = int(lengths.sum()) * hkv * d * 2
    layers = _layers(2 * total)
    q = rng.standard_normal((b, h, 1, d), dtype=np.float32)
    keep = torch.from_numpy(np.arange(hi) < lengths[:, None])[:, None, None, :]
    tq = torch.from_numpy(q)
    bq = tq.bfloat16()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls: dict[str, list[Callable[[], Any]]] = {}
    for _ in range(layers):
        k, v = (rng.standard_normal((b, hkv, hi, d), dtype=np.float32) for _ in range(2))
        caches = {form: _cache(form, k, v, lengths.tolist()) for form in ("float32", "bfloat16")}
        tk, tv = torch.from_numpy(k), torch.from_numpy(v)
        padded = {"float32": (tq, tk, tv), "bfloat16": (bq, tk.bfloat16(), tv.bfloat16())}

        def peer(a) -> Callable[[], None]:
            def run() -> None:
                with torch.no_grad():
                    sdpa(*a, attn_mask=keep, enable_gqa=True)

            return run

        layer = {
            "torch sdpa float32 (padded, masked)": peer(padded["float32"]),
            "torch sdpa bfloat16 (padded, masked)": peer(padded["bfloat16"]),
            "qkv KVCache float32": lambda c=caches["float32"]: c.attend(q),
            "qkv KVCache bfloat16": lambda c=caches["bfloat16"]: c.attend(q),
        }
        for name, call in layer.items():
            calls.setdefault(name, []).append(call)
    runs = {n: _steps(c) for n, c in calls.items()}
    best = _common.race({n: run for n, (run, _) in runs.items()}, repeat=repeat)
    best = {n: t / runs[n][1] for n, t in best.items()}
    rows = []
    for name, t in best.items():
        item = 4 if "float32" in name else 2
        peer_name = f"torch sdpa {'float32' if item == 4 else 'bfloat16'} (padded, masked)"
        rows.append(_row(name, t, best[peer_name], total * item, read))
    print(
        f"\nragged cache B{b} H{h} (kv {hkv}) d{d}, lengths {lo}..{hi}; per call, one call "
        f"per layer over {layers} layers; {_common.threads_info()}"
    )
    print("(bytes: the real tokens' K/V; ratios against SDPA in the same dtype)")
    print(_common.table(rows, list(rows[0])))


def _bf16_rate() -> float:
    """This machine's bfloat16 matrix-product rate (FLOP/s): PyTorch's 2048² ``torch.mm``, best
    of five, at the threads PyTorch runs."""
    a = torch.randn(2048, 2048).bfloat16()
    best = _common.best_time(lambda: torch.mm(a, a), repeat=5, pause=0)
    return 2 * 2048**3 / best


def prefill(repeat: int) -> None:
    rate = _bf16_rate()
    for shape in ((1, 8, 4096, 64), (1, 16, 2048, 128)):
        _prefill_shape(*shape, rate=rate, repeat=repeat)


def _prefill_shape(b: int, h: int, n: int, d: int, *, rate: float, repeat: int) -> None:
    sdpa = torch.nn.functional.scaled_dot_product_attention
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(b, h, n, d, generator=g).bfloat16() for _ in range(4))
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]

    half = [x.half() for x in (q, k, v)]

    def peer() -> None:
        with torch.no_grad():
            sdpa(q, k, v, is_causal=True)

    def peer_half() -> None:
        with torch.no_grad():
            sdpa(*half, is_causal=True)

    def backward(fn):
        out = fn(*leaves, is_causal=True) if fn is sdpa else fn(*leaves, causal=True)
        return lambda: out.backward(dout, retain_graph=True)

    best = _common.race(
        {
            "torch sdpa bfloat16": peer,
            "qkv bfloat16": lambda: qkv.attention(q, k, v, causal=True),
            "torch sdpa bfloat16, backward": backward(sdpa),
            "qkv bfloat16, backward": backward(qkv.attention),
            "torch sdpa float16": peer_half,
            "qkv float16": lambda: qkv.attention(*half, causal=True),
        },
        repeat=repeat,
    )
    flops = 2 * 2 * b * h * n * n * d / 2  # two products, half the scores under causal
    rows = []
    for name, t in best.items():
        dtype = "bfloat16" if "bfloat16" in name else "float16"
        peer_t = best[f"torch sdpa {dtype}" + (", backward" if "backward" in name else "")]
        work = flops * (2.5 if "backward" in name else 1)  # five products against two
        rows.append(
            {
                "contender": name,
                "ms": f"{t * 1e3:.1f}",
                "/ sdpa": f"{t / peer_t:.2f}x",
                "GFLOP/s": f"{work / t / 1e9:.0f}",
                # float16 runs on float32 products: the bfloat16 rate is not its limit
                "share of bf16 mm": "-" if dtype == "float16" else f"{work / t / rate:.0%}",
            }
        )
    print(
        f"\ncausal prefill bfloat16 (and float16) B{b} H{h} N{n} d{d} (bfloat16 torch.mm 2048²: "
        f"{rate / 1e9:.0f} GFLOP/s); {_common.threads_info()}"
    )
    print(_common.table(rows, list(rows[0])))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=("decode", "ragged", "prefill"), default=None)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    read = machine.read_gbps()
    print(f"machine read rate {read:.1f} GB/s (bench/machine.py)")
    if args.only in (None, "decode"):
        gemm = machine.gemm_gflops()
        print(f"machine float32 GEMM {gemm:.0f} GFLOP/s (bench/machine.py)")
        for b in (8, 1):
            decode(b, args.repeat, read, gemm)
    if args.only in (None, "ragged"):
        ragged(args.repeat, read)
    if args.only in (None, "prefill"):
        prefill(args.repeat)


if __name__ == "__main__":
    main()
