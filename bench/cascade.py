"""A decoding step over requests that share a prompt prefix, with and without sharing it.

    python bench/cascade.py                 # 32 requests, a 2048-token prefix, 128 own tokens
    python bench/cascade.py --requests 8 --prefix 1024 --threads 1

The requests hold their keys and values in one pool of pages (page size 16, NHD; H32 kv8
d128 float32 by default). With sharing, every row of the block table starts with the prefix's
pages (as :meth:`qkv.PagedKVCache.fork` leaves them), and :func:`qkv.engine.paged.attend_pages`
splits the step (:mod:`qkv.engine.cascade`): one prefill-shaped call of every request's query
against the prefix, the native paged step over each request's own pages, and a merge. Without
sharing, each request holds its own copy of the same prefix (other block ids, the same values):
the native paged step reads the prefix once per request. Both give the same numbers (checked).
PyTorch's SDPA on the gathered, contiguous batch (grouped heads, same threads) is the peer.

Rounds alternate the contenders; the table gives each one's median time per step and its ratio
to the unshared step (issue 43's goal: at most 0.35×) and to PyTorch's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import _common
import numpy as np

from qkv.engine.paged import attend_pages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--own", type=int, default=128)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()

    import torch
    import torch.nn.functional as F

    torch.set_num_threads(a.threads)
    _common.same_threads(a.threads)
    B, H, kvh, d, page = a.requests, a.heads, a.kv_heads, a.dim, a.page_size
    P, own = a.prefix, a.own
    assert P % page == 0 and own % page == 0, "whole pages"
    rng = np.random.default_rng(0)
    cols_p, cols_o = P // page, own // page
    blocks = cols_p * (B + 1) + cols_o * B
    k_pages = rng.standard_normal((blocks, page, kvh, d), dtype=np.float32)
    v_pages = rng.standard_normal((blocks, page, kvh, d), dtype=np.float32)
    ids = rng.permutation(blocks)
    prefix_ids, rest = ids[:cols_p], ids[cols_p:]
    own_ids = rest[: B * cols_o].reshape(B, cols_o)
    copies = rest[B * cols_o :].reshape(B, cols_p)
    for c in range(B):  # each request's own copy of the prefix: the same values
        k_pages[copies[c]] = k_pages[prefix_ids]
        v_pages[copies[c]] = v_pages[prefix_ids]
    shared = np.concatenate([np.tile(prefix_ids, (B, 1)), own_ids], axis=1)
    unshared = np.concatenate([copies, own_ids], axis=1)
    lengths = np.full(B, P + own)
    q = rng.standard_normal((B, H, 1, d), dtype=np.float32)

    def gathered(table: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        k = k_pages[table].reshape(B, -1, kvh, d).transpose(0, 2, 1, 3)
        v = v_pages[table].reshape(B, -1, kvh, d).transpose(0, 2, 1, 3)
        return torch.from_numpy(np.ascontiguousarray(k)), torch.from_numpy(np.ascontiguousarray(v))

    kt, vt = gathered(unshared)
    qt = torch.from_numpy(q)
    contenders = {
        "qkv, prefix shared (cascade)": lambda: attend_pages(q, k_pages, v_pages, shared, lengths),
        "qkv, prefix per request": lambda: attend_pages(q, k_pages, v_pages, unshared, lengths),
        "torch sdpa, contiguous": lambda: F.scaled_dot_product_attention(
            qt, kt, vt, enable_gqa=True
        ),
    }
    a_out = contenders["qkv, prefix shared (cascade)"]()
    b_out = contenders["qkv, prefix per request"]()
    c_out = contenders["torch sdpa, contiguous"]().numpy()
    np.testing.assert_allclose(a_out, b_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(a_out, c_out, rtol=1e-4, atol=1e-5)
    times: dict[str, list[float]] = {n: [] for n in contenders}
    for _ in range(a.rounds):
        for name, fn in contenders.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {n: statistics.median(t) for n, t in times.items()}
    base, peer = med["qkv, prefix per request"], med["torch sdpa, contiguous"]
    print(
        f"B{B} H{H} kv{kvh} d{d} float32, prefix {P} + {own} own keys, page {page}, "
        f"{a.rounds} rounds; threads: {_common.threads_info()}"
    )
    rows = [
        {
            "step": n,
            "ms": f"{t * 1e3:.2f}",
            "× unshared": f"{t / base:.2f}",
            "× torch": f"{t / peer:.2f}",
        }
        for n, t in med.items()
    ]
    print(_common.table(rows, ["step", "ms", "× unshared", "× torch"]))


if __name__ == "__main__":
    main()
