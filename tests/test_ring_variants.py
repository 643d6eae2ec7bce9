"""Ring attention with windows and variants, rings of 1-4 ranks run as threads in this process.

Every rank's forward, lse and gradients (float64) equal single-process ``qkv.attention`` /
``qkv.attention_vjp`` over the whole sequence to 1e-12, for both layouts, causal and not,
windows shorter and longer than a chunk, softcap, ALiBi, sinks and ``mask_mod``. The threads
talk through an in-memory :class:`~qkv.distributed.comm.Communicator`; real gloo ranks run a
few of the same cases in ``test_distributed_torch.py``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from tests.conftest import bound

import qkv
from qkv.distributed import RingStats, ring_attention, ring_attention_vjp, shard
from qkv.distributed.comm import Communicator, Request

N = 48  # cut into 2W chunks for every W in 1..4 (chunks of 6 tokens at W = 4, zigzag)


class _Hub:
    def __init__(self, size: int) -> None:
        self.size = size
        self.boxes = {(r, t): queue.Queue() for r in range(size) for t in (11, 12)}
        self.slots: list[Any] = [None] * size
        self.barrier = threading.Barrier(size, timeout=20)


class _Done(Request):
    def __init__(self, box: queue.Queue, recv: np.ndarray) -> None:
        self.box, self.recv = box, recv

    def wait(self) -> None:
        self.recv[...] = self.box.get(timeout=20)


class ThreadComm(Communicator):
    """Ranks that are threads of one process (messages copied through queues)."""

    backend = "threads"

    def __init__(self, hub: _Hub, rank: int) -> None:
        self.hub, self.rank, self.size = hub, rank, hub.size

    def exchange(self, send: np.ndarray, recv: np.ndarray, tag: int) -> Request:
        self.hub.boxes[(self.next, tag)].put(send.copy())
        return _Done(self.hub.boxes[(self.rank, tag)], recv)

    def allgather(self, x: np.ndarray) -> np.ndarray:
        self.hub.slots[self.rank] = np.array(x, copy=True)
        self.hub.barrier.wait()
        out = np.stack(self.hub.slots)
        self.hub.barrier.wait()
        return out


def run_ring(world: int, fn: Callable[[Communicator, int], Any]) -> list[Any]:
    """``fn(comm, rank)`` on ``world`` threads; every rank's result (or its exception)."""
    hub = _Hub(world)
    results: list[Any] = [None] * world

    def one(rank: int) -> None:
        try:
            results[rank] = fn(ThreadComm(hub, rank), rank)
        except qkv.InputError as exc:  # raised on every rank after the all-gather
            results[rank] = exc
        except BaseException as exc:  # reported to the test below; free the other ranks
            results[rank] = exc
            hub.barrier.abort()

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank did not finish"
    return results


def _close(name: str, got: Any, want: Any) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    err = np.where(same, 0.0, np.abs(got - want))
    assert np.max(err, initial=0) <= bound("float64 path", np.float64), (
        f"{name}: max error {np.max(err):.3g}"
    )


