"""Packed documents across ranks: ``ring_attention_varlen`` and its VJP, rings of 1-4 ranks as
threads of this process (the in-memory communicator of ``test_ring_variants.py``).

float64 results equal single-process ``qkv.attention_varlen`` (and, per document,
``qkv.attention_vjp``) over the whole packed batch to 1e-12, for both layouts, causal and not,
windows shorter than a chunk, documents shorter than a chunk and empty ones; bad
``cu_seqlens`` give an ``InputError`` on every rank.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import qkv
from qkv.distributed import (
    RingStats,
    ring_attention_varlen,
    ring_attention_varlen_vjp,
    shard_varlen,
    unshard_varlen,
)
from qkv.distributed.comm import Communicator
from qkv.distributed.layout import n_chunks

from .test_ring_variants import _close, run_ring

DOCS = [1, 0, 5, 2, 0, 3]  # lengths in chunks of the layout: short, empty, long documents


def _problem(world: int, layout: str, seed: int = 0) -> tuple[Any, ...]:
    parts = n_chunks(world, layout)
    cu = np.concatenate([[0], np.cumsum(np.array(DOCS) * parts)])
    n = int(cu[-1])
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, 4, 8))
    k = rng.standard_normal((n, 2, 8))
    v = rng.standard_normal((n, 2, 5))
    g = rng.standard_normal((n, 4, 5))
    return cu, q, k, v, g


def _reference_vjp(q, k, v, g, cu, opts) -> list[np.ndarray]:
    """Gradients of attention_varlen, one document at a time with qkv.attention_vjp."""
    out = [np.zeros_like(x) for x in (q, k, v)]
    for a, b in zip(cu[:-1], cu[1:], strict=True):
        if b > a:
            doc = [np.moveaxis(x[a:b], 0, -2) for x in (q, k, v, g)]
            for full, part in zip(out, qkv.attention_vjp(*doc, **opts), strict=True):
                full[a:b] = np.moveaxis(part, -2, 0)
    return out


@pytest.mark.parametrize("window", [None, (2, None), (3, 1)])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_varlen_equals_one_process(window: Any, layout: str, causal: bool) -> None:
    opts = {"causal": causal, "window": window}
    for world in (1, 2, 3, 4):
        cu, q, k, v, g = _problem(world, layout)
        want, want_lse = qkv.attention_varlen(q, k, v, cu, cu, return_lse=True, **opts)
        want_grads = _reference_vjp(q, k, v, g, cu, opts)

        def rank_fn(
            comm: Communicator, rank: int, world: int = world, arrays: Any = (cu, q, k, v, g)
        ) -> Any:
            cu, *whole = arrays
            sh = [shard_varlen(x, cu, rank, world, layout=layout) for x in whole]
            kw = {"comm": comm, "layout": layout, **opts}
            out, lse = ring_attention_varlen(*sh[:3], cu, return_lse=True, **kw)
            return out, lse, ring_attention_varlen_vjp(*sh[:3], sh[3], out, lse, cu, **kw)

        results = run_ring(world, rank_fn)
        for r in results:
            assert not isinstance(r, BaseException), r
        tag = f"W={world} {layout} causal={causal} window={window}"
        outs = [r[0] for r in results]
        _close(f"{tag} out", unshard_varlen(outs, cu, layout=layout), want)
        _close(f"{tag} lse", unshard_varlen([r[1] for r in results], cu, layout=layout), want_lse)
        for i, name in enumerate(("dq", "dk", "dv")):
            got = unshard_varlen([r[2][i] for r in results], cu, layout=layout)
            _close(f"{tag} {name}", got, want_grads[i])


def test_blocks_between_documents_are_skipped() -> None:
    """Contiguous over 2 ranks, each document cut in 2: a rank's step-1 blocks pair a
    document's half with the same document's other half only (never another document)."""
    cu, q, k, v, _ = _problem(2, "contiguous")

    def rank_fn(comm: Communicator, rank: int) -> Any:
        stats = RingStats()
        sh = [shard_varlen(x, cu, rank, 2, layout="contiguous") for x in (q, k, v)]
        ring_attention_varlen(*sh, cu, comm=comm, causal=True, layout="contiguous", stats=stats)
        return stats.blocks

    # 4 non-empty documents; step 0: every half with itself; step 1: rank 1's second halves
    # see rank 0's first halves, rank 0 (first halves) sees nothing of rank 1 under causal
    assert run_ring(2, rank_fn) == [4, 8]


@pytest.mark.parametrize(
    ("cu", "message"),
    [
        ([0, 8, 11], "document 1 has 3 tokens, which cannot be cut into 4 equal chunks"),
        ([0, 8, 4], "must be non-decreasing"),
        ([1, 8], "must start at 0"),
        ([0.0, 8.0], "expected integer offsets"),
    ],
)
def test_bad_cu_seqlens_refused_on_every_rank(cu: Any, message: str) -> None:
    x = np.ones((4, 1, 2))

    def rank_fn(comm: Communicator, rank: int) -> Any:
        return ring_attention_varlen(x, x, x, cu, comm=comm)

    for res in run_ring(2, rank_fn):
        assert isinstance(res, (qkv.InputError, qkv.InputTypeError)), res
        assert message in str(res), res


def test_ranks_disagreeing_on_cu_seqlens_refused_on_every_rank() -> None:
    x = np.ones((4, 1, 2))

    def rank_fn(comm: Communicator, rank: int) -> Any:
        return ring_attention_varlen(x, x, x, [0, 4, 8] if rank else [0, 8], comm=comm)

    for rank, res in enumerate(run_ring(2, rank_fn)):
        assert isinstance(res, qkv.InputError), res
        # what differs, in documents, not checksums of them
        assert (
            "disagree on cu_seqlens: rank 0 has 1 documents, rank 1 has 2 "
            f"(this is rank {rank})" in str(res)
        ), res


def test_ranks_disagreeing_on_a_document_length_name_the_document() -> None:
    x = np.ones((3, 1, 2))

    def rank_fn(comm: Communicator, rank: int) -> Any:
        cu = [0, 3, 6, 9] if rank < 2 else [0, 3, 3, 9]
        return ring_attention_varlen(x, x, x, cu, comm=comm, layout="contiguous")

    for res in run_ring(3, rank_fn):
        assert isinstance(res, qkv.InputError), res
        assert "document 1 has 3 tokens on rank 0 and 0 on rank 2" in str(res), res


def test_ranks_disagreeing_on_the_layout_alone_say_so() -> None:
    x = np.ones((4, 1, 2))

    def rank_fn(comm: Communicator, rank: int) -> Any:
        layout = "contiguous" if rank else "zigzag"
        return ring_attention_varlen(x, x, x, [0, 8], comm=comm, layout=layout)

    for res in run_ring(2, rank_fn):
        assert isinstance(res, qkv.InputError) and "disagree on layout" in str(res), res


def test_wrong_token_count_names_the_argument() -> None:
    x = np.ones((5, 1, 2))
    with pytest.raises(qkv.InputError, match=r"q: expected this rank's packed tokens"):
        ring_attention_varlen(x, x, x, [0, 8])


def test_shard_varlen_round_trip_and_refusal() -> None:
    cu = [0, 12, 12, 36]
    x = np.arange(36)
    for layout in ("zigzag", "contiguous"):
        parts = [shard_varlen(x, cu, r, 3, layout=layout) for r in range(3)]
        assert all(len(p) == 12 for p in parts)
        assert (unshard_varlen(parts, cu, layout=layout) == x).all()
    assert shard_varlen(x, cu, 0, 3).tolist() == [0, 1, 10, 11, 12, 13, 14, 15, 32, 33, 34, 35]
    with pytest.raises(qkv.InputError, match="cu_seqlens ends at 36"):
        shard_varlen(x[:30], cu, 0, 3)


def test_torch_tensors_and_autograd() -> None:
    torch = pytest.importorskip("torch")
    cu, q, k, v, g = _problem(2, "zigzag", seed=3)
    opts = {"causal": True, "window": (4, None)}
    want = qkv.attention_varlen(q, k, v, cu, cu, **opts)
    want_grads = _reference_vjp(q, k, v, g, cu, opts)

    def rank_fn(comm: Communicator, rank: int) -> Any:
        ts = [torch.tensor(shard_varlen(x, cu, rank, 2), requires_grad=True) for x in (q, k, v)]
        out = ring_attention_varlen(*ts, torch.tensor(cu), comm=comm, **opts)
        (out * torch.tensor(shard_varlen(g, cu, rank, 2))).sum().backward()
        with torch.no_grad():
            plain = ring_attention_varlen(*ts, cu, comm=comm, **opts)
        assert isinstance(plain, torch.Tensor) and plain.dtype == torch.float64
        return out.detach().numpy(), [t.grad.numpy() for t in ts]

    results = run_ring(2, rank_fn)
    for r in results:
        assert not isinstance(r, BaseException), r
    _close("out", unshard_varlen([r[0] for r in results], cu), want)
    for i in range(3):
        _close(f"grad {i}", unshard_varlen([r[1][i] for r in results], cu), want_grads[i])
