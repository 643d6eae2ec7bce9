"""Decode benchmark: one query per sequence, float32, batch 8, 32 heads, S = 4096, d = 128.

    python bench/decode.py [--batch 8] [--heads 32] [--kv-heads 32] [--s 4096] [--d 128]
    python bench/decode.py --kv-heads 8 --ragged 1024 8192   # KVCache, lengths 1024..8192
    python bench/decode.py --grid                  # group sizes 1/4/8 x d 64/128, and ragged
    python bench/decode.py --kv-heads 8 --jit off  # qkv's NumPy kernel only (QKV_JIT=0)

Measures in one process qkv.attention (kernel "auto" -> decode), PyTorch's CPU
scaled_dot_product_attention and naive NumPy; prints the time ratio against PyTorch and the
rate of reading K and V (their bytes / time) as a fraction of this machine's memory read rate.
With ``--kv-heads`` below ``--heads`` the query heads share kv heads (grouped-query).
With ``--ragged LO HI`` the sequences have lengths drawn from ``LO..HI`` and live in a
``qkv.KVCache``; PyTorch gets them padded to the longest with a key mask, and a loop of
``qkv.attention`` over the sequences is measured as well.
qkv runs on the native decode step (where the optional C++ library is built), and with it
switched off (``QKV_NATIVE=0``) with its compiled kernels (``qkv[jit]``, Numba) and without
(``QKV_JIT=0``), all in the same process, unless ``--jit on`` or ``--jit off`` picks one of
the last two. ``--grid`` runs the grouped
workloads of group sizes 1, 4, 8 by head dims 64 and 128 (heads 32) and the ragged cache of
lengths 1024..8192 (kv heads 8, d 128), one table each.
The machine is shared and its read rate drifts with the load: a plain read of the same K/V on
every core races with the contenders (row ``read K+V``), and "of read rate" divides by the
larger of it and ``bench/machine.py``'s rate measured at the start.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

import _common
import machine
import numpy as np

import qkv


def naive(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return (w / w.sum(axis=-1, keepdims=True)) @ v


def with_env(fn: Callable[[], Any], **env: str) -> Callable[[], Any]:
    """``fn`` run with the environment variables ``env`` set (and restored after)."""

    def run() -> Any:
        old = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            return fn()
        finally:
            for name, value in old.items():
                if value is None:
                    del os.environ[name]
                else:
                    os.environ[name] = value

    return run


def qkv_contenders(name: str, fn: Callable[[], Any], jit: str) -> dict[str, Callable[[], Any]]:
    """``fn`` on the native decode step (``name (native)``, where the library is built), and
    with it switched off: with the compiled Numba kernels (``name (jit)``) and without
    (``name (numpy)``)."""
    from qkv.engine.kernels import native_decode
    from qkv.engine.kernels.jit import enabled

    modes = {"both": (True, False), "on": (True,), "off": (False,)}[jit]
    if not enabled():
        modes = tuple(m for m in modes if not m) or (False,)
    out = {}
    if native_decode.available():
        out[f"{name} (native)"] = fn
    for on in modes:
        out[f"{name} ({'jit' if on else 'numpy'})"] = with_env(
            fn, QKV_NATIVE="0", QKV_JIT="1" if on else "0"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=None, help="fewer than heads: GQA")
    ap.add_argument("--s", type=int, default=4096)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--ragged", type=int, nargs=2, metavar=("LO", "HI"), default=None)
    ap.add_argument("--jit", choices=("both", "on", "off"), default="both")
    ap.add_argument("--grid", action="store_true", help="groups 1/4/8 x d 64/128, and ragged")
    args = ap.parse_args()
    b, h, s, d = args.batch, args.heads, args.s, args.d
    hkv = args.kv_heads or h
    read = machine.read_gbps()
    if args.grid:
        for dim in (64, 128):
            for group in (1, 4, 8):
                grouped(args, b, h, h // group, s, dim, read)
                print()
        args.ragged = (1024, 8192)
        ragged(args, b, h, 8, 128, read)
    elif args.ragged:
        ragged(args, b, h, hkv, d, read)
    else:
        grouped(args, b, h, hkv, s, d, read)


def grouped(
    args: argparse.Namespace, b: int, h: int, hkv: int, s: int, d: int, read: float
) -> None:
    """One query per head against equal-length K/V, ``h // hkv`` query heads per kv head."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((b, h, 1, d), dtype=np.float32)
    k, v = (rng.standard_normal((b, hkv, s, d), dtype=np.float32) for _ in range(2))
    nbytes = k.nbytes + v.nbytes
    contenders = qkv_contenders("qkv", lambda: qkv.attention(q, k, v, causal=True), args.jit)
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

    read = table(contenders, [k, v], nbytes, read, args.repeat)
    print(
        f"decode float32 B{b} H{h} (kv {hkv}, group {h // hkv}) S{s} d{d}, one query each; "
        f"K+V {_common.mib(nbytes)}; memory read {read:.1f} GB/s"
    )
    report(contenders)


