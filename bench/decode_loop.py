"""A decoding loop, token by token, on a short context: every step appends one token's keys
and values and attends one query to all of them.

    python bench/decode_loop.py                       # B1 H8 kv2 d64, 16 -> 400 keys, 1 thread
    python bench/decode_loop.py --start 512 --steps 256 --threads 2

Contenders, in one process, each running a part of its loop in turn (``--steps`` steps), part
after part (``--rounds``), so that no shape repeats: the same keys and values, the same number
of cached tokens at each step; the first step's results checked against PyTorch's before
timing (a fresh set of loops is timed):

- ``qkv.KVCache`` on NumPy arrays and on CPU tensors: ``append`` then ``attend``; the cache
  plans its step once and reads the lengths as it runs;
- ``qkv.attention`` on a growing slice of a buffer of one's own (``k[:, :, :t]``): a new shape
  every step, each planned from the step before (the same call with one key fewer);
- PyTorch's ``scaled_dot_product_attention`` (the peer) on a cache grown by ``torch.cat``, and
  on a slice of a preallocated buffer written in place.

The table gives each contender's median time per step and its ratio to SDPA on ``torch.cat``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import _common
import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--start", type=int, default=16, help="tokens cached before the loop")
    ap.add_argument("--steps", type=int, default=128, help="steps per part of the loop")
    ap.add_argument("--rounds", type=int, default=3, help="parts, the contenders taking turns")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()

    import torch
    import torch.nn.functional as F

    import qkv

    torch.set_num_threads(a.threads)
    _common.same_threads(a.threads)
    H, kvh, d, n0, steps = a.heads, a.kv_heads, a.d, a.start, a.steps
    rng = np.random.default_rng(0)
    total = n0 + a.rounds * steps
    keys = rng.standard_normal((1, kvh, total, d), dtype=np.float32)
    vals = rng.standard_normal((1, kvh, total, d), dtype=np.float32)
    qs = rng.standard_normal((a.rounds * steps, 1, H, 1, d), dtype=np.float32)
    kt, vt, qt = (torch.from_numpy(x) for x in (keys, vals, qs))
    gqa = H != kvh

    def loops() -> dict[str, Callable[[int], Any]]:
        """Each contender's step function, its state started afresh (``n0`` tokens cached)."""
        arrays = qkv.KVCache(batch=1, kv_heads=kvh, head_dim=d)
        arrays.append(keys[:, :, :n0], vals[:, :, :n0])
        tensors = qkv.KVCache(batch=1, kv_heads=kvh, head_dim=d)
        tensors.append(kt[:, :, :n0], vt[:, :, :n0])
        grown = [kt[:, :, :n0].clone(), vt[:, :, :n0].clone()]
        kbuf, vbuf = torch.zeros_like(kt), torch.zeros_like(vt)
        kbuf[:, :, :n0], vbuf[:, :, :n0] = kt[:, :, :n0], vt[:, :, :n0]
        mine = [np.zeros_like(keys), np.zeros_like(vals)]
        mine[0][:, :, :n0], mine[1][:, :, :n0] = keys[:, :, :n0], vals[:, :, :n0]

        def kv_arrays(i: int) -> Any:
            t = n0 + i
            arrays.append(keys[:, :, t : t + 1], vals[:, :, t : t + 1])
            return arrays.attend(qs[i])

        def kv_tensors(i: int) -> Any:
            t = n0 + i
            tensors.append(kt[:, :, t : t + 1], vt[:, :, t : t + 1])
            return tensors.attend(qt[i])

        def sliced(i: int) -> Any:
            t = n0 + i
            mine[0][:, :, t], mine[1][:, :, t] = keys[:, :, t], vals[:, :, t]
            return qkv.attention(qs[i], mine[0][:, :, : t + 1], mine[1][:, :, : t + 1])

        def sdpa_cat(i: int) -> Any:
            t = n0 + i
            grown[0] = torch.cat([grown[0], kt[:, :, t : t + 1]], dim=2)
            grown[1] = torch.cat([grown[1], vt[:, :, t : t + 1]], dim=2)
            return F.scaled_dot_product_attention(qt[i], grown[0], grown[1], enable_gqa=gqa)

        def sdpa_buffer(i: int) -> Any:
            t = n0 + i
            kbuf[:, :, t], vbuf[:, :, t] = kt[:, :, t], vt[:, :, t]
            return F.scaled_dot_product_attention(
                qt[i], kbuf[:, :, : t + 1], vbuf[:, :, : t + 1], enable_gqa=gqa
            )

        return {
            "qkv KVCache, arrays": kv_arrays,
            "qkv KVCache, tensors": kv_tensors,
            "qkv.attention on a growing slice": sliced,
            "torch sdpa, torch.cat cache": sdpa_cat,
            "torch sdpa, buffer slice": sdpa_buffer,
        }

    peer = "torch sdpa, torch.cat cache"
    check = loops()  # the first step's numbers, checked against PyTorch's before timing
    want = check[peer](0).numpy()
    for name, fn in check.items():
        if name == peer:
            continue
        got = fn(0)
        got = got.numpy() if isinstance(got, torch.Tensor) else got
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)
    times: dict[str, list[float]] = {}
    fns = loops()
    for r in range(a.rounds):  # each contender's part of the loop in turn, parts alternating
        for name, fn in fns.items():
            for i in range(r * steps, (r + 1) * steps):
                t0 = time.perf_counter()
                fn(i)
                times.setdefault(name, []).append(time.perf_counter() - t0)
    med = {n: statistics.median(t) for n, t in times.items()}
    print(
        f"decoding loop B1 H{H} kv{kvh} d{d} float32, {n0} -> {total} keys, "
        f"{a.rounds} parts of {steps} steps; threads: {_common.threads_info()}"
    )
    cols = ["contender", "µs per step (median)", "× sdpa (cat)"]
    rows = [
        dict(zip(cols, (n, f"{t * 1e6:.1f}", f"{t / med[peer]:.2f}"), strict=True))
        for n, t in med.items()
    ]
    print(_common.table(rows, cols))


if __name__ == "__main__":
    main()
