"""Benchmarks give both sides the same threads (issue 33, item 16): with ``--threads n`` qkv's
kernels get the ``n`` threads PyTorch gets, not every core the process may run on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def test_same_threads_holds_qkv_to_the_threads_torch_gets():
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import _common\n"
        "from qkv.engine.kernels.threads import default_threads\n"
        "_common.same_threads(1)\n"
        "print(default_threads(), _common.threads_info())"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("OMP_NUM_THREADS", None)
    run = subprocess.run(
        [sys.executable, "-c", code, str(BENCH)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    first, info = run.stdout.split(" ", 1)
    assert first == "1" and info.startswith("qkv 1;"), run.stdout


def test_the_model_benchmarks_hold_qkv_to_their_threads():
    for name in ("generate.py", "decode_routes.py"):
        text = (BENCH / name).read_text(encoding="utf-8")
        assert "torch.set_num_threads(args.threads)" in text
        assert "_common.same_threads(args.threads)" in text, name


def test_the_ring_benchmark_says_which_size_it_compares():
    text = (BENCH / "ring.py").read_text(encoding="utf-8")
    assert "n_peer = min(args.sizes)" in text and "at the largest size" not in text
