"""Variants benchmark: the cost of each attention variant in the tiled kernel, and block masks.

    python bench/variants.py [--n 4096] [--heads 8] [--d 64] [--repeat 3]

Part 1: causal attention, float32, B1, H8, N, d64, through qkv's tiled kernel — plain, with
``softcap``, ``sinks``, ``alibi_slopes``, a ``score_mod`` (a distance bias written in NumPy)
and a ``mask_mod`` (a sliding window written as a function) — each against plain qkv and
against PyTorch's CPU ``scaled_dot_product_attention`` measured in the same process.

Part 2: causal attention with a document mask (``mask_mod=document(ids)``) of many short
documents: the fraction of the causal tiles the block mask keeps against the time it takes
relative to plain causal attention; PyTorch's SDPA given the equivalent dense boolean mask,
and PyTorch's ``flex_attention`` with its block mask (compiled if this machine can, else in
eager mode; it says which, or that it does not run).
"""

from __future__ import annotations

import argparse

import _common
import machine
import numpy as np

import qkv
from qkv.engine.kernels import mods, tiled
from qkv.validate import make_plan
from qkv.variants import and_masks, causal, document, sliding_window


def distance_bias(s, b, h, q_idx, kv_idx):
    """A score_mod: ALiBi-like, written by a user in NumPy."""
    return s - (0.01 * (h + 1)) * (q_idx - kv_idx)


def kept_fraction(n: int, heads: int, d: int, ids: np.ndarray) -> float:
    """Share of the causal kernel's key blocks that the document block mask keeps."""
    q = np.zeros((1, 1, n, d), np.float32)
    plan = make_plan(q, q, q, mask_mod=and_masks(causal, document(ids)))
    gk = min(tiled.BLOCK_K, tiled.MASK_BLOCK_K)
    bq = min(tiled.BLOCK_Q, tiled.MASK_BLOCK_Q)
    blocks = mods.block_mask(plan, bq, gk)
    causal_blocks = mods.block_mask(make_plan(q, q, q, mask_mod=causal), bq, gk)
    return float((blocks != mods.EMPTY).sum() / (causal_blocks != mods.EMPTY).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    n, h, d = args.n, args.heads, args.d
    import torch

    gemm = machine.gemm_gflops()
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, h, n, d), dtype=np.float32) for _ in range(3))
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    flops = h * 4 * n * n * d / 2

    def run_sdpa(mask=None):
        with torch.no_grad():
            if mask is None:
                return sdpa(tq, tk, tv, is_causal=True)
            return sdpa(tq, tk, tv, attn_mask=mask)

    variants = {
        "plain": {},
        "softcap=30": {"softcap": 30.0},
        "sinks": {"sinks": rng.standard_normal(h).astype(np.float32)},
        "alibi_slopes": {"alibi_slopes": 2.0 ** -np.arange(1, h + 1)},
        "score_mod (distance bias)": {"score_mod": distance_bias},
        "mask_mod (window 1024 as a function)": {"mask_mod": sliding_window(1024, 0)},
        "window=(1024, 0) built in": {"window": (1024, 0)},
    }
    contenders = {
        name: (lambda kw=kw: qkv.attention(q, k, v, causal=True, kernel="tiled", **kw))
        for name, kw in variants.items()
    }
    contenders["torch sdpa (causal)"] = run_sdpa
    times = _common.race(contenders, repeat=args.repeat)
    base, peer = times["plain"], times["torch sdpa (causal)"]
    print(f"variants: causal float32 B1 H{h} N{n} d{d}; GEMM {gemm:.0f} GFLOP/s")
    print(f"threads: {_common.threads_info()}")
    rows = [
        {
            "variant": name,
            "time": f"{t * 1e3:,.0f} ms",
            "÷ plain qkv": f"{t / base:.2f}×",
            "÷ torch sdpa": f"{t / peer:.2f}×",
            "of GEMM": f"{flops / t / 1e9 / gemm:.0%}",
        }
        for name, t in times.items()
    ]
    print(_common.table(rows, ["variant", "time", "÷ plain qkv", "÷ torch sdpa", "of GEMM"]))

    # ----- part 2: document masks -----
    flex, flex_kind = None, "not available"
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex, flex_kind = flex_attention, "eager"
        try:
            compiled = torch.compile(flex_attention)
            tiny = torch.zeros(1, 1, 128, 16)
            compiled(tiny, tiny, tiny)
            flex, flex_kind = compiled, "compiled"
        except Exception as exc:  # no C++ toolchain for inductor, or CPU unsupported
            flex_kind = f"eager (compile failed: {type(exc).__name__})"
    except ImportError:
        pass
    print(f"\ndocument masks (causal AND same document), N{n}; flex_attention: {flex_kind}")
    plain = _common.best_time(lambda: qkv.attention(q, k, v, causal=True), args.repeat)
    rows = []
    for doc in (64, 256, 1024, n):
        ids = np.arange(n) // doc
        keep = document(ids)
        fraction = kept_fraction(n, h, d, ids)
        dense = torch.from_numpy((ids[:, None] == ids[None, :]) & np.tri(n, dtype=bool))
        row_contenders = {
            "qkv": lambda keep=keep: qkv.attention(q, k, v, causal=True, mask_mod=keep),
            "sdpa": lambda dense=dense: run_sdpa(dense),
        }
        if flex is not None:
            tid = torch.from_numpy(ids)

            def doc_mask(b, hh, qi, kj, tid=tid):
                return (tid[qi] == tid[kj]) & (kj <= qi)

            try:
                bm = create_block_mask(doc_mask, None, None, n, n, device="cpu")

                def run_flex(bm=bm, fn=flex):
                    with torch.no_grad():
                        return fn(tq, tk, tv, block_mask=bm)

                run_flex()
                row_contenders["flex"] = run_flex
            except Exception as exc:
                flex_kind = f"fails: {type(exc).__name__}: {str(exc)[:80]}"
                print(f"flex_attention {flex_kind}")
                flex = None
        t = _common.race(row_contenders, repeat=args.repeat)
        rows.append(
            {
                "document length": doc,
                "tiles kept": f"{fraction:.1%}",
                "qkv ÷ plain causal": f"{t['qkv'] / plain:.2f}×",
                "qkv ÷ sdpa(mask)": f"{t['qkv'] / t['sdpa']:.2f}×",
                "qkv ÷ flex": f"{t['qkv'] / t['flex']:.2f}×" if "flex" in t else "—",
            }
        )
    cols = ["document length", "tiles kept", "qkv ÷ plain causal", "qkv ÷ sdpa(mask)", "qkv ÷ flex"]
    print(_common.table(rows, cols))


if __name__ == "__main__":
    main()
