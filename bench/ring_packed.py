"""Ring attention on packed documents and with a sliding window: balance, waiting and the
blocks skipped, against the cost model of ``docs/distributed.md``.

    python bench/ring_packed.py                       # a few minutes on 2 cores
    python bench/ring_packed.py --docs 64 --min 512 --max 8192 --worlds 2 4

Each workload runs on ``W`` MPI ranks (``mpiexec -n W``, this script as the worker; ranks on
one host split its cores), causal, float32, 2 heads, d = 64, forward and backward. Reported
per workload: every rank's compute seconds as max/mean (balance), the fraction of the ring's
time spent waiting, the share of (query chunk, key chunk) blocks skipped, and the model's
prediction of both: a rank's work is its visible query-key pairs (counted exactly from the
positions), and a block is computed iff any pair of it is visible. Everything reported is a
ratio within one run (no peer library has packed ring attention on the CPU).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import _common  # noqa: F401  (puts ../src on the path)
import numpy as np
from ring import _env  # the ranks find this checkout's qkv and split the cores

HEADS, D = 2, 64


def lengths(n_docs: int, lo: int, hi: int, world: int, seed: int = 0) -> np.ndarray:
    """Document lengths between ``lo`` and ``hi``, each a multiple of ``2W`` (zigzag)."""
    rng = np.random.default_rng(seed)
    n = rng.integers(lo, hi + 1, size=n_docs)
    return n - n % (2 * world)


def visible_pairs(doc_positions: np.ndarray, window: int | None) -> np.ndarray:
    """Keys each query sees under causal masking (and a left window), from its position in
    its document."""
    p = doc_positions.astype(np.int64)
    return p + 1 if window is None else np.minimum(p, window) + 1


def model(world: int, docs: np.ndarray, window: int | None) -> dict[str, float]:
    """Per-rank work (visible pairs) max/mean and the share of chunk blocks skipped."""
    from qkv.distributed import positions

    work = np.zeros(world)
    computed = total = 0
    for n in docs:
        h = n // (2 * world)
        if h == 0:
            continue
        for r in range(world):
            work[r] += visible_pairs(positions(int(n), r, world), window).sum()
        for qc in range(2 * world):  # block (qc, kc) is computed iff a pair of it is visible
            for kc in range(2 * world):
                total += 1
                computed += kc == qc or (
                    kc < qc and (window is None or (kc + 1) * h - 1 >= qc * h - window)
                )
    n = int(docs.sum())
    return {
        "balance": float(work.max() / work.mean()),
        "skipped": 1 - computed / total,
        "work": float(work.sum() / (n * (n + 1) / 2)),  # against one causal sequence of all
    }


def worker(config: str) -> None:
    """One rank: its shard of the workload, the ring forward and backward, stats to rank 0."""
    from mpi4py import MPI

    from qkv.distributed import (
        RingStats,
        ring_attention,
        ring_attention_varlen,
        ring_attention_varlen_vjp,
        ring_attention_vjp,
        shard,
        shard_varlen,
    )

    cfg = json.loads(config)
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    docs = np.array(cfg["docs"])
    cu = np.concatenate([[0], np.cumsum(docs)])
    n = int(cu[-1])
    rng = np.random.default_rng(1)
    q, k, v, g = (rng.standard_normal((n, HEADS, D), dtype=np.float32) for _ in range(4))
    win = None if cfg["window"] is None else (cfg["window"], 0)
    fwd, bwd = RingStats(), RingStats()
    comm.Barrier()
    t0 = time.perf_counter()
    if cfg["packed"]:
        sh = [shard_varlen(x, cu, rank, world) for x in (q, k, v, g)]
        out, lse = ring_attention_varlen(
            *sh[:3], cu, causal=True, window=win, return_lse=True, stats=fwd
        )
        ring_attention_varlen_vjp(*sh[:3], sh[3], out, lse, cu, causal=True, window=win, stats=bwd)
    else:
        sh = [shard(np.moveaxis(x, 0, -2), rank, world) for x in (q, k, v, g)]
        out, lse = ring_attention(*sh[:3], causal=True, window=win, return_lse=True, stats=fwd)
        ring_attention_vjp(*sh[:3], sh[3], out, lse, causal=True, window=win, stats=bwd)
    ring_s = time.perf_counter() - t0
    mine = [fwd.compute_s + bwd.compute_s, fwd.wait_s + bwd.wait_s, fwd.blocks, ring_s]
    rows = comm.gather(mine, root=0)
    if rank == 0:
        print(json.dumps({"rows": rows}), flush=True)


def launch(world: int, cfg: dict) -> dict:
    cmd = [shutil.which("mpiexec") or "mpiexec", "-n", str(world), sys.executable]
    cmd += [str(Path(__file__).resolve()), "--worker", json.dumps(cfg)]
    res = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed:\n{res.stdout}\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--min", type=int, default=128)
    ap.add_argument("--max", type=int, default=2048)
    ap.add_argument("--n", type=int, default=16384, help="tokens of the windowed workload")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return
    print(f"causal, float32, {HEADS} heads, d = {D}, forward + backward, MPI ranks on this host")
    print(
        "| workload | W | compute max/mean | model max/mean | wait | blocks skipped "
        "| model skipped | pairs vs unpacked causal |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for world in args.worlds:
        docs = lengths(args.docs, args.min, args.max, world)
        work = [
            (f"{args.docs} docs {args.min}-{args.max}", {"docs": docs.tolist(), "window": None,
                                                         "packed": True}),
            (f"N={args.n} window {args.window}", {"docs": [args.n - args.n % (2 * world)],
                                                  "window": args.window, "packed": False}),
        ]  # fmt: skip
        for name, cfg in work:
            rep = launch(world, cfg)
            rows = np.array(rep["rows"])
            compute, wait, blocks, ring = rows.T
            m = model(world, np.array(cfg["docs"]), cfg["window"])
            pairs = len(cfg["docs"]) * (2 * world) ** 2  # the forward's chunk pairs
            skipped = 1 - blocks.sum() / pairs
            print(
                f"| {name} | {world} | {compute.max() / compute.mean():.2f} | "
                f"{m['balance']:.2f} | {wait.sum() / (compute.sum() + wait.sum()):.1%} | "
                f"{skipped:.1%} | {m['skipped']:.1%} | {m['work']:.1%} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
