"""qkv.distributed over real torch.distributed ranks (gloo on 127.0.0.1).

One launch of 4 spawned ranks runs every check in ``_ring_checks.py`` for rings of 1, 2, 3 and
4 ranks (sub-groups): float64 forward, lse and gradients equal to single-process
``qkv.attention`` / ``qkv.attention_vjp`` to 1e-12 (causal zigzag, causal contiguous,
non-causal, grouped heads, dv != d, a tiled-size case), float32/float16 within a small factor
of one process's own error, decode over a cache spread unevenly (one rank empty, and no keys at
all), tensors with autograd, and disagreeing ranks refused with InputError on every rank.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install '.[dist]')")

import qkv  # noqa: E402

CHECKS = Path(__file__).with_name("_ring_checks.py")


def child_env() -> dict[str, str]:
    """The children import this qkv and each rank runs one thread (4 ranks, few cores)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    src = str(Path(qkv.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return env


def test_ring_over_torch_distributed_ranks() -> None:
    res = subprocess.run(
        [sys.executable, str(CHECKS), "torch", "4"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for r in range(4):
        assert f"rank {r}: " in res.stdout
