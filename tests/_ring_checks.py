"""Multi-rank checks of :mod:`qkv.distributed`, run by ``test_distributed_torch.py`` and
``test_distributed_mpi.py`` in child processes (this file is not a test module itself).

    python tests/_ring_checks.py torch 4        # spawns 4 gloo ranks on 127.0.0.1
    mpiexec -n 4 python tests/_ring_checks.py mpi

Each launch runs every check for ring sizes 1…W (sub-groups of the W ranks), so one start-up
pays for all of them. A rank exits non-zero on the first failed check.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

# run as a script in child ranks: the checkout's root on the path, for the tests' table
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.conftest import bound  # noqa: E402

F64_TOL = bound("float64 path", np.float64)


def _close(name: str, got: Any, want: Any, tol: float) -> None:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    same_inf = np.isinf(want) & (got == want)
    err = np.where(same_inf, 0.0, np.abs(got - want))
    bound = tol * max(1.0, float(np.max(np.abs(np.where(np.isinf(want), 0, want)), initial=0)))
    assert np.all(err <= bound), f"{name}: max error {np.max(err):.3g} > {bound:.3g}"


def _err(a: Any, b: Any) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)), initial=0))


def _problem(seed: int, qshape, kvheads: int, dv: int, dtype=np.float64):
    rng = np.random.default_rng(seed)
    *lead, hq, n, d = qshape
    q = rng.standard_normal(qshape)
    k = rng.standard_normal((*lead, kvheads, n, d))
    v = rng.standard_normal((*lead, kvheads, n, dv))
    g = rng.standard_normal((*lead, hq, n, dv))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), g.astype(dtype)


def _documents(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """Packed documents of 7 tokens (a mask_mod over global positions)."""
    return q_idx // 7 == kv_idx // 7


CASES = [  # name, q shape, kv heads, dv, causal, layout
    ("causal zigzag gqa dv!=d", (2, 4, 48, 8), 2, 5, True, "zigzag"),
    ("causal contiguous gqa dv!=d", (2, 4, 48, 8), 2, 5, True, "contiguous"),
    ("non-causal zigzag", (3, 48, 8), 3, 8, False, "zigzag"),
    ("non-causal contiguous gqa", (1, 4, 48, 6), 1, 7, False, "contiguous"),
    ("causal zigzag tiled", (1, 1920, 16), 1, 16, True, "zigzag"),
]


def check_world(comm: Any, rank: int, W: int) -> int:
    """Every check for one ring of ``W`` ranks; returns how many ran."""
    import qkv
    from qkv.distributed import decode, ring_attention, ring_attention_vjp, shard

    n_checks = 0
    for i, (name, qshape, hkv, dv, causal, layout) in enumerate(CASES):
        if name.endswith("tiled") and W not in (1, 4):
            continue
        q, k, v, g = _problem(i, qshape, hkv, dv)
        want, want_lse = qkv.attention(q, k, v, causal=causal, return_lse=True)
        want_grads = qkv.attention_vjp(q, k, v, g, causal=causal)
        sh = [shard(x, rank, W, layout=layout) for x in (q, k, v, g)]
        out, lse = ring_attention(*sh[:3], comm=comm, causal=causal, layout=layout, return_lse=True)
        tag = f"W={W} {name}"
        _close(f"{tag} out", out, shard(want, rank, W, layout=layout), F64_TOL)
        _close(
            f"{tag} lse", lse, shard(want_lse[..., None], rank, W, layout=layout)[..., 0], F64_TOL
        )
        grads = ring_attention_vjp(
            *sh[:3], sh[3], out, lse, comm=comm, causal=causal, layout=layout
        )
        for gname, got, ref in zip(("dq", "dk", "dv"), grads, want_grads, strict=True):
            assert got.dtype == np.float64
            _close(f"{tag} {gname}", got, shard(ref, rank, W, layout=layout), F64_TOL)
        n_checks += 5

    # windows and variants over the whole sequence (every combination runs on threads in
    # test_ring_variants.py; here two of them cross real ranks)
    q, k, v, g = _problem(21, (4, 48, 8), 2, 5)
    variants = [
        ("zigzag", {"causal": True, "window": (2, None), "softcap": 2.0,
                    "alibi_slopes": np.full(4, 0.5), "sinks": np.arange(4.0) - 1}),
        ("contiguous", {"window": (5, 3), "mask_mod": _documents}),
    ]  # fmt: skip
    for layout, opts in variants:
        want, want_lse = qkv.attention(q, k, v, return_lse=True, **opts)
        want_grads = qkv.attention_vjp(q, k, v, g, **opts)
        sh = [shard(x, rank, W, layout=layout) for x in (q, k, v, g)]
        kw = {"comm": comm, "layout": layout, **opts}
        out, lse = ring_attention(*sh[:3], return_lse=True, **kw)
        grads = ring_attention_vjp(*sh[:3], sh[3], out, lse, **kw)
        tag = f"W={W} variants {sorted(opts)}"
        _close(f"{tag} out", out, shard(want, rank, W, layout=layout), F64_TOL)
        _close(f"{tag} lse", lse, shard(want_lse, rank, W, layout=layout, axis=-1), F64_TOL)
        for gname, got, ref in zip(("dq", "dk", "dv"), grads, want_grads, strict=False):
            _close(f"{tag} {gname}", got, shard(ref, rank, W, layout=layout), F64_TOL)
        if "sinks" in opts:
            _close(f"{tag} dsinks", grads[3], want_grads[3], F64_TOL)
        n_checks += 1

    # packed documents (short, empty and long ones), each cut into the layout's chunks
    from qkv.distributed import ring_attention_varlen, ring_attention_varlen_vjp, shard_varlen

    parts = 2 * W
    cu = np.cumsum([0, parts, 0, 5 * parts, 2 * parts])
    rng = np.random.default_rng(5)
    qv, kv_, vv, gv = (rng.standard_normal((int(cu[-1]), h, 6)) for h in (4, 2, 2, 4))
    opts = {"causal": True, "window": (3, None)}
    want, want_lse = qkv.attention_varlen(qv, kv_, vv, cu, cu, return_lse=True, **opts)
    sh = [shard_varlen(x, cu, rank, W) for x in (qv, kv_, vv, gv)]
    out, lse = ring_attention_varlen(*sh[:3], cu, comm=comm, return_lse=True, **opts)
    _close(f"W={W} varlen out", out, shard_varlen(want, cu, rank, W), F64_TOL)
    _close(f"W={W} varlen lse", lse, shard_varlen(want_lse, cu, rank, W), F64_TOL)
    grads = ring_attention_varlen_vjp(*sh[:3], sh[3], out, lse, cu, comm=comm, **opts)
    for gname, got, x in zip(("dq", "dk", "dv"), grads, (qv, kv_, vv), strict=True):
        ref = np.zeros_like(x)
        for a, b in zip(cu[:-1], cu[1:], strict=True):
            if b > a:
                doc = [np.moveaxis(y[a:b], 0, -2) for y in (qv, kv_, vv, gv)]
                part = qkv.attention_vjp(*doc, **opts)[("dq", "dk", "dv").index(gname)]
                ref[a:b] = np.moveaxis(part, -2, 0)
        _close(f"W={W} varlen {gname}", got, shard_varlen(ref, cu, rank, W), F64_TOL)
    n_checks += 1

    # float32 and float16: within a small factor of one process's own error
    q, k, v, g = _problem(7, (2, 48, 16), 2, 16)
    ref = qkv.attention(q, k, v, causal=True)
    for dt, factor in ((np.float32, 4.0), (np.float16, 3.0)):
        single = _err(qkv.attention(q.astype(dt), k.astype(dt), v.astype(dt), causal=True), ref)
        sh = [shard(x.astype(dt), rank, W) for x in (q, k, v)]
        out = ring_attention(*sh, comm=comm, causal=True)
        assert out.dtype == dt, f"W={W} {dt}: out dtype {out.dtype}"
        e = _err(out, shard(ref, rank, W))
        assert e <= factor * single + 1e-7, f"W={W} {dt}: error {e:.3g} vs one process {single:.3g}"
        n_checks += 1

    # decode: ranks hold different numbers of keys (rank 1 none); and a cache with no keys
    rng = np.random.default_rng(99)
    sizes = [5 + 3 * r if r != 1 else 0 for r in range(W)]
    qd = rng.standard_normal((2, 4, 3, 8))
    kd = rng.standard_normal((2, 2, sum(sizes), 8))
    vd = rng.standard_normal((2, 2, sum(sizes), 6))
    lo = sum(sizes[:rank])
    mine = slice(lo, lo + sizes[rank])
    out, lse = decode(qd, kd[..., mine, :], vd[..., mine, :], comm=comm, return_lse=True)
    want, want_lse = qkv.attention(qd, kd, vd, return_lse=True)
    _close(f"W={W} decode out", out, want, F64_TOL)
    _close(f"W={W} decode lse", lse, want_lse, F64_TOL)
    out, lse = decode(qd[..., 0, :], kd[..., :0, :], vd[..., :0, :], comm=comm, return_lse=True)
    assert np.all(out == 0) and np.all(np.isneginf(lse)), f"W={W}: decode over no keys"
    n_checks += 2

    # torch tensors: autograd runs the ring backward, gradients in the inputs' dtype
    torch = sys.modules.get("torch")
    if torch is not None:
        q, k, v, g = _problem(11, (2, 48, 8), 2, 4)
        want = qkv.attention_vjp(q, k, v, np.ones_like(g), causal=True)
        ts = [
            torch.tensor(shard(x, rank, W), dtype=torch.float32, requires_grad=True)
            for x in (q, k, v)
        ]
        out = ring_attention(*ts, comm=comm, causal=True)
        assert out.dtype == torch.float32
        out.sum().backward()
        for t, ref in zip(ts, want, strict=True):
            assert t.grad.dtype == torch.float32
            _close(f"W={W} torch grad", t.grad.numpy(), shard(ref, rank, W), 1e-5)
        n_checks += 1
    return n_checks


def check_mismatch(comm: Any, rank: int, W: int) -> int:
    """Disagreeing ranks: an InputError on every rank, never a hang."""
    import qkv
    from qkv.distributed import ring_attention

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 8, 4))
    last = W - 1
    bigger, odd = rng.standard_normal((2, 12, 4)), rng.standard_normal((2, 7, 4))
    cases = [  # (this rank's q = k = v, options, what every rank's error says)
        (
            bigger if rank == last else x,
            {},
            f"disagree on q shape: rank 0 has (2, 8, 4), rank {last} has (2, 12, 4)",
        ),
        (
            x.astype(np.float32) if rank == last else x,
            {},
            f"disagree on q dtype: rank 0 has float64, rank {last} has float32",
        ),
        (
            odd if rank == 0 else x,
            {},
            f"world size {W}" if rank == 0 else f"rank(s) [0] of {W} rejected their arguments",
        ),
        (x, {"causal": rank == 0}, "ranks disagree on causal: rank 0 has True, rank 1 has False"),
    ]
    for arr, opts, message in cases:
        try:
            ring_attention(arr, arr, arr, comm=comm, **{"causal": True, **opts})
        except qkv.InputError as exc:
            assert message in str(exc), f"rank {rank}: expected {message!r}, got {exc}"
        else:
            raise AssertionError(f"rank {rank}: {message!r} was not raised")
    return 4


ABSENT_TIMEOUT = 1.0


def check_absent(comms: list[Any], rank: int, W: int) -> int:
    """The last rank never calls: every other rank raises RankTimeout naming it, after the
    timeout. Each call has a group of its own (``comms``, all ``W`` ranks): a timeout breaks
    the group it happened on."""
    from qkv.distributed import RankTimeout, decode, ring_attention

    x = np.random.default_rng(0).standard_normal((2, 8, 4))
    if rank == W - 1:
        time.sleep(len(comms) * ABSENT_TIMEOUT + 1.0)  # busy elsewhere until the others gave up
        return 0
    ring, dec = comms
    calls = [
        ("ring_attention", lambda: ring_attention(x, x, x, comm=ring, timeout=ABSENT_TIMEOUT)),
        ("decode", lambda: decode(x, x, x, comm=dec, timeout=ABSENT_TIMEOUT)),
    ]
    for what, call in calls:
        t0 = time.monotonic()
        try:
            call()
        except RankTimeout as exc:
            took = time.monotonic() - t0
            want = f"{what}: rank(s) [{W - 1}] of {W} did not enter the call: "
            assert want in str(exc), f"rank {rank}: expected {want!r}, got {exc}"
            assert exc.missing == [W - 1], f"rank {rank}: missing {exc.missing}"
            assert "no message from them within 1 s" in str(exc), str(exc)
            assert ABSENT_TIMEOUT <= took < ABSENT_TIMEOUT + 5, f"rank {rank}: {took:.2f} s"
        else:
            raise AssertionError(f"rank {rank}: {what} did not time out")
    return 2


def run_torch_rank(rank: int, world: int, port: int) -> None:
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        n = 0
        for W in range(1, world + 1):
            group = dist.new_group(list(range(W))) if W < world else None
            if rank < W:
                n += check_world(group, rank, W)
        n += check_mismatch(None, rank, world)
        n += check_absent([dist.new_group(list(range(world))) for _ in range(2)], rank, world)
        print(f"rank {rank}: {n} checks ok", flush=True)
    finally:
        dist.destroy_process_group()


def main_torch(world: int, timeout: float = 240.0) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.spawn(run_torch_rank, args=(world, port), nprocs=world, join=False)
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} torch ranks did not finish within {timeout} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def main_mpi() -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    n = 0
    for W in range(1, size + 1):
        sub = world.Split(0 if rank < W else MPI.UNDEFINED, rank)
        if rank < W:
            n += check_world(sub, rank, W)
            sub.Free()
    n += check_mismatch(world, rank, size)
    n += check_absent([world.Dup() for _ in range(2)], rank, size)
    print(f"rank {rank}: {n} checks ok", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if sys.argv[1] == "torch":
        main_torch(int(sys.argv[2]))
    else:
        main_mpi()
