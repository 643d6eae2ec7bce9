"""qkv.distributed in one process: layouts, argument errors, and a ring of one."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tests.conftest import bound, tol

import qkv
from qkv.distributed import positions, ring_attention, ring_attention_vjp, shard, unshard


@given(
    world=st.integers(1, 6),
    per=st.integers(0, 4),
    layout=st.sampled_from(["zigzag", "contiguous"]),
    width=st.integers(1, 3),
)
def test_shard_unshard_round_trip(world: int, per: int, layout: str, width: int) -> None:
    n = per * (2 * world if layout == "zigzag" else world)
    x = np.arange(n * width).reshape(n, width)
    parts = [shard(x, r, world, layout=layout) for r in range(world)]
    assert (unshard(parts, layout=layout) == x).all()
    # positions say which rows each rank holds, and together they are every position once
    got = [positions(n, r, world, layout=layout) for r in range(world)]
    for r in range(world):
        assert (parts[r] == x[got[r]]).all()
    assert sorted(np.concatenate(got).tolist()) == list(range(n))


def test_zigzag_chunks_are_r_and_2w_minus_1_minus_r() -> None:
    assert positions(16, 1, 4).tolist() == [2, 3, 12, 13]
    assert positions(16, 1, 4, layout="contiguous").tolist() == [4, 5, 6, 7]


def test_shard_refuses_uneven_sequences() -> None:
    with pytest.raises(qkv.InputError, match=r"7 tokens .* world size 2"):
        shard(np.zeros((7, 2)), 0, 2)
    with pytest.raises(qkv.InputError, match="layout"):
        shard(np.zeros((8, 2)), 0, 2, layout="striped")
    with pytest.raises(qkv.InputError, match="rank"):
        shard(np.zeros((8, 2)), 2, 2)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_ring_of_one_equals_attention(layout: str, dtype: type) -> None:
    rng = np.random.default_rng(1)
    q = rng.standard_normal((4, 10, 8)).astype(dtype)
    k, v = rng.standard_normal((2, 2, 10, 8)).astype(dtype)
    g = rng.standard_normal((4, 10, 8)).astype(dtype)
    out, lse = ring_attention(q, k, v, causal=True, layout=layout, return_lse=True)
    want, want_lse = qkv.attention(q, k, v, causal=True, return_lse=True)
    assert out.dtype == dtype and lse.dtype == want_lse.dtype
    np.testing.assert_allclose(out, want, atol=bound("ring of one", dtype))
    grads = ring_attention_vjp(q, k, v, g, out, lse, causal=True, layout=layout)
    for got, ref in zip(grads, qkv.attention_vjp(q, k, v, g, causal=True), strict=True):
        assert got.dtype == dtype and got.shape == ref.shape
        np.testing.assert_allclose(got, ref, **tol("ring of one, backward", dtype))


def test_bad_arguments_are_input_errors() -> None:
    x = np.zeros((5, 4))
    with pytest.raises(qkv.InputError, match=r"5 tokens .*zigzag.*world size 1"):
        ring_attention(x, x, x)
    with pytest.raises(qkv.InputError, match="same tokens"):
        ring_attention(np.zeros((4, 4)), np.zeros((6, 4)), np.zeros((6, 4)), layout="contiguous")
    with pytest.raises(qkv.InputTypeError, match="comm"):
        ring_attention(np.zeros((4, 4)), np.zeros((4, 4)), np.zeros((4, 4)), comm="world")
    out, lse = ring_attention(np.zeros((4, 4)), np.zeros((4, 4)), np.zeros((4, 4)), return_lse=True)
    with pytest.raises(qkv.InputError, match="lse"):
        ring_attention_vjp(x[:4], x[:4], x[:4], out, out, lse[:2])


def test_import_does_not_pull_in_torch_or_mpi() -> None:
    code = (
        "import sys, qkv, qkv.distributed; "
        "bad = [m for m in ('torch', 'mpi4py') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
