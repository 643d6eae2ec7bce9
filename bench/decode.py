"""Decode benchmark: one query per sequence, float32, batch 8, 32 heads, S = 4096, d = 128.

    python bench/decode.py [--batch 8] [--heads 32] [--kv-heads 32] [--s 4096] [--d 128]
    python bench/decode.py --kv-heads 8 --ragged 1024 8192   # KVCache, lengths 1024..8192

Measures in one process qkv.attention (kernel "auto" -> decode), PyTorch's CPU
scaled_dot_product_attention and naive NumPy; prints the time ratio against PyTorch and the
rate of reading K and V (their bytes / time) as a fraction of this machine's memory read rate.
With ``--kv-heads`` below ``--heads`` the query heads share kv heads (grouped-query).
With ``--ragged LO HI`` the sequences have lengths drawn from ``LO..HI`` and live in a
``qkv.KVCache``; PyTorch gets them padded to the longest with a key mask, and a loop of
``qkv.attention`` over the sequences is measured as well.
"""

from __future__ import annotations

import argparse

import _common
import machine
import numpy as np

import qkv


def naive(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return (w / w.sum(axis=-1, keepdims=True)) @ v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=None, help="fewer than heads: GQA")
    ap.add_argument("--s", type=int, default=4096)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--ragged", type=int, nargs=2, metavar=("LO", "HI"), default=None)
    args = ap.parse_args()
    b, h, s, d = args.batch, args.heads, args.s, args.d
    hkv = args.kv_heads or h
    if args.ragged:
        ragged(args, b, h, hkv, d)
        return

    read = machine.read_gbps()
    rng = np.random.default_rng(0)
    q = rng.standard_normal((b, h, 1, d), dtype=np.float32)
    k, v = (rng.standard_normal((b, hkv, s, d), dtype=np.float32) for _ in range(2))
    nbytes = k.nbytes + v.nbytes
    contenders = {"qkv": lambda: qkv.attention(q, k, v, causal=True)}
    try:
        import torch

        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        gqa = {"enable_gqa": True} if hkv != h else {}

        def run_torch():
            with torch.no_grad():
                return sdpa(tq, tk, tv, **gqa)  # one query sees every key: no mask needed

        contenders["torch sdpa"] = run_torch
    except ImportError:
        print("PyTorch not installed: no peer to compare against")
    if hkv == h:
        contenders["naive numpy"] = lambda: naive(q, k, v)

    ref = np.asarray(contenders["qkv"]())
    rows = []
    times = _common.race(contenders, repeat=args.repeat, pause=0.1)
    for name, fn in contenders.items():
        out = np.asarray(fn())
        rate = nbytes / times[name] / 1e9
        rows.append(
            {
                "contender": name,
                "time": f"{times[name] * 1e3:,.2f} ms",
                "K+V GB/s": f"{rate:.1f}",
                "of read rate": f"{rate / read:.0%}",
                "peak extra": _common.mib(_common.peak_extra_bytes(fn)),
                "max |diff| vs qkv": f"{np.max(np.abs(out - ref)):.1e}",
            }
        )
    print(
        f"decode float32 B{b} H{h} (kv {hkv}) S{s} d{d}, one query each; "
        f"K+V {_common.mib(nbytes)}; memory read {read:.1f} GB/s"
    )
    report(contenders, rows, times)


def report(contenders: dict, rows: list[dict], times: dict[str, float]) -> None:
    """Print the threads line and the table (rows already filled but for the ratio)."""
    peer = times.get("torch sdpa")
    for row, name in zip(rows, contenders, strict=True):
        row["time / torch"] = f"{times[name] / peer:.2f}x" if peer else "-"
    print(f"threads: {_common.threads_info()}")
    cols = ["contender", "time", "time / torch", "K+V GB/s", "of read rate", "peak extra"]
    print(_common.table(rows, cols + ["max |diff| vs qkv"]))


def ragged(args: argparse.Namespace, b: int, h: int, hkv: int, d: int) -> None:
    """Sequences of different lengths in a KVCache, one new query each."""
    lo, hi = args.ragged
    read = machine.read_gbps()
    rng = np.random.default_rng(0)
    lengths = np.sort(rng.integers(lo, hi + 1, size=b))[::-1].copy()
    lengths[0], lengths[-1] = hi, lo  # the whole range, every time
    rng.shuffle(lengths)
    cache = qkv.KVCache(b, hkv, d)
    for i, n in enumerate(lengths.tolist()):
        kv = rng.standard_normal((2, hkv, n, d), dtype=np.float32)
        cache.append(kv[0], kv[1], seq=i)
    q = rng.standard_normal((b, h, 1, d), dtype=np.float32)
    nbytes = int(lengths.sum()) * hkv * 2 * d * 4
    contenders = {
        "qkv KVCache.attend": lambda: cache.attend(q),
        "qkv loop of attention": lambda: np.stack(
            [qkv.attention(q[i], cache.keys(i), cache.values(i), causal=True) for i in range(b)]
        ),
    }
    try:
        import torch

        pad = np.zeros((2, b, hkv, int(lengths.max()), d), dtype=np.float32)
        for i, n in enumerate(lengths.tolist()):
            pad[0, i, :, :n], pad[1, i, :, :n] = cache.keys(i), cache.values(i)
        keep = np.arange(pad.shape[3]) < lengths[:, None]
        tq, tk, tv = (torch.from_numpy(x) for x in (q, pad[0], pad[1]))
        tmask = torch.from_numpy(keep[:, None, None, :])
        sdpa = torch.nn.functional.scaled_dot_product_attention
        gqa = {"enable_gqa": True} if hkv != h else {}

        def run_torch():
            with torch.no_grad():
                return sdpa(tq, tk, tv, attn_mask=tmask, **gqa)  # padded keys masked out

        contenders["torch sdpa"] = run_torch
    except ImportError:
        print("PyTorch not installed: no peer to compare against")
    ref = np.asarray(contenders["qkv KVCache.attend"]())
    times = _common.race(contenders, repeat=args.repeat, pause=0.1)
    rows = []
    for name, fn in contenders.items():
        rate = nbytes / times[name] / 1e9
        rows.append(
            {
                "contender": name,
                "time": f"{times[name] * 1e3:,.2f} ms",
                "K+V GB/s": f"{rate:.1f}",
                "of read rate": f"{rate / read:.0%}",
                "peak extra": _common.mib(_common.peak_extra_bytes(fn)),
                "max |diff| vs qkv": f"{np.max(np.abs(np.asarray(fn()) - ref)):.1e}",
            }
        )
    print(
        f"ragged decode float32 B{b} H{h} (kv {hkv}) d{d}, lengths {lo}..{hi} "
        f"(sum {int(lengths.sum())}), one query each; K+V {_common.mib(nbytes)}; "
        f"memory read {read:.1f} GB/s"
    )
    report(contenders, rows, times)


if __name__ == "__main__":
    main()
