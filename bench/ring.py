"""Ring attention on this machine: memory and overlap against W, zigzag vs contiguous, hop rate
of each backend, and a cost model for many hosts checked against the measured W = 2, 4.

    python bench/ring.py                 # about 3-5 minutes on 2 cores
    python bench/ring.py --sizes 16384 32768 65536 131072 --hop-mib 1 16 64

Every run of W ranks is ``mpiexec -n W python -m qkv.distributed.demo --json`` (causal,
float32, one head, d = 64, forward and backward, a sample of rows checked against one
process). The peer measured in the same run is single-process PyTorch SDPA (causal) and
single-process ``qkv.attention`` at the same N. Ranks on one host split its cores (each rank's
kernel threads and BLAS threads are its share).

Hop rate: two ranks exchange a buffer (each sends one and receives one at the same time, the
ring's pattern), best of 10; bytes per second are one direction's bytes over the time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import _common  # noqa: F401  (puts ../src on the path)
import numpy as np

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH")) if p)
    env.pop("OMP_NUM_THREADS", None)  # each rank takes its share of the cores itself
    return env


def run_demo(world: int, n: int, *, layout: str = "zigzag", backward: bool = True) -> dict:
    """One launch of ``world`` MPI ranks of the demo; its JSON report."""
    cmd = [
        shutil.which("mpiexec") or "mpiexec",
        "-n",
        str(world),
        sys.executable,
        "-m",
        "qkv.distributed.demo",
        "--n",
        str(n),
        "--json",
        "--check-rows",
        "2",
        "--layout",
        layout,
    ]
    if not backward:
        cmd.append("--no-backward")
    res = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stdout}\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- one hop, each backend


def hop_worker(backend: str, sizes_mib: list[int]) -> None:
    from qkv.distributed.comm import get_comm

    if backend == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        comm = get_comm(None)
    else:
        from mpi4py import MPI

        comm = get_comm(MPI.COMM_WORLD)
    rates = {}
    for mib in sizes_mib:
        send = np.ones(mib << 20, dtype=np.uint8)
        recv = np.empty_like(send)
        best = float("inf")
        for _ in range(10):
            comm.allgather(np.zeros(1))  # start together
            t0 = time.perf_counter()
            comm.exchange(send, recv, 7).wait()
            best = min(best, time.perf_counter() - t0)
        rates[mib] = send.nbytes / best
    if comm.rank == 0:
        print(json.dumps(rates), flush=True)
    if backend == "torch":
        dist.destroy_process_group()


def hop_rates(sizes_mib: list[int]) -> dict[str, dict[str, float]]:
    out = {}
    args = [str(Path(__file__).resolve()), "--hop-worker"]
    sizes = [str(s) for s in sizes_mib]
    torchrun = shutil.which("torchrun")
    launches = {
        "mpi": [
            shutil.which("mpiexec") or "mpiexec",
            "-n",
            "2",
            sys.executable,
            *args,
            "mpi",
            *sizes,
        ]
    }
    if torchrun:
        launches["torch (gloo)"] = [
            torchrun,
            "--standalone",
            "--nproc-per-node",
            "2",
            *args,
            "torch",
            *sizes,
        ]
    for name, cmd in launches.items():
        res = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            print(f"{name} hop failed: {res.stderr[-500:]}", file=sys.stderr)
            continue
        out[name] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


# ---------------------------------------------------------------- the cost model


def causal_pairs(n: int) -> float:
    return n * (n + 1) / 2


def model_step(
    n: int, world: int, d: int, rate: float, link: float, latency: float, itemsize: int = 4
) -> dict[str, float]:
    """Forward time per ring step of a zigzag causal ring: compute and the K/V hop, overlapped.

    Every zigzag step computes ``n_local² / 2`` (query, key) pairs at ``4 d`` FLOPs each and
    sends ``n_local · 2d`` numbers; with the hop posted first, a step takes the longer of the two.
    """
    n_local = n / world
    compute = (n_local**2 / 2) * 4 * d / rate
    comm = latency + n_local * 2 * d * itemsize / link if world > 1 else 0.0
    return {
        "compute": compute,
        "comm": comm,
        "step": max(compute, comm),
        "total": world * max(compute, comm),
    }


def step_kernel_time(n_local: int, d: int) -> float:
    """Best time of one zigzag ring step's kernel call on one thread: ``n_local`` queries
    against ``n_local / 2`` keys, unmasked (float32)."""
    import qkv
    from qkv.engine.kernels.threads import limit_threads

    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, n_local, d), dtype=np.float32)
    k, v = (rng.standard_normal((1, n_local // 2, d), dtype=np.float32) for _ in range(2))
    with limit_threads(1):
        return _common.best_time(lambda: qkv.attention(q, k, v), repeat=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", type=int, nargs="+", default=[16384, 32768, 65536])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--layout-n", type=int, default=32768)
    ap.add_argument("--hop-mib", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--link-gbit", type=float, default=100.0, help="network of the model")
    ap.add_argument("--latency-us", type=float, default=5.0)
    ap.add_argument("--hop-worker", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.hop_worker:
        hop_worker(args.hop_worker[0], [int(x) for x in args.hop_worker[1:]])
        return

    from machine import gemm_gflops

    gemm = gemm_gflops()
    print(
        f"# ring attention on this machine ({os.cpu_count()} cores, shared; float32 GEMM "
        f"{gemm:.0f} GFLOP/s); causal, float32, 1 head, d = 64\n"
    )

    # peers, one process: PyTorch SDPA and qkv.attention at the smallest size (PyTorch SDPA
    # on the CPU may hold GiBs at large N)
    n_peer = min(args.sizes)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, n_peer, 64), dtype=np.float32) for _ in range(3))
    import qkv

    t_qkv = _common.best_time(lambda: qkv.attention(q, k, v, causal=True), repeat=1)
    t_torch = None
    try:
        import torch

        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        t_torch = _common.best_time(
            lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True),
            repeat=1,
        )
    except ImportError:
        pass
    rate_1 = causal_pairs(n_peer) * 4 * 64 / t_qkv
    print(
        f"one process, N = {n_peer}: qkv.attention {t_qkv:.2f} s "
        f"({rate_1 / 1e9:.0f} GFLOP/s, {rate_1 / 1e9 / gemm:.0%} of GEMM)"
        + (
            f", PyTorch SDPA {t_torch:.2f} s (qkv/PyTorch {t_qkv / t_torch:.2f}x)"
            if t_torch
            else ""
        )
        + "\n"
    )

    rows, runs = [], {}
    for n in args.sizes:
        for w in args.worlds:
            r = run_demo(w, n)
            runs[(w, n)] = r
            ranks = r["ranks"]
            t_fwd = max(x["fwd_s"] for x in ranks)
            rows.append(
                {
                    "N": n,
                    "W": w,
                    "fwd s": f"{max(x['fwd_s'] for x in ranks):.2f}",
                    "bwd s": f"{max(x['bwd_s'] for x in ranks):.2f}",
                    "fwd vs 1 process": f"{t_fwd / runs[(1, n)]['ranks'][0]['fwd_s']:.2f}x"
                    if (1, n) in runs
                    else "",
                    "peak RSS/rank MiB": f"{max(x['peak_mib'] for x in ranks):.0f}",
                    "rise/rank MiB": f"{max(x['peak_over_start_mib'] for x in ranks):.0f}",
                    "wait fwd": f"{np.mean([x['fwd_wait'] for x in ranks]):.1%}",
                    "wait bwd": f"{np.mean([x['bwd_wait'] for x in ranks]):.1%}",
                    "max err out": f"{max(x['err_out'] for x in ranks):.1e}",
                }
            )
            print(f"  N={n} W={w} done", file=sys.stderr, flush=True)
    print("## memory, time and waiting against W (forward + backward, zigzag)\n")
    print(_common.table(rows, list(rows[0])) + "\n")

    print(f"## zigzag vs contiguous (W = 4, N = {args.layout_n}, forward)\n")
    lrows = []
    for layout in ("zigzag", "contiguous"):
        r = run_demo(4, args.layout_n, layout=layout, backward=False)
        comp = [x["fwd_compute_s"] for x in r["ranks"]]
        lrows.append(
            {
                "layout": layout,
                "compute s per rank": " / ".join(f"{c:.2f}" for c in comp),
                "max/mean": f"{max(comp) / np.mean(comp):.2f}",
                "fwd s (slowest)": f"{max(x['fwd_s'] for x in r['ranks']):.2f}",
                "wait": f"{np.mean([x['fwd_wait'] for x in r['ranks']]):.1%}",
            }
        )
    print(_common.table(lrows, list(lrows[0])) + "\n")

    print("## one hop (2 ranks on this host, each sends and receives at once)\n")
    hops = hop_rates(args.hop_mib)
    hrows = [
        {"backend": b, **{f"{m} MiB": f"{float(rate) / 1e9:.2f} GB/s" for m, rate in rr.items()}}
        for b, rr in hops.items()
    ]
    if hrows:
        print(_common.table(hrows, list(hrows[0])) + "\n")

    # cost model: one step's kernel time measured here on one thread (a zigzag step: both local
    # query chunks against one key chunk), ranks sharing this host's cores, hop at the MPI rate
    n_cal = max(args.sizes)
    cores = os.cpu_count() or 1
    mpi_hop = max(hops.get("mpi", {"0": 1e9}).values())
    print("## cost model\n")
    crows = []
    rate = None
    for w in args.worlds:
        if w == 1 or (w, n_cal) not in runs:
            continue
        t_block = step_kernel_time(n_cal // w, 64)
        rate = (n_cal // w) ** 2 / 2 * 4 * 64 / t_block  # FLOP/s of one thread
        share = min(1.0, cores / w)
        m = model_step(n_cal, w, 64, rate * share, mpi_hop, 20e-6)
        meas = max(x["fwd_s"] for x in runs[(w, n_cal)]["ranks"])
        crows.append(
            {
                "W": w,
                "N": n_cal,
                "1-thread step kernel s": f"{t_block:.2f}",
                "core share": f"{share:.2f}",
                "model compute/step s": f"{m['compute']:.2f}",
                "model hop ms": f"{m['comm'] * 1e3:.2f}",
                "model fwd s": f"{m['total']:.2f}",
                "measured fwd s": f"{meas:.2f}",
                "measured/model": f"{meas / m['total']:.2f}",
            }
        )
    print(
        "A step's kernel work timed in this process on one thread; ranks on this host share "
        f"its {cores} cores; hop at the measured MPI rate. Against the measured forward:\n"
    )
    print(_common.table(crows, list(crows[0])) + "\n")
    rate = (rate or 1e10) * cores  # a host like this one, every core busy
    link = args.link_gbit * 1e9 / 8
    print(
        f"Prediction: one host like this per rank ({rate / 1e9:.0f} GFLOP/s: the one-thread "
        f"kernel rate times {cores} cores), {args.link_gbit:g} Gb/s links "
        f"({args.latency_us:g} µs latency), forward of one causal head, d = 64:\n"
    )
    prows = []
    for n in (1 << 20, 1 << 24):
        for w in (8, 64, 256, 1024):
            m = model_step(n, w, 64, rate, link, args.latency_us * 1e-6)
            prows.append(
                {
                    "N": n,
                    "W": w,
                    "compute/step ms": f"{m['compute'] * 1e3:.3g}",
                    "hop ms": f"{m['comm'] * 1e3:.3g}",
                    "bound": "compute" if m["compute"] >= m["comm"] else "network",
                    "fwd s": f"{m['total']:.3g}",
                }
            )
    print(_common.table(prows, list(prows[0])))
    print(
        f"\nA step is network-bound once n_local < 4·rate/link = "
        f"{4 * rate / link:.0f} tokens per rank."
    )


if __name__ == "__main__":
    main()
