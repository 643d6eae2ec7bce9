"""Paged decode against the contiguous decode step, in one process, every storage form.

    python bench/paged.py                      # B8 H32 kv8 S4096 d128, page size 16
    python bench/paged.py --rounds 9 --threads 2 --page-size 64

Both contenders are qkv's native decode step on the same K/V values: the contiguous one reads
each sequence's keys from buffers ``(batch, kv_heads, S, d)`` (a :class:`qkv.KVCache`'s
layout, :func:`qkv.engine.kernels.native_decode.prepare`), the paged one reads pages
``(num_blocks, page_size, kv_heads, d)`` in place through a block table
(:func:`qkv.engine.kernels.native_decode.paged_step`), each sequence's pages drawn at random
from a shuffled pool (a server's pool after many requests came and went). Each round times a
few calls of each, alternating, and the table gives the median over the rounds of each one's
time and of their ratio (goal: paged at least 90% of the contiguous rate), the K/V bytes
(codes and scales) read per second and that rate's share of this machine's read rate
(``bench/machine.py``'s, measured at the start).
"""

from __future__ import annotations

import argparse
import statistics
import time

import _common
import machine
import numpy as np

import qkv
from qkv.engine.kernels import native_decode

FORMS = ("float32", "bfloat16", "float16", "int8", "float8_e4m3fn")


def _stored(x: np.ndarray, form: str) -> tuple[np.ndarray, np.ndarray | None, str | None]:
    """``(codes, scales, kv_format)`` of float32 ``x`` stored in ``form``."""
    if form == "float32":
        return x, None, None
    if form == "float16":
        return x.astype(np.float16), None, None
    codes, scales = qkv.quantize_kv(x, form)
    return codes, scales, form


def _paged(x: np.ndarray, table: np.ndarray, blocks: int, page: int) -> np.ndarray:
    """``x (B, kv_heads, S, ...)`` laid out as pages ``(blocks, page, kv_heads, ...)``:
    position ``p`` of sequence ``b`` at ``table[b, p // page]``, row ``p % page``."""
    B, kvh, S = x.shape[:3]
    out = np.zeros((blocks, page, kvh, *x.shape[3:]), dtype=x.dtype)
    per = x.reshape(B, kvh, S // page, page, *x.shape[3:])
    out[table] = np.moveaxis(per, 1, 3)  # (B, S // page, page, kvh, ...)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=5, help="calls per contender per round")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--forms", nargs="*", default=list(FORMS), choices=FORMS)
    args = ap.parse_args()
    if args.threads:
        _common.same_threads(args.threads)
    B, H, kvh, S, d, P = args.batch, args.heads, args.kv_heads, args.seq, args.dim, args.page_size
    if S % P:
        raise SystemExit(f"--seq {S} must be a multiple of --page-size {P}")
    read = machine.read_gbps()
    print(f"B{B} H{H} kv{kvh} S{S} d{d}, page size {P}, one query per sequence")
    print(f"threads: {_common.threads_info()}; machine read rate {read:.1f} GB/s")
    rng = np.random.default_rng(0)
    per = S // P
    blocks = B * per + 8  # a few pages no sequence uses
    table = rng.permutation(blocks)[: B * per].reshape(B, per).astype(np.int32)
    q = rng.standard_normal((B, H, 1, d)).astype(np.float32)
    lo, hi = np.zeros(B, np.int64), np.full(B, S, np.int64)
    scale = d**-0.5
    rows = []
    for form in args.forms:
        kx = rng.standard_normal((B, kvh, S, d)).astype(np.float32)
        vx = rng.standard_normal((B, kvh, S, d)).astype(np.float32)
        (k, ks, fmt), (v, vs, _) = _stored(kx, form), _stored(vx, form)
        del kx, vx
        kp, vp = _paged(k, table, blocks, P), _paged(v, table, blocks, P)
        ksp = None if ks is None else _paged(ks, table, blocks, P)
        vsp = None if vs is None else _paged(vs, table, blocks, P)
        step = native_decode.prepare(q, k, v, scale, lo, hi, kv_format=fmt, k_scale=ks, v_scale=vs)
        if step is None:
            raise SystemExit("the native decode step is not available here")

        def flat(step=step) -> object:
            return step.run(q)

        def paged(kp=kp, vp=vp, fmt=fmt, ksp=ksp, vsp=vsp) -> object:
            return native_decode.paged_step(
                q, kp, vp, table, lo, hi, scale, kv_format=fmt, k_scale=ksp, v_scale=vsp
            )

        a, b = flat(), paged()
        assert a is not None and b is not None
        np.testing.assert_allclose(b[0], a[0], rtol=1e-5, atol=1e-6)  # the same values read
        times: dict[str, list[float]] = {"flat": [], "paged": []}
        for _ in range(args.rounds):
            for name, fn in (("flat", flat), ("paged", paged)):
                time.sleep(0.05)
                fn()
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                times[name].append((time.perf_counter() - t0) / args.calls)
        ratios = [f / p for f, p in zip(times["flat"], times["paged"], strict=True)]
        nbytes = k.nbytes + v.nbytes + (0 if ks is None else ks.nbytes + vs.nbytes)
        tf, tp = statistics.median(times["flat"]), statistics.median(times["paged"])
        rows.append(
            {
                "form": form,
                "contiguous ms": f"{tf * 1e3:.2f}",
                "paged ms": f"{tp * 1e3:.2f}",
                "paged rate / contiguous": f"{statistics.median(ratios):.0%}",
                "(min..max)": f"{min(ratios):.0%}..{max(ratios):.0%}",
                "paged GB/s": f"{nbytes / tp / 1e9:.1f}",
                "of read rate": f"{nbytes / tp / 1e9 / read:.0%}",
                "contiguous of read rate": f"{nbytes / tf / 1e9 / read:.0%}",
            }
        )
        del k, v, kp, vp
    print(_common.table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