def _documents(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """Documents of 7 tokens, causal within each (a packed batch as a mask_mod)."""
    return (q_idx // 7 == kv_idx // 7) & (kv_idx <= q_idx)


VARIANTS: dict[str, dict[str, Any]] = {
    "window shorter than a chunk": {"window": (2, None)},
    "window both sides": {"window": (5, 3)},
    "window right only": {"window": (None, 4)},
    "window wider than the sequence": {"window": (100, 10**30)},
    "softcap": {"softcap": 1.5},
    "alibi": {"alibi_slopes": np.array([0.5, 0.125, 0.25, 1.0])},
    "sinks": {"sinks": np.array([0.3, -1.0, 2.0, 0.0])},
    "mask_mod": {"mask_mod": _documents},
    "all together": {
        "window": (9, 2),
        "softcap": 3.0,
        "alibi_slopes": np.array([0.5, 0.125, 0.25, 1.0]),
        "sinks": np.array([[0.3], [-1.0], [2.0], [0.0]])[:, 0],
        "mask_mod": lambda b, h, q, k: (q + k + h) % 5 != 0,
    },
}


def _problem(seed: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((4, N, 8))  # 4 query heads on 2 kv heads
    k = rng.standard_normal((2, N, 8))
    v = rng.standard_normal((2, N, 5))
    g = rng.standard_normal((4, N, 5))
    return q, k, v, g


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_variants_equal_one_process(variant: str, layout: str, causal: bool) -> None:
    opts = {"causal": causal, **VARIANTS[variant]}
    q, k, v, g = _problem(len(variant))
    want, want_lse = qkv.attention(q, k, v, return_lse=True, **opts)
    want_grads = qkv.attention_vjp(q, k, v, g, **opts)
    for world in (1, 2, 3, 4):

        def rank_fn(comm: Communicator, rank: int, world: int = world) -> Any:
            sh = [shard(x, rank, world, layout=layout) for x in (q, k, v, g)]
            kw = {"comm": comm, "layout": layout, **opts}
            out, lse = ring_attention(*sh[:3], return_lse=True, **kw)
            grads = ring_attention_vjp(*sh[:3], sh[3], out, lse, **kw)
            return out, lse, grads

        for rank, res in enumerate(run_ring(world, rank_fn)):
            if isinstance(res, BaseException):
                raise res
            out, lse, grads = res
            tag = f"W={world} rank {rank} {variant}"
            _close(f"{tag} out", out, shard(want, rank, world, layout=layout))
            _close(f"{tag} lse", lse, shard(want_lse, rank, world, layout=layout, axis=-1))
            assert len(grads) == len(want_grads)
            for name, got, ref in zip(("dq", "dk", "dv"), grads, want_grads, strict=False):
                _close(f"{tag} {name}", got, shard(ref, rank, world, layout=layout))
            if "sinks" in opts:  # the sinks' gradient is the whole sequence's, on every rank
                _close(f"{tag} dsinks", grads[3], want_grads[3])


def test_blocks_the_window_hides_are_not_computed() -> None:
    """Contiguous, causal, window (1, 0) over 4 ranks: each rank sees its own chunk and the
    last key of the previous one, so rank 0 computes 1 block and the others 2 (of 4 steps)."""
    q, k, v, _ = _problem(0)

    def rank_fn(comm: Communicator, rank: int) -> Any:
        stats = RingStats()
        sh = [shard(x, rank, 4, layout="contiguous") for x in (q, k, v)]
        out = ring_attention(
            *sh, comm=comm, causal=True, window=(1, 0), layout="contiguous", stats=stats
        )
        return out, stats.blocks, stats.skipped

    want = qkv.attention(q, k, v, causal=True, window=(1, 0))
    for rank, res in enumerate(run_ring(4, rank_fn)):
        assert not isinstance(res, BaseException), res
        out, blocks, skipped = res
        _close(f"rank {rank}", out, shard(want, rank, 4, layout="contiguous"))
        assert (blocks, skipped) == ((1, 3) if rank == 0 else (2, 2))


def test_blocks_a_mask_mod_hides_are_not_computed() -> None:
    """A mask_mod that keeps every query to its own rank's chunk (contiguous): one block per
    rank, the other steps skipped."""
    q, k, v, _ = _problem(1)
    own = lambda b, h, qi, kj: qi // 12 == kj // 12  # noqa: E731

    def rank_fn(comm: Communicator, rank: int) -> Any:
        stats = RingStats()
        sh = [shard(x, rank, 4, layout="contiguous") for x in (q, k, v)]
        out = ring_attention(*sh, comm=comm, mask_mod=own, layout="contiguous", stats=stats)
        return out, stats.blocks

    want = qkv.attention(q, k, v, mask_mod=own)
    for rank, res in enumerate(run_ring(4, rank_fn)):
        assert not isinstance(res, BaseException), res
        _close(f"rank {rank}", res[0], shard(want, rank, 4, layout="contiguous"))
        assert res[1] == 1


def test_ranks_disagreeing_on_the_window_are_refused_on_every_rank() -> None:
    q, k, v, _ = _problem(2)

    def rank_fn(comm: Communicator, rank: int) -> Any:
        sh = [shard(x, rank, 2) for x in (q, k, v)]
        return ring_attention(*sh, comm=comm, window=(3, None) if rank else (2, None))

    for res in run_ring(2, rank_fn):
        assert isinstance(res, qkv.InputError) and "disagree on window" in str(res), res


def test_float32_within_one_process_error() -> None:
    q, k, v, _ = _problem(3)
    opts = {"causal": True, "window": (4, None), "alibi_slopes": np.full(4, 0.25), "softcap": 2.0}
    ref = qkv.attention(q, k, v, **opts)
    f32 = [x.astype(np.float32) for x in (q, k, v)]
    single = float(np.max(np.abs(qkv.attention(*f32, **opts) - ref)))

    def rank_fn(comm: Communicator, rank: int) -> Any:
        return ring_attention(*(shard(x, rank, 3) for x in f32), comm=comm, **opts)

    for rank, out in enumerate(run_ring(3, rank_fn)):
        assert not isinstance(out, BaseException), out
        assert out.dtype == np.float32
        err = float(np.max(np.abs(out - shard(ref, rank, 3))))
        assert err <= 4 * single + 1e-7, (err, single)


def test_torch_autograd_with_variants() -> None:
    """Tensors that require grad, sinks included: the ring's backward gives every gradient."""
    torch = pytest.importorskip("torch")
    q, k, v, g = _problem(4)
    sinks = np.array([0.3, -1.0, 2.0, 0.0])
    opts = {"causal": True, "window": (3, 1), "alibi_slopes": np.full(4, 0.5)}
    want = qkv.attention(q, k, v, sinks=sinks, **opts)
    want_grads = qkv.attention_vjp(q, k, v, g, sinks=sinks, **opts)

    def rank_fn(comm: Communicator, rank: int) -> Any:
        ts = [torch.tensor(shard(x, rank, 2), requires_grad=True) for x in (q, k, v)]
        st = torch.tensor(sinks, requires_grad=True)
        out = ring_attention(*ts, sinks=st, comm=comm, **opts)
        (out * torch.tensor(shard(g, rank, 2))).sum().backward()
        return out.detach().numpy(), [t.grad.numpy() for t in (*ts, st)]

    for rank, res in enumerate(run_ring(2, rank_fn)):
        assert not isinstance(res, BaseException), res
        out, grads = res
        _close(f"rank {rank} out", out, shard(want, rank, 2))
        for got, ref in zip(grads[:3], want_grads[:3], strict=True):
            _close(f"rank {rank} grad", got, shard(ref, rank, 2))
        _close(f"rank {rank} dsinks", grads[3], want_grads[3])
