"""The short, batched shapes CPU users run most: qkv against PyTorch's SDPA, cell by cell.

    python bench/small.py --quick                  # a representative subset (about a minute)
    python bench/small.py                          # the whole grid (float32 and bfloat16)
    python bench/small.py --dtype float32 --mask padding --B 32 --L 53 --d 32
    python bench/small.py --only decode --S 128,1024
    python bench/small.py --only draft --rows 4 --S 128

The grid (issue 42): batch B in {1, 8, 32}, heads H in {8, 12}, kv heads H or H/4 (``--group``
1 or 4), L = S in {16, 37, 53, 120, 256, 512}, head size d in {32, 64}, and three masks:
``none``, ``causal`` and ``padding`` (a boolean (B, 1, 1, S) mask hiding a random tail of
each batch row, as a tokenizer's padding does; the lengths are drawn so that some rows are
full); plus decode cells, one query over S in {16, 128, 512, 1024} keys (no mask), and draft
cells, a few causal queries (``--rows`` 2, 4, 8: speculative decoding's draft tokens, a short
chunk against a cache) over those S keys, bottom-right aligned (PyTorch's peer gets that
boolean mask). Every cell runs in float32 and bfloat16 (``--dtype``).

For each cell, in one process with the contenders taking turns round by round (the shared
machine's drifting load meets them alike): ``qkv.attention`` on the torch tensors, on NumPy
arrays of the same values (bfloat16 through ``ml_dtypes``), and PyTorch's
``scaled_dot_product_attention`` (the peer, ``enable_gqa`` for grouped heads); each round
times a loop of calls that lasts about ``--target-ms``, and a cell's time is the median of
``--rounds`` rounds. Results are checked against PyTorch's before timing. The table gives
each cell's per-call times and the ratios to PyTorch's; the worst cell is printed last.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
import zlib
from collections.abc import Callable
from typing import Any

import _common
import numpy as np

import qkv

GRID = {
    "B": (1, 8, 32),
    "H": (8, 12),
    "group": (1, 4),
    "L": (16, 37, 53, 120, 256, 512),
    "d": (32, 64),
    "mask": ("none", "causal", "padding"),
    "S": (16, 128, 512, 1024),  # decode: one query over S keys (draft: a few)
    "rows": (2, 4, 8),  # draft: causal queries over S keys
    "dtype": ("float32", "bfloat16"),
}

# --quick: the rows and a spread over batch, heads, lengths and masks, in both dtypes.
# (B, H, group, L, S, d, mask); L == 1 is a decode cell, 1 < L < S a draft cell.
QUICK = [
    (32, 12, 1, 53, 53, 32, "none"),
    (32, 12, 1, 53, 53, 32, "padding"),
    (32, 12, 1, 16, 16, 32, "padding"),
    (32, 8, 4, 120, 120, 64, "padding"),
    (8, 12, 1, 16, 16, 64, "padding"),
    (8, 12, 4, 37, 37, 32, "causal"),
    (8, 8, 4, 256, 256, 64, "none"),
    (8, 8, 1, 53, 53, 64, "none"),
    (1, 8, 4, 16, 16, 64, "none"),
    (1, 8, 4, 37, 37, 32, "causal"),
    (1, 8, 4, 120, 120, 32, "causal"),
    (1, 8, 4, 512, 512, 32, "causal"),
    (1, 12, 1, 120, 120, 64, "padding"),
    (1, 12, 4, 256, 256, 64, "causal"),
    (1, 8, 4, 1, 128, 32, "none"),
    (1, 12, 1, 1, 512, 64, "none"),
    (8, 12, 1, 1, 16, 64, "none"),
    (32, 8, 4, 1, 1024, 32, "none"),
    (1, 8, 4, 4, 128, 64, "causal"),
    (1, 12, 4, 2, 16, 32, "causal"),
    (8, 12, 1, 8, 512, 64, "causal"),
]


def cells(args: argparse.Namespace) -> list[tuple[int, int, int, int, int, int, str, str]]:
    """The cells to run: ``(B, H, group, L, S, d, mask, dtype)``, after the filters."""

    def pick(name: str, cast: Callable[[str], Any] = int) -> tuple:
        given = getattr(args, name)
        return GRID[name] if given is None else tuple(cast(x) for x in given.split(","))

    Bs, Hs, groups, Ls, ds = pick("B"), pick("H"), pick("group"), pick("L"), pick("d")
    Ss, rows, masks, dtypes = pick("S"), pick("rows"), pick("mask", str), pick("dtype", str)
    shapes: list[tuple[int, int, int, int, int, int, str]] = []
    if args.quick:
        shapes = [
            c
            for c in QUICK
            if c[0] in Bs and c[1] in Hs and c[2] in groups and c[5] in ds and c[6] in masks
            and (c[3] == c[4] and c[3] in Ls or c[3] != c[4] and c[4] in Ss
                 and (c[3] == 1 or c[3] in rows))
        ]  # fmt: skip
    else:
        if args.only in (None, "grid"):
            for B, H, g, L, d, m in itertools.product(Bs, Hs, groups, Ls, ds, masks):
                shapes.append((B, H, g, L, L, d, m))
        if args.only in (None, "decode") and "none" in masks:
            for B, H, g, S, d in itertools.product(Bs, Hs, groups, Ss, ds):
                shapes.append((B, H, g, 1, S, d, "none"))
        if args.only in (None, "draft") and "causal" in masks:
            for B, H, g, n, S, d in itertools.product(Bs, Hs, groups, rows, Ss, ds):
                if n < S:
                    shapes.append((B, H, g, n, S, d, "causal"))
    kinds = {"grid": lambda c: c[3] == c[4], "decode": lambda c: c[3] == 1}
    kinds["draft"] = lambda c: 1 < c[3] < c[4]
    if args.only is not None:
        shapes = [c for c in shapes if kinds[args.only](c)]
    return [(*c, dt) for dt in dtypes for c in shapes]


def padding_lengths(B: int, S: int, rng: np.random.Generator) -> np.ndarray:
    """Key counts per batch row: the first row full, the others drawn in [S/2, S] (so some rows
    are full, and a longer batch pads its shorter sentences)."""
    n = rng.integers(max(1, S // 2), S + 1, size=B)
    n[0] = S
    if B > 2:
        n[1] = S
    return n


def inputs(cell: tuple, rng: np.random.Generator) -> dict[str, Any]:
    """The torch tensors, the NumPy arrays and the keyword arguments of each contender."""
    import ml_dtypes
    import torch

    B, H, g, L, S, d, mask, dtype = cell
    kv = H // g
    tdt = getattr(torch, dtype)
    qt, kt, vt = (
        torch.from_numpy(rng.standard_normal((B, h, n, d), dtype=np.float32)).to(tdt)
        for h, n in ((H, L), (kv, S), (kv, S))
    )

    def np_view(t: Any) -> np.ndarray:
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()

    q, k, v = (np_view(t) for t in (qt, kt, vt))
    torch_kw: dict[str, Any] = {"enable_gqa": g > 1}
    qkv_t: dict[str, Any] = {}
    qkv_n: dict[str, Any] = {}
    if mask == "causal" and L == S:  # PyTorch's top-left causal is the bottom-right one
        torch_kw["is_causal"] = True
        qkv_t["causal"] = qkv_n["causal"] = True
    elif mask == "causal":  # draft rows: PyTorch's peer gets the bottom-right mask
        torch_kw["attn_mask"] = torch.ones(L, S, dtype=torch.bool).tril(S - L)
        qkv_t["causal"] = qkv_n["causal"] = True
    elif mask == "padding":
        n = padding_lengths(B, S, rng)
        m = np.arange(S)[None, :] < n[:, None]
        m = np.ascontiguousarray(m[:, None, None, :])
        torch_kw["attn_mask"] = torch.from_numpy(m)
        qkv_t["mask"] = torch_kw["attn_mask"]
        qkv_n["mask"] = m
    return {
        "torch": (qt, kt, vt, torch_kw),
        "qkv tensor": (qt, kt, vt, qkv_t),
        "qkv numpy": (q, k, v, qkv_n),
    }


def loop_seconds(fn: Callable[[], Any], calls: int) -> float:
    """Seconds per call over ``calls`` back-to-back calls."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def run_cell(cell: tuple, args: argparse.Namespace) -> dict[str, float]:
    """Median per-call seconds of each contender on ``cell``, checked against PyTorch first."""
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(zlib.crc32(repr(cell).encode()))
    made = inputs(cell, rng)
    qt, kt, vt, kw = made["torch"]
    want = F.scaled_dot_product_attention(qt, kt, vt, **kw).float().numpy()
    tol = 1e-4 if cell[-1] == "float32" else 3e-2
    fns: dict[str, Callable[[], Any]] = {}
    for name, (q, k, v, kw) in made.items():
        if name == "torch":
            fns[name] = lambda q=q, k=k, v=v, kw=kw: F.scaled_dot_product_attention(q, k, v, **kw)
        else:
            fns[name] = lambda q=q, k=k, v=v, kw=kw: qkv.attention(q, k, v, **kw)
            got = fns[name]()
            got = got.float().numpy() if isinstance(got, torch.Tensor) else got.astype(np.float32)
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"{name} {cell}")
    calls = {}
    for name, fn in fns.items():  # warm-up and the loop length that lasts about --target-ms
        fn()
        t = loop_seconds(fn, 3)
        calls[name] = max(1, min(2000, int(args.target_ms / 1e3 / max(t, 1e-7))))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            times[name].append(loop_seconds(fn, calls[name]))
    return {name: statistics.median(ts) for name, ts in times.items()}


