"""The GPU package (qkv.gpu): its Triton kernels under the interpreter, and the routing to it.

The kernels themselves are checked in a subprocess running tests/gpu_interpreted_cases.py with
``TRITON_INTERPRET=1`` (Triton must see it before its first import, which in this process may
already have happened); the subprocess is bounded by a timeout and its output is shown on
failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import qkv

torch = pytest.importorskip("torch", reason="the gpu path takes torch tensors")
pytest.importorskip("triton", reason="the gpu extra (triton) is not installed")

CASES = Path(__file__).with_name("gpu_interpreted_cases.py")


def test_kernels_equal_the_reference_under_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    src = str(Path(qkv.__file__).resolve().parents[1])  # the qkv being tested comes first
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)]
    run = subprocess.run(
        cmd, env=env, cwd=CASES.parents[1], capture_output=True, text=True, timeout=600
    )
    tail = (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0, tail
    assert " passed" in tail and "skipped" not in tail.split("passed")[-1], tail


def test_device_tensors_are_routed_to_the_gpu_package(monkeypatch):
    from qkv.gpu import api

    seen = {}

    def spy(call):
        seen.update(causal=call.plan.causal, kernel=call.kernel)
        return "routed"

    monkeypatch.setattr(api, "run", spy)
    # meta tensors stand in for CUDA ones here; the front refuses meta itself (tested below)
    monkeypatch.setattr(qkv.front, "one_device", lambda given: None)
    q = torch.empty((1, 2, 3, 4), device="meta")
    assert qkv.attention(q, q, q, causal=True, kernel="decode") == "routed"
    assert seen["causal"] is True and seen["kernel"] == "decode"
    monkeypatch.setitem(sys.modules, "qkv.gpu.api", None)  # as if Triton were not installed
    with pytest.raises(qkv.InputError, match="qkv\\[gpu\\]"):
        qkv.attention(q, q, q)


def test_devices_the_kernels_do_not_run_on_are_refused():
    meta = torch.empty((1, 2, 3, 4), device="meta")
    with pytest.raises(qkv.InputError, match=r"k: tensors on device meta.*\.cuda\(\)"):
        qkv.attention(torch.ones(1, 2, 3, 4), meta, meta)


def test_cpu_tensors_reach_the_kernels_only_under_the_interpreter():
    from qkv.gpu import _kernels, api

    if _kernels.INTERPRETED:
        pytest.skip("this process interprets the kernels")
    q = torch.ones((1, 1, 2, 4))
    with pytest.raises(qkv.InputError, match="TRITON_INTERPRET"):
        api.attention(q, q, q)