def reader(arrays: list[np.ndarray]) -> Callable[[], Any]:
    """Read ``arrays`` once on every core, by the faster of BLAS ``dot`` and NumPy ``sum`` of
    each core's share (the two reads ``bench/machine.py`` tries; which one saturates the memory
    differs between machines): the read rate for these very bytes, raced with the contenders
    so that it meets the same background load."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from qkv.engine.kernels.threads import cpu_count, single_threaded_blas

    flat = [a.reshape(-1) for a in arrays]
    parts = [p for a in flat for p in np.array_split(a, cpu_count())]
    pool = ThreadPoolExecutor(cpu_count())

    def by_dot() -> None:
        with single_threaded_blas():
            list(pool.map(lambda p: float(p @ p), parts))

    def by_sum() -> None:
        list(pool.map(lambda p: float(p.sum()), parts))

    def seconds(fn: Callable[[], None]) -> float:
        fn()
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    return min((by_dot, by_sum), key=seconds)


_ROWS: list[dict] = []
_TIMES: dict[str, float] = {}


def table(
    contenders: dict[str, Callable[[], Any]],
    arrays: list[np.ndarray],
    nbytes: int,
    read: float,
    repeat: int,
) -> float:
    """Race the contenders and a reader of the same K/V; fill the rows. Returns the read rate
    used as the denominator: the larger of ``read`` and the raced reader's rate."""
    ref = np.asarray(next(iter(contenders.values()))())
    timed = {**contenders, READER: reader(arrays)}
    times = _common.race(timed, repeat=repeat, pause=0.1)
    read = max(read, nbytes / times[READER] / 1e9)
    _ROWS.clear()
    _TIMES.clear()
    _TIMES.update(times)
    for name, fn in timed.items():
        rate = nbytes / times[name] / 1e9
        diff = "-" if name == READER else f"{np.max(np.abs(np.asarray(fn()) - ref)):.1e}"
        _ROWS.append(
            {
                "contender": name,
                "time": f"{times[name] * 1e3:,.2f} ms",
                "K+V GB/s": f"{rate:.1f}",
                "of read rate": f"{rate / read:.0%}",
                "peak extra": _common.mib(_common.peak_extra_bytes(fn)),
                "max |diff| vs qkv": diff,
            }
        )
    return read


READER = "read K+V (all cores)"


def report(contenders: dict) -> None:
    """Print the threads line and the table of the last :func:`table` (ratio to PyTorch)."""
    peer = _TIMES.get("torch sdpa")
    for row in _ROWS:
        row["time / torch"] = f"{_TIMES[row['contender']] / peer:.2f}x" if peer else "-"
    print(f"threads: {_common.threads_info()}")
    cols = ["contender", "time", "time / torch", "K+V GB/s", "of read rate", "peak extra"]
    print(_common.table(_ROWS, cols + ["max |diff| vs qkv"]))


def ragged(args: argparse.Namespace, b: int, h: int, hkv: int, d: int, read: float) -> None:
    """Sequences of different lengths in a KVCache, one new query each."""
    lo, hi = args.ragged
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
        **qkv_contenders("qkv KVCache.attend", lambda: cache.attend(q), args.jit),
        **qkv_contenders(
            "qkv loop of attention",
            lambda: np.stack(
                [qkv.attention(q[i], cache.keys(i), cache.values(i), causal=True) for i in range(b)]
            ),
            args.jit,
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
    arrays = [cache.keys(i) for i in range(b)] + [cache.values(i) for i in range(b)]
    read = table(contenders, [np.ascontiguousarray(a) for a in arrays], nbytes, read, args.repeat)
    print(
        f"ragged decode float32 B{b} H{h} (kv {hkv}) d{d}, lengths {lo}..{hi} "
        f"(sum {int(lengths.sum())}), one query each; K+V {_common.mib(nbytes)}; "
        f"memory read {read:.1f} GB/s"
    )
    report(contenders)


if __name__ == "__main__":
    main()