def label(cell: tuple) -> str:
    B, H, g, L, S, d, mask, dtype = cell
    shape = f"B{B} H{H} kv{H // g} " + (f"L=S={L}" if L == S else f"L{L} S{S}") + f" d{d}"
    return shape


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a representative subset (~1 minute)")
    p.add_argument("--only", choices=("grid", "decode", "draft"),
                   help="the L = S cells, the decode ones or the draft ones")  # fmt: skip
    for name in ("B", "H", "group", "L", "S", "d", "rows"):
        p.add_argument(f"--{name}", help=f"comma-separated (default {GRID[name]})")
    p.add_argument("--mask", help="none, causal, padding (comma-separated)")
    p.add_argument("--dtype", help="float32, bfloat16 (comma-separated)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--target-ms", type=float, default=20.0, help="length of one timed loop")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    _common.same_threads(args.threads)
    todo = cells(args)
    if not todo:
        raise SystemExit("no cell left after the filters")
    print(f"qkv {qkv.__version__}, torch {torch.__version__}, {args.threads} threads, median of "
          f"{args.rounds} rounds of ~{args.target_ms:g} ms; QKV_NATIVE="
          f"{os.environ.get('QKV_NATIVE', '(unset)')}, QKV_NATIVE_ISA="
          f"{os.environ.get('QKV_NATIVE_ISA', '(unset)')}")  # fmt: skip
    print(_common.threads_info(), flush=True)
    rows = []
    worst: tuple[float, dict[str, str]] | None = None
    for cell in todo:
        t = run_cell(cell, args)
        peer = t["torch"]
        row = {
            "dtype": cell[-1],
            "shape": label(cell),
            "mask": cell[6],
            "torch µs": f"{peer * 1e6:.1f}",
            "qkv tensor µs": f"{t['qkv tensor'] * 1e6:.1f}",
            "× torch": f"{t['qkv tensor'] / peer:.2f}",
            "qkv numpy µs": f"{t['qkv numpy'] * 1e6:.1f}",
            "× torch ": f"{t['qkv numpy'] / peer:.2f}",
        }
        rows.append(row)
        print(_common.table([row], list(row)).splitlines()[-1], flush=True)
        ratio = max(t["qkv tensor"], t["qkv numpy"]) / peer
        if worst is None or ratio > worst[0]:
            worst = (ratio, row)
    print()
    print(_common.table(rows, list(rows[0])))
    assert worst is not None
    ratios = sorted(max(float(r["× torch"]), float(r["× torch "])) for r in rows)
    above = sum(r > 1.0 for r in ratios)
    print(f"\n{len(rows)} cells, {above} above 1.0x PyTorch; median cell "
          f"{statistics.median(ratios):.2f}x")  # fmt: skip
    w = worst[1]
    print(f"worst cell: {w['dtype']} {w['shape']} {w['mask']}: {worst[0]:.2f}x PyTorch "
          f"(tensor {w['× torch']}x, numpy {w['× torch ']}x)")  # fmt: skip


if __name__ == "__main__":
    main()
