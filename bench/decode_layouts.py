"""A decoding step on K/V in FlashAttention's layout (batch, keys, kv_heads, d), where each
key's row holds every head's values side by side, against the same step on head-major K/V
(batch, kv_heads, keys, d), qkv and PyTorch's scaled_dot_product_attention, in one process.

    python bench/decode_layouts.py        # B1 and B8, H32 kv8 S4096 d128, bfloat16 and float32
    python bench/decode_layouts.py --batch 2 --seq 2048 --threads 1

qkv runs ``qkv.attention(q, k, v, layout="blhd")`` on the interleaved buffers (from
``router.EVERY_HEAD_MIN_BYTES`` of K/V: the paged walk, every head's rows of a run of keys at
a time, one page a sequence) and, as ``qkv, walk by heads``, the same call with that size
set out of reach (the walk smaller K/V take: head after head down rows a whole key's row
apart); ``flash_attn_varlen_func`` on the same buffers packed ``(B · S, kv_heads, d)`` with
``cu_seqlens`` (one query per sequence: the native decode step, the packed keys one page);
``qkv.attention(q, k, v)`` on head-major copies. PyTorch's SDPA (``enable_gqa``) gets
the same buffers as (batch, heads, keys, d) views, and head-major copies. Each contender
cycles over a few layers of K/V of its own (at least 96 MiB together), so that every call
reads its K/V from memory, as a model's decoding step does; the contenders take turns within
each round, and the table gives each one's median time per call, its ratio to PyTorch's on
the same layout, and the K/V bytes it read per second against this machine's read rate
(``bench/machine.py``, measured at the start).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import _common
import machine
import ml_dtypes
import numpy as np

import qkv
from qkv.engine import run
from qkv.engine.kernels import native_decode, router
from qkv.flash import flash_attn_varlen_func

LAYER_BYTES = 96 << 20


def _walk_by_heads(on: bool) -> None:
    """Whether qkv walks interleaved K/V head after head at every size (the threshold set out
    of reach) or from the router's size every head at a time."""
    _walk_by_heads.saved = getattr(_walk_by_heads, "saved", router.EVERY_HEAD_MIN_BYTES)
    router.EVERY_HEAD_MIN_BYTES = 1 << 62 if on else _walk_by_heads.saved
    native_decode._constants.cache_clear()  # (the choices kept per layout)
    run._ready.cache_clear()


def contenders(
    B: int, H: int, kvh: int, S: int, d: int, dtype: str
) -> dict[str, Callable[[], Any]]:
    """``name: one call``, each cycling over its layers' K/V."""
    import torch

    rng = np.random.default_rng(0)
    npt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    tt = getattr(torch, dtype)
    q = rng.standard_normal((B, 1, H, d)).astype(npt)
    k = rng.standard_normal((B, S, kvh, d)).astype(npt)
    v = rng.standard_normal((B, S, kvh, d)).astype(npt)
    layers = -(-LAYER_BYTES // (k.nbytes + v.nbytes))
    blhd = [(k, v)] + [(k.copy(), v.copy()) for _ in range(layers - 1)]
    bhld = [tuple(np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in kv) for kv in blhd]
    qh = np.ascontiguousarray(q.transpose(0, 2, 1, 3))

    def torch_of(x: np.ndarray) -> Any:
        if dtype == "bfloat16":  # (ml_dtypes' bfloat16: its bits)
            return torch.from_numpy(x.view(np.int16)).view(tt)
        return torch.from_numpy(x)

    tq, tqh = torch_of(q).transpose(1, 2), torch_of(qh)
    t_blhd = [tuple(torch_of(x).transpose(1, 2) for x in kv) for kv in blhd]
    t_bhld = [tuple(torch_of(x) for x in kv) for kv in bhld]

    def cycling(fn: Callable[..., Any], kvs: list[Any]) -> Callable[[], Any]:
        at = [0]

        def call() -> Any:
            kk, vv = kvs[at[0] % len(kvs)]
            at[0] += 1
            return fn(kk, vv)

        return call

    sdpa = torch.nn.functional.scaled_dot_product_attention
    got = qkv.attention(q, k, v, layout="blhd")
    want = sdpa(tq, t_blhd[0][0], t_blhd[0][1], enable_gqa=True).transpose(1, 2).float().numpy()
    tol = 2e-2 if dtype == "bfloat16" else 1e-4
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol)
    cu_q = np.arange(B + 1, dtype=np.int32)
    cu_k = cu_q * S
    q1 = q[:, 0]  # (B, H, d): one query row per sequence, packed

    def varlen(kk: np.ndarray, vv: np.ndarray) -> Any:
        kp, vp = kk.reshape(B * S, kvh, d), vv.reshape(B * S, kvh, d)
        return flash_attn_varlen_func(q1, kp, vp, cu_q, cu_k, 1, S, causal=True)

    return {
        "qkv, (B, S, kv, d)": cycling(lambda kk, vv: qkv.attention(q, kk, vv, layout="blhd"), blhd),
        "flash_attn_varlen_func": cycling(varlen, blhd),
        "qkv, walk by heads": cycling(lambda kk, vv: qkv.attention(q, kk, vv, layout="blhd"), blhd),
        "torch, (B, S, kv, d)": cycling(lambda kk, vv: sdpa(tq, kk, vv, enable_gqa=True), t_blhd),
        "qkv, (B, kv, S, d)": cycling(lambda kk, vv: qkv.attention(qh, kk, vv), bhld),
        "torch, (B, kv, S, d)": cycling(lambda kk, vv: sdpa(tqh, kk, vv, enable_gqa=True), t_bhld),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", nargs="*", default=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=5, help="calls per contender per round")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    _common.same_threads(a.threads)
    read = machine.read_gbps()
    print(f"threads: {_common.threads_info()}; machine read rate {read:.1f} GB/s")
    for dtype in a.dtype:
        for B in a.batch:
            calls = contenders(B, a.heads, a.kv_heads, a.seq, a.dim, dtype)
            times: dict[str, list[float]] = {name: [] for name in calls}
            for r in range(a.rounds):
                names = list(calls) if r % 2 == 0 else list(reversed(calls))
                for name in names:
                    _walk_by_heads(name == "qkv, walk by heads")
                    fn = calls[name]
                    fn()
                    t0 = time.perf_counter()
                    for _ in range(a.calls):
                        fn()
                    times[name].append((time.perf_counter() - t0) / a.calls)
            _walk_by_heads(False)
            nbytes = 2 * B * a.kv_heads * a.seq * a.dim * (2 if dtype == "bfloat16" else 4)
            med = {n: statistics.median(t) for n, t in times.items()}
            print(
                f"\n{dtype} B{B} H{a.heads} kv{a.kv_heads} S{a.seq} d{a.dim}, one query, "
                f"K/V {nbytes / 2**20:.0f} MiB a layer, {a.rounds} rounds"
            )
            rows = []
            for n, t in med.items():
                peer = med["torch, (B, kv, S, d)" if "(B, kv" in n else "torch, (B, S, kv, d)"]
                rows.append(
                    {
                        "contender": n,
                        "ms": f"{t * 1e3:.3f}",
                        "/ torch, same layout": f"{t / peer:.2f}",
                        "GB/s": f"{nbytes / t / 1e9:.1f}",
                        "of read": f"{nbytes / t / 1e9 / read:.0%}",
                    }
                )
            print(_common.table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
