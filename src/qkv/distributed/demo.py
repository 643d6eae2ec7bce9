"""A random causal problem, sharded, run forward and backward, checked against one process.

Launch it on any number of ranks::

    torchrun --standalone --nproc-per-node 4 -m qkv.distributed.demo --seqlen 65536
    mpiexec -n 4 python -m qkv.distributed.demo --seqlen 65536
    python -m qkv.distributed.demo --seqlen 4096         # one process, a ring of one

(``--n`` is short for ``--seqlen``, but torchrun takes ``--n`` for one of its own options.)

Every rank makes only its own shard (chunk ``c`` of the sequence comes from a generator seeded
with ``(seed, c)``), so memory per rank falls like ``1/W``. After timing, each rank checks a
sample of its rows, and their ``dq``, against single-process :func:`qkv.attention` in float64
over the keys those rows see, and the ranks check two sums that hold for exact gradients
(``Σ dv = Σ dO`` over rows that see a key, ``Σ dk = 0``). Rank 0 prints each rank's time,
peak memory and the fraction of time spent waiting on communication; ``--json`` prints the
same as one JSON line (used by ``bench/ring.py``). With ``--no-backward`` no gradient is
computed or checked, and the report says so (``-`` in the text, ``null`` in the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from typing import Any

import numpy as np


def _launcher(backend: str) -> Any:
    """The communicator for how this process was started."""
    if backend == "auto":
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            backend = "torch"
        elif any(v in os.environ for v in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")):
            backend = "mpi"
        else:
            backend = "local"
    if backend == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        return None  # the default group
    if backend == "mpi":
        from mpi4py import MPI

        return MPI.COMM_WORLD
    from .comm import LocalComm

    return LocalComm()


def _chunk(seed: int, c: int, heads: int, h: int, d: int, dtype: Any) -> list[np.ndarray]:
    """q, k, v and dO of chunk ``c`` (the same on whichever rank makes it)."""
    rng = np.random.default_rng([seed, c])
    return [rng.standard_normal((heads, h, d), dtype=np.float32).astype(dtype) for _ in range(4)]


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m qkv.distributed.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,  # keep the command lines whole
    )
    ap.add_argument(
        "--seqlen", "--n", dest="n", type=int, default=8192, help="whole sequence length"
    )
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--dtype", choices=["float32", "float64", "float16"], default="float32")
    ap.add_argument("--layout", choices=["zigzag", "contiguous"], default="zigzag")
    ap.add_argument("--backend", choices=["auto", "torch", "mpi", "local"], default="auto")
    ap.add_argument("--no-backward", action="store_true")
    ap.add_argument("--check-rows", type=int, default=4, help="rows per rank checked (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON line on rank 0")
    args = ap.parse_args(argv)

    from . import RingStats, ring_attention, ring_attention_vjp
    from .comm import get_comm
    from .layout import chunk_ids, n_chunks

    base_mib = _peak_mib()
    comm = _launcher(args.backend)
    c = get_comm(comm)
    W, rank = c.size, c.rank
    parts = n_chunks(W, args.layout)
    if args.n % parts:
        print(
            f"--n {args.n} must be a multiple of {parts} for {args.layout} on {W} ranks",
            file=sys.stderr,
        )
        return 2
    h, dt = args.n // parts, np.dtype(args.dtype)
    mine = chunk_ids(rank, W, args.layout)
    made = [_chunk(args.seed, ch, args.heads, h, args.d, dt) for ch in mine]
    q, k, v, g = (np.concatenate([m[i] for m in made], axis=-2) for i in range(4))
    del made

    tiny = np.zeros((1, len(mine), args.d), dtype=dt)  # warm-up: one token per chunk
    ring_attention(tiny, tiny, tiny, comm=comm, causal=True, layout=args.layout)
    fwd, bwd = RingStats(), RingStats()
    t0 = time.perf_counter()
    out, lse = ring_attention(
        q, k, v, comm=comm, causal=True, layout=args.layout, return_lse=True, stats=fwd
    )
    t1 = time.perf_counter()
    if not args.no_backward:
        dq, dk, dv = ring_attention_vjp(
            q, k, v, g, out, lse, comm=comm, causal=True, layout=args.layout, stats=bwd
        )
    t2 = time.perf_counter()
    peak = _peak_mib()

    err_out = err_dq = 0.0
    if args.check_rows:
        from ..engine.grad import attention_vjp
        from ..reference import attention

        pos = np.concatenate([np.arange(ch * h, (ch + 1) * h) for ch in mine])
        rows = np.random.default_rng([args.seed, rank]).choice(len(pos), args.check_rows)
        last = int(pos[rows].max()) // h
        whole = [_chunk(args.seed, ch, args.heads, h, args.d, dt) for ch in range(last + 1)]
        K, V = (np.concatenate([w[i] for w in whole], axis=-2).astype(np.float64) for i in (1, 2))
        for r in rows:
            p = int(pos[r])
            q64 = q[:, r : r + 1].astype(np.float64)
            want = attention(q64, K[:, : p + 1], V[:, : p + 1])
            err_out = max(err_out, float(np.abs(out[:, r : r + 1] - want).max()))
            if not args.no_backward:
                g64 = g[:, r : r + 1].astype(np.float64)
                dq_want = attention_vjp(q64, K[:, : p + 1], V[:, : p + 1], g64)[0]
                err_dq = max(err_dq, float(np.abs(dq[:, r : r + 1] - dq_want).max()))
    sums = np.zeros(3)
    if not args.no_backward:
        sums = np.array(
            [
                dv.astype(np.float64).sum() - g.astype(np.float64).sum(),
                dk.astype(np.float64).sum(),
                np.abs(g.astype(np.float64)).sum(),
            ]
        )
    mine_row = np.array(
        [
            t1 - t0,
            t2 - t1,
            peak,
            peak - base_mib,
            fwd.wait_fraction,
            bwd.wait_fraction,
            fwd.compute_s,
            bwd.compute_s,
            fwd.wait_s,
            bwd.wait_s,
            fwd.bytes_sent + bwd.bytes_sent,
            fwd.threads,
            err_out,
            err_dq,
            *sums,
        ]
    )
    every = c.allgather(mine_row)
    if rank == 0:
        tot = every[:, 14:17].sum(axis=0)
        report = {
            "world": W,
            "n": args.n,
            "heads": args.heads,
            "d": args.d,
            "dtype": args.dtype,
            "layout": args.layout,
            "backend": type(c).__name__,
            "ranks": [
                dict(
                    zip(
                        [
                            "fwd_s",
                            "bwd_s",
                            "peak_mib",
                            "peak_over_start_mib",
                            "fwd_wait",
                            "bwd_wait",
                            "fwd_compute_s",
                            "bwd_compute_s",
                            "fwd_wait_s",
                            "bwd_wait_s",
                            "bytes_sent",
                            "threads",
                            "err_out",
                            "err_dq",
                        ],
                        [float(x) for x in row[:14]],
                        strict=True,
                    )
                )
                for row in every
            ],
            "sum_dv_minus_sum_dout": float(tot[0]) / max(float(tot[2]), 1.0),
            "sum_dk": float(tot[1]),
            "backward": not args.no_backward,
        }
        if args.no_backward:  # nothing was computed: no numbers that look like checks
            report.update(sum_dv_minus_sum_dout=None, sum_dk=None)
            for r in report["ranks"]:
                r["err_dq"] = None
        if args.json:
            print(json.dumps(report), flush=True)
        else:
            print(
                f"ring attention: causal, n={args.n}, heads={args.heads}, d={args.d}, "
                f"{args.dtype}, {args.layout}, {W} rank(s) over {report['backend']}"
            )
            print("rank  fwd s  bwd s  peak MiB  wait fwd  wait bwd  threads  max err out/dq")
            for i, r in enumerate(report["ranks"]):
                back = (
                    ("     -", "        -", "-")
                    if args.no_backward
                    else (f"{r['bwd_s']:6.2f}", f"{r['bwd_wait']:9.1%}", f"{r['err_dq']:.2e}")
                )
                print(
                    f"{i:4d} {r['fwd_s']:6.2f} {back[0]} {r['peak_mib']:9.0f} "
                    f"{r['fwd_wait']:8.1%} {back[1]} {int(r['threads']):8d}  "
                    f"{r['err_out']:.2e} / {back[2]}"
                )
            if args.no_backward:
                print("no backward pass (--no-backward): no gradient was computed or checked")
            else:
                print(
                    f"gradient sums: (Σdv − ΣdO)/Σ|dO| = {report['sum_dv_minus_sum_dout']:.2e}, "
                    f"Σdk = {report['sum_dk']:.2e}"
                )
    tol = {"float64": 1e-10, "float32": 1e-4, "float16": 2e-2}[args.dtype]
    ok = bool(np.all(every[:, 12:14] <= tol))
    if type(c).__name__ == "TorchComm":  # the group _launcher started, and no other
        sys.modules["torch.distributed"].destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
