"""Half precision and stored K/V forms: decode, a ragged cache and prefill, against PyTorch's
scaled_dot_product_attention in the same dtype, in one process.

    python bench/lowp.py                       # every table below
    python bench/lowp.py --only decode --repeat 7
    python bench/lowp.py --threads 2

Tables (PyTorch and qkv at ``--threads``, default every core this process may use):

- decode B8 and B1, H32 over 8 kv heads, S 4096, d 128, one query each: qkv.attention on
  bfloat16 tensors (K/V read in place by the native decode step), on float32 tensors, and
  qkv.KVCache storing K/V as bfloat16, int8 and float8 e4m3fn; PyTorch's SDPA on the bfloat16
  tensors. Each row: time, ratio to SDPA, K/V bytes read per second and that rate's share of
  this machine's read rate (``bench/machine.py``'s, measured at the start).
- a ragged cache (lengths 1024..8192, B8, kv 8, d 128) in float32 and bfloat16: one native
  call for every sequence; PyTorch gets the sequences padded to the longest with a key mask.
- causal prefill B1 H8 N4096 d64 and B1 H16 N2048 d128 in bfloat16, forward and backward
  (autograd): qkv (its bfloat16 tile products where the CPU has AVX512_BF16; the backward
  widens to float32) and SDPA; each row's share of this machine's bfloat16 matrix-product rate.
"""

from __future__ import annotations

import argparse

import _common
import machine
import numpy as np
import torch

import qkv


def _row(name: str, t: float, peer: float, nbytes: int, read: float) -> dict:
    rate = nbytes / t / 1e9
    return {
        "contender": name,
        "ms": f"{t * 1e3:.2f}",
        "/ sdpa": f"{t / peer:.2f}x",
        "GB/s read": f"{rate:.1f}",
        "of read rate": f"{rate / read:.0%}",
    }


def _cache(form: str, k: np.ndarray, v: np.ndarray, lengths: list[int]) -> qkv.KVCache:
    b, hkv, _, d = k.shape
    cache = qkv.KVCache(b, hkv, d, dtype=form)
    for i, n in enumerate(lengths):
        cache.append(k[i, :, :n], v[i, :, :n], seq=i)
    return cache


def decode(b: int, repeat: int, read: float) -> None:
    h, hkv, s, d = 32, 8, 4096, 128
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, 1, d, generator=g)
    k, v = (torch.randn(b, hkv, s, d, generator=g) for _ in range(2))
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    kn, vn = k.numpy(), v.numpy()
    caches = {form: _cache(form, kn, vn, [s] * b) for form in ("bfloat16", "int8", "float8_e4m3fn")}
    qn = q.numpy()

    def peer() -> None:
        with torch.no_grad():
            sdpa(qb, kb, vb, enable_gqa=True)

    contenders = {
        "torch sdpa bfloat16": peer,
        "qkv bfloat16 tensors": lambda: qkv.attention(qb, kb, vb),
        "qkv float32 tensors": lambda: qkv.attention(q, k, v),
        **{f"qkv KVCache {f}": (lambda c=c: c.attend(qn)) for f, c in caches.items()},
    }
    best = _common.race(contenders, repeat=repeat)
    kv = 2 * b * hkv * s * d
    nbytes = {
        "torch sdpa bfloat16": 2 * kv,
        "qkv bfloat16 tensors": 2 * kv,
        "qkv float32 tensors": 4 * kv,
        "qkv KVCache bfloat16": 2 * kv,
        "qkv KVCache int8": kv + 2 * b * hkv * s * 4,
        "qkv KVCache float8_e4m3fn": kv + 2 * b * hkv * s * 4,
    }
    rows = [_row(n, t, best["torch sdpa bfloat16"], nbytes[n], read) for n, t in best.items()]
    print(f"\ndecode B{b} H{h} (kv {hkv}) S{s} d{d}, one query each; {_common.threads_info()}")
    print(_common.table(rows, list(rows[0])))


def ragged(repeat: int, read: float) -> None:
    b, h, hkv, d, lo, hi = 8, 32, 8, 128, 1024, 8192
    rng = np.random.default_rng(0)
    lengths = np.linspace(lo, hi, b).astype(int)
    rng.shuffle(lengths)
    k, v = (rng.standard_normal((b, hkv, hi, d), dtype=np.float32) for _ in range(2))
    q = rng.standard_normal((b, h, 1, d), dtype=np.float32)
    caches = {form: _cache(form, k, v, lengths.tolist()) for form in ("float32", "bfloat16")}
    keep = torch.from_numpy(np.arange(hi) < lengths[:, None])[:, None, None, :]
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    bq, bk, bv = (x.bfloat16() for x in (tq, tk, tv))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def peer(dtype: str):
        a = (tq, tk, tv) if dtype == "float32" else (bq, bk, bv)

        def run() -> None:
            with torch.no_grad():
                sdpa(*a, attn_mask=keep, enable_gqa=True)

        return run

    contenders = {
        "torch sdpa float32 (padded, masked)": peer("float32"),
        "torch sdpa bfloat16 (padded, masked)": peer("bfloat16"),
        "qkv KVCache float32": lambda: caches["float32"].attend(q),
        "qkv KVCache bfloat16": lambda: caches["bfloat16"].attend(q),
    }
    best = _common.race(contenders, repeat=repeat)
    total = int(lengths.sum()) * hkv * d * 2
    rows = []
    for name, t in best.items():
        item = 4 if "float32" in name else 2
        peer_name = f"torch sdpa {'float32' if item == 4 else 'bfloat16'} (padded, masked)"
        rows.append(_row(name, t, best[peer_name], total * item, read))
    print(f"\nragged cache B{b} H{h} (kv {hkv}) d{d}, lengths {lo}..{hi}; {_common.threads_info()}")
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

    def peer() -> None:
        with torch.no_grad():
            sdpa(q, k, v, is_causal=True)

    def backward(fn):
        out = fn(*leaves, is_causal=True) if fn is sdpa else fn(*leaves, causal=True)
        return lambda: out.backward(dout, retain_graph=True)

    best = _common.race(
        {
            "torch sdpa bfloat16": peer,
            "qkv bfloat16": lambda: qkv.attention(q, k, v, causal=True),
            "torch sdpa bfloat16, backward": backward(sdpa),
            "qkv bfloat16, backward": backward(qkv.attention),
        },
        repeat=repeat,
    )
    flops = 2 * 2 * b * h * n * n * d / 2  # two products, half the scores under causal
    rows = []
    for name, t in best.items():
        peer_t = best["torch sdpa bfloat16" + (", backward" if "backward" in name else "")]
        work = flops * (2.5 if "backward" in name else 1)  # five products against two
        rows.append(
            {
                "contender": name,
                "ms": f"{t * 1e3:.1f}",
                "/ sdpa": f"{t / peer_t:.2f}x",
                "GFLOP/s": f"{work / t / 1e9:.0f}",
                "share of bf16 mm": f"{work / t / rate:.0%}",
            }
        )
    print(
        f"\ncausal prefill bfloat16 B{b} H{h} N{n} d{d} (bfloat16 torch.mm 2048²: "
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
        for b in (8, 1):
            decode(b, args.repeat, read)
    if args.only in (None, "ragged"):
        ragged(args.repeat, read)
    if args.only in (None, "prefill"):
        prefill(args.repeat)


if __name__ == "__main__":
    main()
