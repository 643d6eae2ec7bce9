"""qkv.distributed over MPI ranks: ``mpiexec -n 4`` running ``_ring_checks.py``.

The same checks as the torch launch (see ``test_distributed_torch.py``) for rings of 1…4 ranks
(sub-communicators of the 4), with NumPy buffers sent by ``Isend``/``Irecv``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install '.[mpi]')")
MPIEXEC = shutil.which("mpiexec")

import qkv  # noqa: E402

CHECKS = Path(__file__).with_name("_ring_checks.py")


def child_env() -> dict[str, str]:
    """The ranks import this qkv and run one thread each (4 ranks, few cores)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    src = str(Path(qkv.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return env


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install '.[mpi]')")
def test_ring_over_mpi_ranks() -> None:
    res = subprocess.run(
        [MPIEXEC, "-n", "4", sys.executable, str(CHECKS), "mpi"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for r in range(4):
        assert f"rank {r}: " in res.stdout
